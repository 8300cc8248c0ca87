"""Helpers shared by the transformer modules."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Tuple

import torch

_SEED_MODULUS = 2**63 - 1


def derive_seed(base_seed: int, index: int) -> int:
    """A seed for part `index` of a model, decorrelated from its neighbours' seeds."""
    return (base_seed * 1_000_003 + 7_919 * (index + 1)) % _SEED_MODULUS


@contextlib.contextmanager
def init_rng_scope(seed: Optional[int]) -> Iterator[None]:
    """Build parameters from the CPU default generator seeded with `seed`, then restore it.

    The tensor-parallel layers draw their master weights from the CPU default generator in
    construction order; seeding it per model part (embedding, each layer by its global
    number, output layer) makes each part's weights independent of which other parts this
    process builds, so a pipeline stage gets exactly the single-stage model's weights.
    `None` draws from the generator as it is.
    """
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield




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
