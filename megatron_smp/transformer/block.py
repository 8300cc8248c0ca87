"""A stack of decoder layers (one pipeline stage's share) and, on the last stage, the final norm.

Activation recompute (`config.recompute_granularity`):
  * "selective": only the core attention is recomputed (inside `SelfAttention`);
  * "full": whole layers are recomputed in backward; `recompute_method` "uniform" checkpoints
    chunks of `recompute_num_layers` layers, "block" checkpoints only the first
    `recompute_num_layers` layers of the stage (default: uniform, one layer per chunk).
Sequence-parallel scatter/gather happens outside, in the model.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.tensor_parallel.mappings import group_size
from megatron_smp.tensor_parallel.random import checkpoint
from megatron_smp.transformer.attention import RotaryEmbeddings
from megatron_smp.transformer.layer import get_gpt_layer_spec
from megatron_smp.transformer.spec import LayerSpec, build_module, spec_for_layer
from megatron_smp.transformer.norm import build_norm
from megatron_smp.transformer.utils import derive_seed, init_rng_scope


class TransformerBlock(torch.nn.Module):
    """Layers `layer_offset + 1 ... layer_offset + num_layers` (global 1-based numbers).

    forward(hidden_states [s(/tp), b, h], attention_mask=None, rotary_pos_emb=None)
    -> [s(/tp), b, h].

    `init_seed`: when given, layer n is built under the CPU seed `derive_seed(init_seed, n)`
    (see `init_rng_scope`), so its weights do not depend on the other layers built here.
    `layer_spec`: a `ModuleSpec` for every layer, or a function of the global layer number
    (default: the dense layer of `get_gpt_layer_spec`).
    """

    def __init__(
        self,
        config: TransformerConfig,
        state,
        layer_offset: int = 0,
        num_layers: Optional[int] = None,
        post_layer_norm: bool = True,
        init_seed: Optional[int] = None,
        device: Optional[torch.device] = None,
        layer_spec: Optional[LayerSpec] = None,
    ) -> None:
        super().__init__()
        self.config = config
        layer_spec = layer_spec or get_gpt_layer_spec()
        num_layers = config.num_layers - layer_offset if num_layers is None else num_layers
        if num_layers < 0 or layer_offset < 0 or layer_offset + num_layers > config.num_layers:
            raise ConfigError(
                f"layers {layer_offset + 1}..{layer_offset + num_layers} do not fit in a model "
                f"of --num-layers {config.num_layers}"
            )
        self.layer_offset = layer_offset
        layers = []
        for index in range(num_layers):
            layer_number = layer_offset + index + 1
            seed = None if init_seed is None else derive_seed(init_seed, layer_number)
            with init_rng_scope(seed):
                spec = spec_for_layer(layer_spec, layer_number)
                layers.append(build_module(spec, config, state, layer_number=layer_number,
                                           device=device))
        self.layers = torch.nn.ModuleList(layers)
        self.final_layernorm = None
        if post_layer_norm:
            sequence_parallel = config.sequence_parallel_at(group_size(state.tp_group))
            self.final_layernorm = build_norm(
                config, sequence_parallel=sequence_parallel, device=device
            )
        self.recompute_granularity = config.recompute_granularity
        self.recompute_method = config.recompute_method or "uniform"
        self.recompute_num_layers = config.recompute_num_layers or 1
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ConfigError(
                f"--recompute-granularity must be full or selective, got "
                f"{self.recompute_granularity!r}"
            )
        if self.recompute_method not in ("uniform", "block"):
            raise ConfigError(
                f"--recompute-method must be uniform or block, got {self.recompute_method!r}"
            )

    def _run_layers(self, start: int, end: int):
        def run(hidden_states, attention_mask, rotary_pos_emb):
            for layer in self.layers[start:end]:
                hidden_states = layer(hidden_states, attention_mask, rotary_pos_emb)
            return hidden_states

        return run

    def _forward_recompute(self, hidden_states, attention_mask, rotary_pos_emb):
        num_layers = len(self.layers)
        if self.recompute_method == "uniform":
            for start in range(0, num_layers, self.recompute_num_layers):
                end = min(start + self.recompute_num_layers, num_layers)
                hidden_states = checkpoint(
                    self._run_layers(start, end), False, hidden_states, attention_mask,
                    rotary_pos_emb,
                )
            return hidden_states
        for index in range(num_layers):  # "block"
            run = self._run_layers(index, index + 1)
            if index < self.recompute_num_layers:
                hidden_states = checkpoint(run, False, hidden_states, attention_mask,
                                           rotary_pos_emb)
            else:
                hidden_states = run(hidden_states, attention_mask, rotary_pos_emb)
        return hidden_states

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[RotaryEmbeddings] = None,
    ) -> torch.Tensor:
        if self.recompute_granularity == "full" and self.training and torch.is_grad_enabled():
            hidden_states = self._forward_recompute(hidden_states, attention_mask, rotary_pos_emb)
        else:
            for layer in self.layers:
                hidden_states = layer(hidden_states, attention_mask, rotary_pos_emb)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states


__all__ = ["TransformerBlock"]
