"""Layer specs: which module builds each part of a transformer layer (Megatron's ModuleSpec).

A model swaps a part (the MLP for a mixture of experts, the core attention for a
context-parallel one) by giving another spec, not by branching inside the layer:

    spec = get_gpt_layer_spec(config)                 # SelfAttention(DotProductAttention) + MLP
    spec.submodules.mlp = ModuleSpec(MoELayer)        # e.g. a MoE layer
    TransformerBlock(config, state, layer_spec=spec)  # or layer_spec=lambda n: ... per layer

Every module built from a spec is called as `module(config, state, **spec.params,
[submodules=spec.submodules], **call_kwargs)`: the `ParallelState` travels down with the
config, so a part that needs a process group takes it from there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Union

import torch


@dataclass
class ModuleSpec:
    """`module` (a class or factory) with extra constructor keyword arguments and, for
    composite modules, the specs of their parts."""

    module: Callable[..., torch.nn.Module]
    params: Dict[str, Any] = field(default_factory=dict)
    submodules: Optional[Any] = None


def build_module(spec: ModuleSpec, *args, **kwargs) -> torch.nn.Module:
    """Instantiate `spec` with positional `args` (config, state, ...) and keyword `kwargs`."""
    if spec.submodules is not None:
        kwargs["submodules"] = spec.submodules
    return spec.module(*args, **spec.params, **kwargs)


@dataclass
class SelfAttentionSubmodules:
    core_attention: ModuleSpec


@dataclass
class TransformerLayerSubmodules:
    self_attention: ModuleSpec
    mlp: ModuleSpec


# A block takes one spec for every layer, or a function of the global 1-based layer number
# (e.g. MoE on every other layer).
LayerSpec = Union[ModuleSpec, Callable[[int], ModuleSpec]]


def spec_for_layer(layer_spec: LayerSpec, layer_number: int) -> ModuleSpec:
    return layer_spec if isinstance(layer_spec, ModuleSpec) else layer_spec(layer_number)


__all__ = [
    "ModuleSpec",
    "build_module",
    "SelfAttentionSubmodules",
    "TransformerLayerSubmodules",
    "LayerSpec",
    "spec_for_layer",
]
