"""Helpers shared by the transformer modules."""
from __future__ import annotations

from typing import Tuple

import torch

# The seeding helpers live with the other RNG code; the model parts import them from here.
from megatron_smp.tensor_parallel.random import derive_seed, init_rng_scope

# CUDA device index -> compute capability.
_CAPABILITY = {}


def device_capability(device: torch.device) -> Tuple[int, int]:
    """The CUDA compute capability of `device` ((0, 0) off CUDA), asked once per device."""
    if device.type != "cuda":
        return (0, 0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


__all__ = ["derive_seed", "init_rng_scope", "device_capability"]
