"""Mamba-2 mixer (Megatron's MambaMixer) over [s, b, h] activations, tensor-parallel.

    in_proj -> [z | x B C | dt] per group;  x B C -> causal depthwise conv1d -> SiLU;
    dt = clamp(softplus(dt + dt_bias), mamba_dt_min);
    y = SSD scan(x, dt, A = -exp(A_log), B, C) + D x;
    y = rmsnorm_per_group(y * silu(z)) * w;  out_proj

Heads come in `mamba_num_groups` groups sharing B and C. Every split tensor is laid out group
by group (in_proj rows [z_g, x_g, B_g, C_g, dt_g] for each group g; conv channels [x_g, B_g,
C_g]; heads in order), so TP ranks hold whole groups (groups % tp == 0, as in Megatron) and
the scan runs on each rank's heads alone. The HF adapter reorders Hugging Face's
[z | x | B | C | dt] rows into this layout.
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
    split_parameter,
    step_mask,
)
from megatron_smp.transformer.ssm.kernels import ssd_scan
from megatron_smp.transformer.ssm.ops import ssd_recurrent


class MambaMixer(RecurrentMixer):
    """forward(hidden_states [s(/tp), b, h], attention_mask=None, rotary_pos_emb=None)
    -> [s(/tp), b, h]. attention_mask: None (causal rows) or a `PackedSequence` (the state
    restarts at each document); rotary_pos_emb is ignored (no positions in a recurrence).
    In generation attention_mask is a `KVCacheContext` (see `RecurrentMixer`)."""

    def __init__(self, config: TransformerConfig, state, layer_number: int = 1,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        tp_group = state.tp_group
        self.tp_group = tp_group
        tp = group_size(tp_group)
        self.layer_number = layer_number
        self.dtype = config.params_dtype
        self.heads = config.mamba_heads()
        self.groups = config.mamba_num_groups
        self.head_dim = config.mamba_head_dim
        self.state_dim = config.mamba_state_dim
        self.heads_per_group = divide(self.heads, self.groups)
        self.local_groups = divide(self.groups, tp)
        self.local_heads = self.local_groups * self.heads_per_group
        self._init_context_parallel(state, self.local_groups, "--mamba-num-groups")
        self.chunk_size = config.mamba_chunk_size
        self.dt_min = config.mamba_dt_min
        self.eps = config.layernorm_epsilon
        self.state_shape = (self.local_heads, self.head_dim, self.state_dim)
        inner = self.heads * self.head_dim
        group_width = self.heads_per_group * self.head_dim
        # Per group: z, x (group_width each), B, C (state_dim each), dt (heads_per_group).
        self.split_sizes = [group_width, group_width + 2 * self.state_dim, self.heads_per_group]
        self._build_parts(config, tp_group, self.groups * sum(self.split_sizes), inner,
                          self.groups * self.split_sizes[1], config.mamba_conv_kernel_dim, True,
                          self.heads, device)
        dtype = config.params_dtype
        self.D = split_parameter((self.heads,), tp_group, dtype, device)
        self.norm_weight = split_parameter((inner,), tp_group, dtype, device)
        if self.A_log.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The decays (`init_decays`) for all heads, D and the norm ones."""
        init_decays(self.A_log, self.dt_bias, self.heads, self.tp_group)
        self.D.fill_(1.0)
        self.norm_weight.fill_(1.0)

    def _mix(self, projected, segments, lengths=None, conv_state=None, ssm_state=None):
        """in_proj's rows [b, s, groups/tp, per group] -> (y [b, s, inner/tp] before
        out_proj, the new (conv state, SSM state) when called with a cache's states)."""
        b, s, groups = projected.shape[:3]  # groups: this rank's (of TP, and CP)
        heads = groups * self.heads_per_group
        z, xbc, dt = torch.split(projected, self.split_sizes, dim=-1)
        xbc, conv_state = self._conv(xbc.reshape(b, s, -1), segments, lengths, conv_state)
        xbc = xbc.view(b, s, groups, -1)
        width = self.heads_per_group * self.head_dim
        x, B, C = torch.split(xbc, [width, self.state_dim, self.state_dim], dim=-1)
        x = x.reshape(b, s, heads, self.head_dim)
        dt = F.softplus(dt.reshape(b, s, heads).float() + self._local(self.dt_bias).float())
        dt = dt.clamp(min=self.dt_min)
        A = -torch.exp(self._local(self.A_log).float())
        if ssm_state is None:  # [b, s, local heads, head_dim]
            y = ssd_scan(x, dt, A, B, C, self.chunk_size, self._local(self.D),
                         segments=segments)
        else:
            dt = dt * step_mask(lengths, s)[..., None]  # dt = 0: padding leaves the state
            if s == 1:  # a decode step: the recurrence, one token
                y, ssm_state = ssd_recurrent(x, dt, A, B, C, self.D, initial_state=ssm_state,
                                             return_final_state=True)
            else:  # a prompt: the chunked scan from the (zero) state, its final state kept
                y, ssm_state = ssd_scan(x, dt, A, B, C, self.chunk_size, self.D,
                                        initial_state=ssm_state, return_final_state=True)
        y = gated_rms_norm(y.reshape(b, s, -1), z.reshape(b, s, -1),
                           self._local(self.norm_weight), self.eps, width, norm_before_gate=False)
        return y, (conv_state, ssm_state)


__all__ = ["MambaMixer"]
