"""Gated DeltaNet mixer (Qwen3-Next / Qwen3.5 linear attention; Megatron's GatedDeltaNet)
over [s, b, h] activations, tensor-parallel.

    in_proj -> per key head [q, k, v, z, b, a];  q k v -> causal depthwise conv1d -> SiLU;
    q, k l2-normalised;  beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias);
    o = gated delta rule(q, k, v, g, beta);  o = rmsnorm(o) * w * silu(z) per value head;  out_proj

Each key head serves `linear_num_value_heads / linear_num_key_heads` consecutive value heads.
Split tensors are laid out key head by key head (in_proj rows [q_i, k_i, v_i, z_i, b_i, a_i];
conv channels [q_i, k_i, v_i]; value heads in order), so TP ranks hold whole key-head groups
(key heads % tp == 0). The gated norm's weight [dv] is shared by all value heads: each rank's
grad of it is partial, summed over TP like a sequence-parallel norm's (hence the mark).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_smp.config import TransformerConfig
from megatron_smp.tensor_parallel import divide
from megatron_smp.tensor_parallel.mappings import group_size
from megatron_smp.transformer.ssm.layers import (
    RecurrentMixer,
    gated_rms_norm,
    init_decays,
    step_mask,
)
from megatron_smp.transformer.ssm.kernels import gated_delta_rule_scan
from megatron_smp.transformer.ssm.ops import gated_delta_rule_recurrent, l2norm


class GatedDeltaNet(RecurrentMixer):
    """forward(hidden_states [s(/tp), b, h], attention_mask=None, rotary_pos_emb=None)
    -> [s(/tp), b, h]; attention_mask None or a `PackedSequence` (the state restarts at each
    document); rotary_pos_emb ignored. Takes the place of `SelfAttention` in a layer spec.
    In generation attention_mask is a `KVCacheContext` (see `RecurrentMixer`)."""

    def __init__(self, config: TransformerConfig, state, layer_number: int = 1,
                 device: Optional[torch.device] = None, submodules=None) -> None:
        super().__init__()
        tp_group = state.tp_group
        self.tp_group = tp_group
        tp = group_size(tp_group)
        self.layer_number = layer_number
        self.dtype = config.params_dtype
        self.key_heads = config.linear_num_key_heads
        self.value_heads = config.linear_num_value_heads
        self.key_dim = config.linear_key_head_dim
        self.value_dim = config.linear_value_head_dim
        self.values_per_key = divide(self.value_heads, self.key_heads)
        self.local_key_heads = divide(self.key_heads, tp)
        self.local_value_heads = self.local_key_heads * self.values_per_key
        self.local_groups = self.local_key_heads  # in_proj's rows come per key head
        self._init_context_parallel(state, self.local_key_heads, "--linear-num-key-heads")
        self.state_shape = (self.local_value_heads, self.key_dim, self.value_dim)
        self.chunk_size = config.linear_chunk_size
        self.eps = config.layernorm_epsilon
        r = self.values_per_key
        conv_width = 2 * self.key_dim + r * self.value_dim
        self.split_sizes = [conv_width, r * self.value_dim, r, r]  # [q k v | z | b | a]
        self._build_parts(config, tp_group, self.key_heads * sum(self.split_sizes),
                          self.value_heads * self.value_dim, self.key_heads * conv_width,
                          config.linear_conv_kernel_dim, False, self.value_heads, device)
        dtype = config.params_dtype
        self.out_norm_weight = torch.nn.Parameter(torch.empty(self.value_dim, dtype=dtype,
                                                              device=device))
        self.out_norm_weight.sequence_parallel = tp > 1
        if self.A_log.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The decays (`init_decays`) for all heads, the norm ones."""
        init_decays(self.A_log, self.dt_bias, self.value_heads, self.tp_group)
        self.out_norm_weight.fill_(1.0)

    def _mix(self, projected, segments, lengths=None, conv_state=None, delta_state=None):
        """in_proj's rows [b, s, key heads/tp, per key head] -> (o [b, s, value heads/tp *
        dv] before out_proj, the new (conv state, delta state) with a cache's states)."""
        b, s, key_heads = projected.shape[:3]  # this rank's (of TP, and CP)
        value_heads = key_heads * self.values_per_key
        qkv, z, beta, a = torch.split(projected, self.split_sizes, dim=-1)
        qkv, conv_state = self._conv(qkv.reshape(b, s, -1), segments, lengths, conv_state)
        qkv = qkv.view(b, s, key_heads, -1)
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim,
                                    self.values_per_key * self.value_dim], dim=-1)
        v = v.reshape(b, s, value_heads, self.value_dim)
        q, k = l2norm(q.float()), l2norm(k.float())
        beta = torch.sigmoid(beta.reshape(b, s, value_heads).float())
        g = -torch.exp(self._local(self.A_log).float()) * F.softplus(
            a.reshape(b, s, value_heads).float() + self._local(self.dt_bias).float())
        if delta_state is None:
            o = gated_delta_rule_scan(q, k, v, g, beta, self.chunk_size, segments=segments)
        else:
            # g = 0, beta = 0 on padding: the state neither decays nor takes an update.
            real = step_mask(lengths, s)[..., None].to(g.dtype)
            g, beta = g * real, beta * real
            scan = gated_delta_rule_recurrent if s == 1 else gated_delta_rule_scan
            kwargs = {} if s == 1 else {"chunk_size": self.chunk_size}
            o, delta_state = scan(q, k, v, g, beta, initial_state=delta_state,
                                  return_final_state=True, **kwargs)
        o = gated_rms_norm(o, z.reshape(b, s, value_heads, self.value_dim),
                           self.out_norm_weight, self.eps, self.value_dim, norm_before_gate=True)
        return o.reshape(b, s, -1), (conv_state, delta_state)


__all__ = ["GatedDeltaNet"]
