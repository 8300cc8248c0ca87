"""--torch-compile: torch.compile of each transformer layer (torchtitan's per-block compile).

Compiling per layer keeps every layer one graph that the others reuse, leaves the pipeline
and data-parallel machinery (grad hooks, buckets, p2p) in eager code around it, and keeps
the state-dict keys: `Module.compile()` compiles the forward in place, unlike the
`torch.compile(module)` wrapper that adds `_orig_mod.` to every key (and so to checkpoints).
"""
from __future__ import annotations

import torch

from megatron_smp.config import ConfigError
from megatron_smp.transformer.layer import TransformerLayer


def compile_transformer_layers(model: torch.nn.Module, backend: str) -> int:
    """Compile the forward of every TransformerLayer inside `model` with `backend` (e.g.
    "inductor"); returns how many were compiled. Layer inputs and outputs keep their shapes
    ([s, b, h]); numerics match eager to kernel-fusion rounding."""
    import torch._dynamo

    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ConfigError(
            f"--torch-compile {backend}: unknown torch.compile backend; use one of "
            f"{sorted(torch._dynamo.list_backends())} (or the flag alone for inductor)"
        )
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)
