"""Hybrid stacks: Megatron's --hybrid-layer-pattern and --linear-attention-freq as layer specs.

--hybrid-layer-pattern gives one symbol per layer, and each layer is one part behind a
pre-norm and a residual (Megatron's MambaLayer / hybrid layers; Nemotron-H's blocks):

    M  MambaMixer      G  GatedDeltaNet     *  SelfAttention (the model's core attention)
    -  MLP             E  MoELayer          |  a pipeline stage break (no layer)

    x = x + drop(mixer(norm(x)))

--linear-attention-freq (with --experimental-attention-variant gated_delta_net) keeps the GPT
layer (attention + MLP / MoE) and puts a Gated DeltaNet in place of the attention on the
layers it marks (Qwen3-Next, Qwen3.5).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_smp.config import TransformerConfig
from megatron_smp.tensor_parallel.mappings import group_size
from megatron_smp.transformer.layer import TransformerLayer
from megatron_smp.transformer.mlp import MLP
from megatron_smp.transformer.moe.moe_layer import MoELayer
from megatron_smp.transformer.norm import build_norm
from megatron_smp.transformer.spec import LayerSpec, ModuleSpec, build_module, spec_for_layer
from megatron_smp.transformer.ssm.gated_delta_net import GatedDeltaNet
from megatron_smp.transformer.ssm.mamba_mixer import MambaMixer

# Parts that read the sequence (take the mask and rotary embeddings), and those that do not.
_SEQUENCE_MIXERS = ("M", "G", "*")


class HybridLayer(TransformerLayer):
    """One symbol of --hybrid-layer-pattern: forward(hidden_states [s(/tp), b, h],
    attention_mask=None, rotary_pos_emb=None) -> [s(/tp), b, h]; parameters `norm.*` and
    `mixer.*` (Megatron's names). `submodules` is the part's spec."""

    def __init__(self, config: TransformerConfig, state, layer_number: int = 1,
                 submodules: Optional[ModuleSpec] = None, device=None,
                 symbol: str = "M") -> None:
        torch.nn.Module.__init__(self)  # not TransformerLayer's parts: one norm, one mixer
        self.layer_number = layer_number
        self.symbol = symbol
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = config.sequence_parallel_at(group_size(state.tp_group))
        self.norm = build_norm(config, sequence_parallel=self.sequence_parallel, device=device)
        self.mixer = build_module(submodules, config, state, layer_number=layer_number,
                                  device=device)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                rotary_pos_emb=None) -> torch.Tensor:
        normed = self.norm(hidden_states)
        if self.symbol in _SEQUENCE_MIXERS:
            output = self.mixer(normed, attention_mask, rotary_pos_emb)
        else:
            output = self.mixer(normed)
        return hidden_states + self._dropout(output)


class HybridMTPStack(torch.nn.Module):
    """The layers of one multi-token-prediction depth of a hybrid pattern (the part after a
    `/`, Megatron's HybridStack inside an MTP layer): `layers.<j>` are `HybridLayer`s of the
    depth's symbols, run in turn; forward as `HybridLayer`'s. All take the depth's layer
    number (num_layers + depth, Megatron's numbering of MTP routers)."""

    def __init__(self, config: TransformerConfig, state, layer_number: int = 1,
                 submodules=None, device=None, symbols: str = "") -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            HybridLayer(config, state, layer_number, submodules[symbol], device, symbol=symbol)
            for symbol in symbols)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                rotary_pos_emb=None) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, rotary_pos_emb)
        return hidden_states


def hybrid_layer_spec(config: TransformerConfig, attention: ModuleSpec) -> LayerSpec:
    """The `LayerSpec` of --hybrid-layer-pattern; `attention` is the model's attention spec
    (with its core attention) for the `*` layers. Layer numbers past the decoder's (the
    multi-token-prediction depths of the pattern's `/` parts) give a `HybridMTPStack`."""
    parts = {"M": ModuleSpec(MambaMixer), "G": ModuleSpec(GatedDeltaNet), "*": attention,
             "-": ModuleSpec(MLP), "E": ModuleSpec(MoELayer)}
    symbols = config.hybrid_layer_symbols()

    def spec_of(layer_number: int) -> ModuleSpec:
        if layer_number > config.num_layers:
            return ModuleSpec(HybridMTPStack, {"symbols": config.hybrid_mtp_symbols()}, parts)
        symbol = symbols[config.layer_pattern_number(layer_number) - 1]
        return ModuleSpec(HybridLayer, {"symbol": symbol}, parts[symbol])

    return spec_of


def linear_attention_layer_spec(config: TransformerConfig, layer_spec: LayerSpec) -> LayerSpec:
    """`layer_spec` with a Gated DeltaNet as the attention of the --linear-attention-freq
    layers (the MLP / MoE choice of `layer_spec` kept)."""
    pattern = config.linear_attention_pattern()

    def spec_of(layer_number: int) -> ModuleSpec:
        spec = spec_for_layer(layer_spec, layer_number)
        if not pattern[config.layer_pattern_number(layer_number) - 1]:
            return spec
        return ModuleSpec(spec.module, dict(spec.params), dataclasses.replace(
            spec.submodules, self_attention=ModuleSpec(GatedDeltaNet)))

    return spec_of


__all__ = ["HybridLayer", "HybridMTPStack", "hybrid_layer_spec",
           "linear_attention_layer_spec"]
