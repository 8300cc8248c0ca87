"""One pre-norm decoder layer over [s, b, h] activations.

    sequential (GPT, Llama):  x = x + drop(attn(ln1(x)));  x = x + drop(mlp(ln2(x)))
    parallel residual (NeoX): x = x + drop(attn(ln1(x))) + drop(mlp(ln2(x)))
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_smp.config import TransformerConfig
from megatron_smp.tensor_parallel.mappings import ProcessGroup, group_size
from megatron_smp.tensor_parallel.random import get_rng_tracker
from megatron_smp.transformer.attention import RotaryEmbeddings, SelfAttention
from megatron_smp.transformer.mlp import MLP
from megatron_smp.transformer.norm import build_norm


class TransformerLayer(torch.nn.Module):
    """forward(hidden_states [s(/tp), b, h], attention_mask=None, rotary_pos_emb=None)
    -> [s(/tp), b, h]. `layer_number` is global (1-based), whatever the pipeline stage."""

    def __init__(
        self,
        config: TransformerConfig,
        tp_group: ProcessGroup,
        layer_number: int = 1,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.parallel_residual = config.parallel_residual
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = config.sequence_parallel and group_size(tp_group) > 1
        self.input_layernorm = build_norm(
            config, sequence_parallel=self.sequence_parallel, device=device
        )
        self.self_attention = SelfAttention(config, tp_group, layer_number, device=device)
        self.pre_mlp_layernorm = build_norm(
            config, sequence_parallel=self.sequence_parallel, device=device
        )
        self.mlp = MLP(config, tp_group, device=device)

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
            return F.dropout(x, p=self.hidden_dropout, training=True)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[RotaryEmbeddings] = None,
    ) -> torch.Tensor:
        attention_output = self.self_attention(
            self.input_layernorm(hidden_states), attention_mask, rotary_pos_emb
        )
        if self.parallel_residual:
            mlp_output = self.mlp(self.pre_mlp_layernorm(hidden_states))
            return hidden_states + self._dropout(attention_output) + self._dropout(mlp_output)
        hidden_states = hidden_states + self._dropout(attention_output)
        return hidden_states + self._dropout(self.mlp(self.pre_mlp_layernorm(hidden_states)))


__all__ = ["TransformerLayer"]
