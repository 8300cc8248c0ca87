"""The model inside its wrappers: one rule for every caller."""
from __future__ import annotations

import torch


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The model chunk inside `module`'s wrappers (our DDP, the FSDP2 wrapper and smp's
    transform keep it as `.module`): the first module down that is a model (a `decoder`, or a
    pipeline stage's `set_input_tensor`), or has nothing inside."""
    while (hasattr(module, "module") and not hasattr(module, "decoder")
           and not hasattr(module, "set_input_tensor")):
        module = module.module
    return module
