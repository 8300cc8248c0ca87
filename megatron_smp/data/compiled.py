"""The C index builders of helpers.c, compiled at first use (`megatron_smp.native`) and loaded
with ctypes. Without a working compiler `library()` returns None after one warning, and
indices.py runs its numpy/Python path: the same arrays, slower.
`MEGATRON_SMP_NO_COMPILED_HELPERS=1` forces that path.
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional

from megatron_smp import native
from megatron_smp.native import address

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers.c")
# -ffp-contract=off: no fused multiply-add, so `weight * i - drawn` rounds as in the Python path.
# -O2, not -O3: -O3 turns the blending argmax into a slower maxsd chain (measured).
_FLAGS = ["-O2", "-shared", "-fPIC", "-std=c99", "-ffp-contract=off"]
FALLBACK = "dataset indices use the numpy/Python path (same arrays, slower at millions of samples)"


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
    return native.load_library(_SOURCE, _FLAGS, _declare, FALLBACK)


__all__ = ["library", "address"]
