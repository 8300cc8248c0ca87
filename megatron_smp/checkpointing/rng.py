"""Capture and restore every random generator a training step uses, per rank.

States hold only tensors and plain data, so they load with `weights_only=True`: numpy's
key array becomes an int64 tensor, Python's state stays a tuple of ints.
"""
from __future__ import annotations

import io
import random
import warnings
from typing import Any, Dict

import torch


def _tensor_parallel_tracker():
    # Written by the tensor_parallel package; absent in a partial tree, hence the lazy import.
    try:
        from megatron_smp.tensor_parallel.random import get_rng_tracker
    except ImportError:
        return None
    return get_rng_tracker()


def _device_type() -> str:
    """The device type the accelerator generator and the tracker's streams belong to: their
    states are that device's (a CPU generator state is 5056 bytes, a CUDA one 16)."""
    tracker = _tensor_parallel_tracker()
    if tracker is not None and tracker.device is not None:
        return tracker.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_rng_state() -> Dict[str, Any]:
    """This rank's python, numpy, torch CPU, accelerator and tensor-parallel tracker states,
    and the device type the last two belong to."""
    states: Dict[str, Any] = {
        "device_type": _device_type(),
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
    """Restore what `get_rng_state` captured (entries it did not capture are left alone).

    The accelerator and tensor-parallel states are restored only on the device type that
    saved them (a checkpoint saved on CPU and resumed on GPU, or the reverse, keeps this
    run's, with a warning); the host generators always are. States saved before the device
    type was recorded are taken to be this device's."""
    saved_type = states.get("device_type")
    here = _device_type()
    same_device = saved_type is None or saved_type == here
    if not same_device:
        warnings.warn(
            f"the RNG states were saved on {saved_type}, this run draws on {here}: the "
            f"{saved_type} generator and tensor-parallel streams are not restored (python, "
            "numpy and torch CPU are), so dropout draws differ from an uninterrupted run"
        )
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
    if "cuda" in states and same_device and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    if "tensor_parallel" in states and same_device:
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
