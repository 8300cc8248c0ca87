"""Capture and restore every random generator a training step uses, per rank.

States hold only tensors and plain data, so they load with `weights_only=True`: numpy's
key array becomes an int64 tensor, Python's state stays a tuple of ints.
"""
from __future__ import annotations

import io
import random
from typing import Any, Dict

import torch


def _tensor_parallel_tracker():
    # Written by the tensor_parallel package; absent in a partial tree, hence the lazy import.
    try:
        from megatron_smp.tensor_parallel.random import get_rng_tracker
    except ImportError:
        return None
    return get_rng_tracker()


def get_rng_state() -> Dict[str, Any]:
    """This rank's python, numpy, torch CPU, accelerator and tensor-parallel tracker states."""
    states: Dict[str, Any] = {
        "python": random.getstate(),
        "torch_cpu": torch.get_rng_state(),
    }
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
        states["numpy"] = {
            "bit_generator": str(name),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    tracker = _tensor_parallel_tracker()
    if tracker is not None:
        states["tensor_parallel"] = tracker.get_states()
    return states


def set_rng_state(states: Dict[str, Any]) -> None:
    """Restore what `get_rng_state` captured (entries it did not capture are left alone)."""
    if "python" in states:
        version, internal, gauss_next = states["python"]
        random.setstate((version, tuple(internal), gauss_next))
    if "torch_cpu" in states:
        torch.set_rng_state(states["torch_cpu"])
    if "numpy" in states:
        import numpy as np

        saved = states["numpy"]
        np.random.set_state(
            (
                saved["bit_generator"],
                saved["keys"].numpy().astype(np.uint32),
                saved["pos"],
                saved["has_gauss"],
                saved["cached_gaussian"],
            )
        )
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    if "tensor_parallel" in states:
        tracker = _tensor_parallel_tracker()
        if tracker is not None:
            tracker.set_states(states["tensor_parallel"])


def rng_state_to_bytes(states: Dict[str, Any]) -> bytes:
    """One opaque value per rank (DCP would otherwise flatten and deduplicate its parts)."""
    buffer = io.BytesIO()
    torch.save(states, buffer)
    return buffer.getvalue()


def rng_state_from_bytes(data: bytes) -> Dict[str, Any]:
    return torch.load(io.BytesIO(data), weights_only=True)
