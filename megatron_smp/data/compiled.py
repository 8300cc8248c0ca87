"""The C index builders of helpers.c, compiled at first use and loaded with ctypes.

megatron-core compiles its `helpers_cpp` at first use too; ours is plain C (no pybind11, no
Python headers), built with the system's C compiler (`$CC`, else `cc` or `gcc`) into a cache
directory (`$MEGATRON_SMP_HELPERS_DIR`, else `$XDG_CACHE_HOME/megatron_smp` or
`~/.cache/megatron_smp`, else the temp directory), keyed by a hash of the source, the
compiler and the machine, so every process after the first just loads it. Without a working
compiler `library()` returns None after one warning, and indices.py runs its numpy/Python
path: the same arrays, slower. `MEGATRON_SMP_NO_COMPILED_HELPERS=1` forces that path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from typing import List, Optional

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers.c")
# -ffp-contract=off: no fused multiply-add, so `weight * i - drawn` rounds as in the Python path.
# -O2, not -O3: -O3 turns the blending argmax into a slower maxsd chain (measured).
_FLAGS = ["-O2", "-shared", "-fPIC", "-std=c99", "-ffp-contract=off"]
_DISABLE_ENV = "MEGATRON_SMP_NO_COMPILED_HELPERS"

_loaded = False
_library: Optional[ctypes.CDLL] = None


def _compiler() -> Optional[List[str]]:
    configured = os.environ.get("CC")
    if configured:
        return configured.split()
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _cache_dirs() -> List[str]:
    configured = os.environ.get("MEGATRON_SMP_HELPERS_DIR")
    if configured:
        return [configured]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [os.path.join(base, "megatron_smp"), os.path.join(tempfile.gettempdir(), "megatron_smp")]


def _build(compiler: List[str], source: bytes) -> Optional[str]:
    """The path of the compiled library, compiling it if no cache directory holds it yet."""
    key = hashlib.sha1(
        source + " ".join(compiler + _FLAGS).encode() + platform.machine().encode()
    ).hexdigest()[:16]
    name = f"msmp_helpers-{key}.so"
    errors = []
    for directory in _cache_dirs():
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
        try:
            os.makedirs(directory, exist_ok=True)
            # Ranks sharing the directory may compile at once: each writes its own file and
            # the atomic rename leaves one complete library.
            tmp_path = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
            result = subprocess.run(
                compiler + _FLAGS + ["-o", tmp_path, _SOURCE],
                capture_output=True, text=True, timeout=120,
            )
            if result.returncode != 0:
                if os.path.exists(tmp_path):
                    os.remove(tmp_path)
                errors.append(f"{' '.join(compiler)} failed: {result.stderr.strip()[-500:]}")
                break  # another directory will not fix the source or the compiler
            os.replace(tmp_path, path)
            return path
        except (OSError, subprocess.SubprocessError) as error:
            errors.append(f"{directory}: {error}")
    logger.warning(
        "megatron_smp: cannot build the C index helpers (%s); dataset indices use the "
        "numpy/Python path (same arrays, slower at millions of samples)", "; ".join(errors),
    )
    return None


def _declare(library: ctypes.CDLL) -> None:
    pointer, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    library.msmp_build_blending_indices.argtypes = [pointer] * 4 + [i32, i64]
    library.msmp_build_blending_indices.restype = None
    library.msmp_build_exhaustive_blending_indices.argtypes = [pointer] * 6 + [i32, i64]
    library.msmp_build_exhaustive_blending_indices.restype = None
    for suffix in ("i32", "i64"):
        total = getattr(library, f"msmp_total_tokens_{suffix}")
        total.argtypes, total.restype = [pointer, pointer, i64], i64
        sample = getattr(library, f"msmp_build_sample_index_{suffix}")
        sample.argtypes, sample.restype = [pointer] * 3 + [i64] * 4, None


def library() -> Optional[ctypes.CDLL]:
    """The loaded helpers, or None (no compiler, a failed build, or the fallback forced by
    MEGATRON_SMP_NO_COMPILED_HELPERS=1); built once per process."""
    global _loaded, _library
    if os.environ.get(_DISABLE_ENV, "0") not in ("", "0"):
        return None
    if _loaded:
        return _library
    _loaded = True
    compiler = _compiler()
    if compiler is None:
        logger.warning(
            "megatron_smp: no C compiler found ($CC, cc, gcc, clang); dataset indices use the "
            "numpy/Python path (same arrays, slower at millions of samples); install gcc"
        )
        return None
    with open(_SOURCE, "rb") as handle:
        path = _build(compiler, handle.read())
    if path is None:
        return None
    try:
        loaded = ctypes.CDLL(path)
        _declare(loaded)
    except (OSError, AttributeError) as error:
        logger.warning(
            "megatron_smp: cannot load the C index helpers %s (%s); using the numpy/Python "
            "path", path, error,
        )
        return None
    _library = loaded
    return _library


def address(array) -> int:
    """The data pointer of a C-contiguous numpy array, for ctypes."""
    return array.ctypes.data


__all__ = ["library", "address"]
