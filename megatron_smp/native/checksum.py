"""CRC-32 of checkpoint bytes: zlib's polynomial and values, from crc32.c (carry-less multiply
folding, ~14 GB/s on one x86-64 core against zlib's ~4) when it builds, else `zlib.crc32`.

Both release the GIL for the length of the call, so a reader thread can fill the next block
while the caller checksums this one. Files written with either verify with either.
"""
from __future__ import annotations

import ctypes
import os
import zlib
from typing import Optional

import numpy

from megatron_smp import native

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crc32.c")
_FLAGS = ["-O2", "-shared", "-fPIC", "-std=c99"]
FALLBACK = "checkpoint checksums use zlib.crc32 (the same values, about 3x slower)"
# Below this many bytes the ctypes call costs more than zlib's loop.
_SMALL = 4096


def _declare(library: ctypes.CDLL) -> None:
    for name in ("msmp_crc32", "msmp_crc32_table"):
        function = getattr(library, name)
        function.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        function.restype = ctypes.c_uint32
    library.msmp_crc32_accelerated.argtypes, library.msmp_crc32_accelerated.restype = [], \
        ctypes.c_int
    library.msmp_crc32_init.argtypes, library.msmp_crc32_init.restype = [], None
    library.msmp_crc32_init()  # once, before any thread calls msmp_crc32


_accelerated: Optional[ctypes.CDLL] = None


def library() -> Optional[ctypes.CDLL]:
    """crc32.c, loaded, where its fast path runs on this CPU; None where it cannot build, has
    no fast path here (zlib is then as fast) or MEGATRON_SMP_NO_COMPILED_HELPERS=1."""
    global _accelerated
    if native.disabled():
        return None
    if _accelerated is None:
        loaded = native.load_library(_SOURCE, _FLAGS, _declare, FALLBACK)
        if loaded is None or not loaded.msmp_crc32_accelerated():
            return None
        _accelerated = loaded
    return _accelerated


def crc32(data, value: int = 0) -> int:
    """zlib.crc32(data, value) for any C-contiguous buffer (bytes, bytearray, memoryview,
    numpy arrays)."""
    view = memoryview(data)
    if view.nbytes >= _SMALL:
        library_ = library()
        if library_ is not None:
            if view.c_contiguous:  # read-only ones too (bytes), which ctypes will not take
                pointer = numpy.frombuffer(view.cast("B"), dtype=numpy.uint8).ctypes.data
                return library_.msmp_crc32(value, pointer, view.nbytes)
    return zlib.crc32(view, value)


__all__ = ["crc32", "library"]
