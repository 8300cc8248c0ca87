"""One pre-norm decoder layer over [s, b, h] activations.

    sequential (GPT, Llama):  x = x + drop(attn(ln1(x)));  x = x + drop(mlp(ln2(x)))
    parallel residual (NeoX): x = x + drop(attn(ln1(x))) + drop(mlp(ln2(x)))
    parallel, one norm (GPT-J): x = x + (drop(attn(ln1(x))) + drop(mlp(ln1(x))))
    sandwich (Gemma 2/3):     x = x + drop(ln1'(attn(ln1(x))));  x = x + drop(ln2'(mlp(ln2(x))))
"""
from __future__ import annotations

import contextlib
from typing import Optional, Union

import torch

from megatron_smp.config import TransformerConfig, recompute_modules
from megatron_smp.tensor_parallel.mappings import group_size
from megatron_smp.tensor_parallel.random import (
    CheckpointWithoutOutput,
    checkpoint,
    dropout,
    get_rng_tracker,
)
from megatron_smp.transformer.attention import (
    DotProductAttention,
    LayerTypeRotaryEmbeddings,
    RotaryEmbeddings,
    SelfAttention,
)
from megatron_smp.transformer.mlp import MLP
from megatron_smp.transformer.norm import build_norm
from megatron_smp.transformer.spec import (
    ModuleSpec,
    SelfAttentionSubmodules,
    TransformerLayerSubmodules,
    build_module,
)


def default_layer_submodules() -> TransformerLayerSubmodules:
    """The dense decoder layer: SelfAttention over DotProductAttention, then the MLP."""
    return TransformerLayerSubmodules(
        self_attention=ModuleSpec(
            SelfAttention,
            submodules=SelfAttentionSubmodules(core_attention=ModuleSpec(DotProductAttention)),
        ),
        mlp=ModuleSpec(MLP),
    )


def get_gpt_layer_spec() -> ModuleSpec:
    """Spec of the dense GPT / Llama decoder layer (Megatron's
    `get_gpt_layer_local_spec`); a new attention or MLP is a change of its submodules."""
    return ModuleSpec(TransformerLayer, submodules=default_layer_submodules())


class TransformerLayer(torch.nn.Module):
    """forward(hidden_states [s(/tp), b, h], attention_mask=None, rotary_pos_emb=None)
    -> [s(/tp), b, h]. `layer_number` is global (1-based), whatever the pipeline stage.

    `submodules` says which attention and MLP to build (default: `SelfAttention` with
    `DotProductAttention`, and the dense `MLP`); each is built as
    `module(config, state, layer_number=..., device=...)`.
    """

    def __init__(
        self,
        config: TransformerConfig,
        state,
        layer_number: int = 1,
        submodules: Optional[TransformerLayerSubmodules] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        submodules = submodules or default_layer_submodules()
        self.layer_number = layer_number
        self.parallel_residual = config.parallel_residual
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = config.sequence_parallel_at(group_size(state.tp_group))
        self.input_layernorm = build_norm(
            config, sequence_parallel=self.sequence_parallel, device=device
        )
        self.self_attention = build_module(
            submodules.self_attention, config, state, layer_number=layer_number, device=device
        )
        self.pre_mlp_layernorm = None if config.parallel_residual_shared_norm else build_norm(
            config, sequence_parallel=self.sequence_parallel, device=device
        )
        self.mlp = build_module(
            submodules.mlp, config, state, layer_number=layer_number, device=device
        )
        # --sandwich-norm: each branch's output normalised again before its residual add.
        self.post_self_attn_layernorm = self.post_mlp_layernorm = None
        if config.sandwich_norm:
            self.post_self_attn_layernorm = build_norm(
                config, sequence_parallel=self.sequence_parallel, device=device)
            self.post_mlp_layernorm = build_norm(
                config, sequence_parallel=self.sequence_parallel, device=device)
        # Which RoPE table this layer takes when the sliding-window layers have their own
        # (--local-rotary-base).
        self.sliding_window = config.layer_window_size(layer_number) is not None
        # --recompute-granularity selective --recompute-modules (Megatron's TransformerLayer):
        # "layernorm" discards both norms' outputs after use and recomputes them in backward;
        # "mlp" recomputes a dense MLP ("core_attn" is SelfAttention's).
        modules = recompute_modules(config)
        self.recompute_layernorm = "layernorm" in modules
        self.recompute_mlp = "mlp" in modules and isinstance(self.mlp, MLP)

    def _dropout_rng(self):
        # With SP each TP rank holds a different sequence shard: draw independent masks.
        # Otherwise the activations are replicated and every rank must draw the same mask.
        if self.sequence_parallel:
            return get_rng_tracker().fork()
        return contextlib.nullcontext()

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.hidden_dropout == 0.0:
            return x
        with self._dropout_rng():
            return dropout(x, self.hidden_dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Union[None, RotaryEmbeddings, LayerTypeRotaryEmbeddings] = None,
    ) -> torch.Tensor:
        recompute = self.training and torch.is_grad_enabled()
        if isinstance(rotary_pos_emb, LayerTypeRotaryEmbeddings):
            rotary_pos_emb = rotary_pos_emb.for_layer(self.sliding_window)
        if self.pre_mlp_layernorm is None:  # GPT-J: one norm's output feeds both branches
            def both_branches(x):
                attention_output = self.self_attention(x, attention_mask, rotary_pos_emb)
                mlp_output = self._mlp(x, recompute)
                return self._dropout(attention_output) + self._dropout(mlp_output)

            return hidden_states + self._normed(self.input_layernorm, hidden_states, recompute,
                                                both_branches)
        attention_output = self._normed(self.input_layernorm, hidden_states, recompute,
                                        lambda x: self.self_attention(x, attention_mask,
                                                                      rotary_pos_emb))
        if self.parallel_residual:
            mlp_output = self._normed(self.pre_mlp_layernorm, hidden_states, recompute,
                                      lambda x: self._mlp(x, recompute))
            return hidden_states + self._dropout(attention_output) + self._dropout(mlp_output)
        if self.post_self_attn_layernorm is not None:
            attention_output = self.post_self_attn_layernorm(attention_output)
        hidden_states = hidden_states + self._dropout(attention_output)
        mlp_output = self._normed(self.pre_mlp_layernorm, hidden_states, recompute,
                                  lambda x: self._mlp(x, recompute))
        if self.post_mlp_layernorm is not None:
            mlp_output = self.post_mlp_layernorm(mlp_output)
        return hidden_states + self._dropout(mlp_output)

    def _normed(self, norm, hidden_states, recompute: bool, consumer):
        """consumer(norm(hidden_states)), the norm's output discarded until backward with
        --recompute-modules layernorm."""
        if not (recompute and self.recompute_layernorm):
            return consumer(norm(hidden_states))
        discarding = CheckpointWithoutOutput()
        output = consumer(discarding.checkpoint(norm, hidden_states))
        discarding.discard_output_and_register_recompute(output)
        return output

    def _mlp(self, x: torch.Tensor, recompute: bool) -> torch.Tensor:
        if recompute and self.recompute_mlp:
            return checkpoint(self.mlp, False, x)
        return self.mlp(x)


__all__ = ["TransformerLayer", "default_layer_submodules", "get_gpt_layer_spec"]
