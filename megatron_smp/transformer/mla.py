"""Multi-latent attention (DeepSeek-V2/V3), a self-attention chosen through the layer spec
(`--multi-latent-attention`), with megatron-core's parameter names.

    q:  hidden -> linear_q_down_proj [q_lora_rank] -> q_layernorm -> linear_q_up_proj
        (or hidden -> linear_q_proj without --q-lora-rank); per head [qk_head_dim | pos]
    kv: hidden -> linear_kv_down_proj [kv_lora_rank | pos]; the latent -> kv_layernorm ->
        linear_kv_up_proj, per head [qk_head_dim (key) | v_head_dim (value)]; the pos part is
        the one positional key all heads share
    The latent norms exist with --qk-layernorm (Megatron's MLA spec), identities otherwise.
    RoPE rotates the pos channels of q and of the shared key (cos/sin of
    qk_pos_emb_head_dim channels from the model's RotaryEmbedding); the core attention sees
    q/k of qk_head_dim + pos channels and values of v_head_dim, scaled 1/sqrt(q/k width).

At inference (a `KVCacheContext` in place of the mask) a token's cache entry is its normed kv
latent and its rotated positional key, `kv_lora_rank + qk_pos_emb_head_dim` values per layer;
the key and value up-projections are absorbed (DeepSeek's decoding): each head's q_nope is
taken into the latent space through its key up-projection, the attention runs over the
cached latents as one shared key/value head, and its context leaves the latent space through
the head's value up-projection.

Tensor parallelism splits the heads (the up-projections and linear_proj, whole heads per rank
because their rows are laid out per head); the down-projections and latent norms are
replicated (Megatron's choice: they are small). With sequence parallelism they run on the
rank's sequence shard, so their grads are partial and summed over TP (`sequence_parallel`
mark); the up-projections gather the latents, the shared positional key is gathered alone.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_smp.config import TransformerConfig, recompute_modules
from megatron_smp.tensor_parallel import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    divide,
    hidden_init_method,
    output_init_method,
)
from megatron_smp.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    group_size,
)
from megatron_smp.tensor_parallel.random import (
    CheckpointWithoutOutput,
    checkpoint,
    get_rng_tracker,
)
from megatron_smp.transformer.attention import (
    RotaryEmbeddings,
    apply_rotary_pos_emb,
    core_attention,
)
from megatron_smp.transformer.kv_cache import KVCacheContext
from megatron_smp.transformer.norm import build_norm
from megatron_smp.transformer.rope import yarn_get_mscale
from megatron_smp.transformer.spec import SelfAttentionSubmodules, build_module


class MLASelfAttention(torch.nn.Module):
    """forward(hidden_states [s(/tp), b, h], attention_mask=None, rotary_pos_emb=None)
    -> [s(/tp), b, h]; rotary_pos_emb: cos/sin over qk_pos_emb_head_dim channels."""

    def __init__(
        self,
        config: TransformerConfig,
        state,
        layer_number: int = 1,
        submodules: Optional[SelfAttentionSubmodules] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        tp_group = state.tp_group
        self.tp_group = tp_group
        tp_size = group_size(tp_group)
        self.sequence_parallel = config.sequence_parallel_at(tp_size)
        self.num_heads = config.num_attention_heads
        self.num_heads_per_partition = divide(self.num_heads, tp_size)
        self.qk_head_dim = config.qk_head_dim
        self.pos_dim = config.qk_pos_emb_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_head_width = self.qk_head_dim + self.pos_dim
        # YaRN: scores scaled by mscale(factor, mscale_all_dim)^2 as well (Megatron's and HF's
        # DeepSeek attention); the rotary table carries the mscale / mscale_all_dim ratio.
        mscale = 1.0
        if config.rotary_type() == "yarn":
            mscale = yarn_get_mscale(config.yarn_rotary_scaling_factor,
                                     config.yarn_mscale_all_dim)
        self.softmax_scale = mscale * mscale / math.sqrt(self.q_head_width)
        self.attention_dropout = config.attention_dropout
        self.rotary_interleaved = config.rotary_interleaved
        self.selective_recompute = "core_attn" in recompute_modules(config)
        self.recompute_up_proj = "mla_up_proj" in recompute_modules(config)
        init_method = hidden_init_method(config)
        output_init = output_init_method(config)

        def column(input_size, output_size):
            return ColumnParallelLinear(input_size, output_size, config=config, tp_group=tp_group,
                                        init_method=init_method, bias=False,
                                        gather_output=False, device=device)

        q_width = self.num_heads * self.q_head_width
        if config.q_lora_rank is None:
            self.linear_q_proj = column(config.hidden_size, q_width)
        else:
            self.linear_q_down_proj = ReplicatedLinear(
                config.hidden_size, config.q_lora_rank, config, self.sequence_parallel, device)
            self.q_layernorm = self._latent_norm(config, config.q_lora_rank, device)
            self.linear_q_up_proj = column(config.q_lora_rank, q_width)
        self.linear_kv_down_proj = ReplicatedLinear(
            config.hidden_size, self.kv_lora_rank + self.pos_dim, config,
            self.sequence_parallel, device)
        self.kv_layernorm = self._latent_norm(config, self.kv_lora_rank, device)
        self.linear_kv_up_proj = column(self.kv_lora_rank,
                                        self.num_heads * (self.qk_head_dim + self.v_head_dim))
        # Under context parallelism the core attention is the spec's (`--cp-comm-type`), built
        # for heads of one width: values narrower than q/k are zero-padded to it and the
        # padding cut from the context (as megatron-core does for MLA under CP).
        self.core_attention = None
        if state.cp_size > 1:
            if submodules is None:
                raise ValueError("MLASelfAttention under context parallelism needs the layer "
                                 "spec's core attention (get_gpt_decoder_layer_spec)")
            self.core_width = max(self.q_head_width, self.v_head_dim)
            self.core_attention = build_module(
                submodules.core_attention, config.replace(kv_channels=self.core_width), state,
                layer_number=layer_number, device=device, softmax_scale=self.softmax_scale)
        self.linear_proj = RowParallelLinear(
            self.num_heads * self.v_head_dim, config.hidden_size, config=config,
            tp_group=tp_group, init_method=output_init,
            bias=config.add_attention_bias and config.add_bias_linear, input_is_parallel=True,
            device=device)

    def _latent_norm(self, config: TransformerConfig, width: int, device) -> torch.nn.Module:
        """A latent's norm with --qk-layernorm (megatron-core's MLA spec: q_layernorm /
        kv_layernorm are norms then, identities otherwise; DeepSeek's models have them).
        Replicated, on the rank's own tokens: a partial grad under SP (as a
        sequence-parallel layer norm's)."""
        if not config.qk_layernorm:
            return torch.nn.Identity()
        return build_norm(config, width, self.sequence_parallel, device)

    def _core_attention(self, query, key, value, attention_mask):
        """q/k [s, b, n, dq], v [s, b, n, dv] -> context [s, b, n * dv]."""
        s, b = query.shape[:2]
        if self.core_attention is not None:
            return self._context_parallel_attention(query, key, value, attention_mask)
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.attention_dropout if self.training else 0.0
        if dropout_p > 0.0:
            with get_rng_tracker().fork():
                context = core_attention(query, key, value, attention_mask, True, dropout_p,
                                         self.softmax_scale)
        else:
            context = core_attention(query, key, value, attention_mask, True, 0.0,
                                     self.softmax_scale)
        return context.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _context_parallel_attention(self, query, key, value, attention_mask):
        """The spec's context-parallel core over heads of one width (zero channels added to
        the narrower of q/k and v change neither the scores nor the kept context)."""
        s, b = query.shape[:2]
        width = self.core_width

        def padded(t):
            return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))

        context = self.core_attention(padded(query), padded(key), padded(value), attention_mask)
        context = context.view(s, b, self.num_heads_per_partition, width)
        return context[..., : self.v_head_dim].reshape(s, b, -1)

    def _up_projections(self, q_input, kv_latent, k_pos, rotary_pos_emb, fresh=False):
        """The heads from the latents: q_input (the normed q latent, or the hidden states
        without --q-lora-rank) [s, b, .], kv_latent (normed) [s, b, kv_lora_rank], k_pos the
        shared positional key [s, b, pos] -> query, key [s, b, n, qk + pos], value
        [s, b, n, v]; with `fresh` each a tensor of its own storage (what
        --recompute-modules mla_up_proj discards until backward)."""
        projection = self.linear_q_proj if hasattr(self, "linear_q_proj") \
            else self.linear_q_up_proj
        query, _ = projection(q_input)
        s, b = query.shape[:2]
        query = query.view(s, b, self.num_heads_per_partition, self.q_head_width)
        q_nope, q_pos = torch.split(query, [self.qk_head_dim, self.pos_dim], dim=-1)
        kv, _ = self.linear_kv_up_proj(kv_latent)
        kv = kv.view(s, b, self.num_heads_per_partition, self.qk_head_dim + self.v_head_dim)
        k_nope, value = torch.split(kv, [self.qk_head_dim, self.v_head_dim], dim=-1)
        k_pos = k_pos.unsqueeze(2)  # [s, b, 1, pos]
        if rotary_pos_emb is not None:
            q_pos = apply_rotary_pos_emb(q_pos, rotary_pos_emb, self.rotary_interleaved)
            k_pos = apply_rotary_pos_emb(k_pos, rotary_pos_emb, self.rotary_interleaved)
        query = torch.cat((q_nope, q_pos), dim=-1)
        key = torch.cat((k_nope, k_pos.expand(-1, -1, self.num_heads_per_partition, -1)), dim=-1)
        if fresh:  # the value is a view of the kv up-projection's output
            value = value.clone(memory_format=torch.contiguous_format)
        return query, key, value

    def _forward_cached(self, hidden_states: torch.Tensor, cache: KVCacheContext,
                        rotary_pos_emb: Optional[RotaryEmbeddings]) -> torch.Tensor:
        """Inference over the cache with absorbed up-projections (see the module docstring)."""
        if self.linear_kv_up_proj.lora is not None:
            raise ValueError("multi-latent attention at inference absorbs linear_kv_up_proj, "
                             "which has LoRA adapters: merge them into the weights first")
        if hasattr(self, "linear_q_proj"):
            query, _ = self.linear_q_proj(hidden_states)
        else:
            query, _ = self.linear_q_up_proj(
                self.q_layernorm(self.linear_q_down_proj(hidden_states)))
        latent, k_pos = torch.split(self.linear_kv_down_proj(hidden_states),
                                    [self.kv_lora_rank, self.pos_dim], dim=-1)
        latent = self.kv_layernorm(latent)
        if self.sequence_parallel:
            latent = gather_from_sequence_parallel_region(latent, self.tp_group, False)
            k_pos = gather_from_sequence_parallel_region(k_pos, self.tp_group, False)
        s, b = query.shape[:2]
        heads = self.num_heads_per_partition
        query = query.view(s, b, heads, self.q_head_width)
        q_nope, q_pos = torch.split(query, [self.qk_head_dim, self.pos_dim], dim=-1)
        if rotary_pos_emb is not None:
            q_pos = apply_rotary_pos_emb(q_pos, rotary_pos_emb, self.rotary_interleaved)
            k_pos = apply_rotary_pos_emb(k_pos.unsqueeze(2), rotary_pos_emb,
                                         self.rotary_interleaved).squeeze(2)
        up = self.linear_kv_up_proj.weight.view(heads, self.qk_head_dim + self.v_head_dim,
                                                 self.kv_lora_rank)
        key_up, value_up = torch.split(up, [self.qk_head_dim, self.v_head_dim], dim=1)
        q_latent = torch.einsum("sbhd,hdr->sbhr", q_nope, key_up.to(q_nope.dtype))
        query = torch.cat((q_latent, q_pos), dim=-1).reshape(s * b, heads, -1)
        entries = torch.cat((latent, k_pos), dim=-1).reshape(s * b, -1)
        context = cache.attend_latent(self.layer_number, query, entries, self.kv_lora_rank,
                                      self.softmax_scale)  # [s * b, heads, kv_lora_rank]
        context = torch.einsum("thr,hvr->thv", context, value_up.to(context.dtype))
        output, _ = self.linear_proj(context.reshape(s, b, heads * self.v_head_dim))
        return output

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[RotaryEmbeddings] = None,
    ) -> torch.Tensor:
        if isinstance(attention_mask, KVCacheContext):
            return self._forward_cached(hidden_states, attention_mask, rotary_pos_emb)
        if hasattr(self, "linear_q_proj"):
            q_input = hidden_states
        else:
            q_input = self.q_layernorm(self.linear_q_down_proj(hidden_states))
        latent, k_pos = torch.split(self.linear_kv_down_proj(hidden_states),
                                    [self.kv_lora_rank, self.pos_dim], dim=-1)
        kv_latent = self.kv_layernorm(latent)
        # The shared positional key feeds this rank's heads only: its grad is partial over TP
        # (summed by the gather's reduce-scatter under SP, by the copy's all-reduce otherwise).
        if self.sequence_parallel:
            k_pos = gather_from_sequence_parallel_region(k_pos, self.tp_group)
        else:
            k_pos = copy_to_tensor_model_parallel_region(k_pos, self.tp_group)

        up_projections = None
        if self.recompute_up_proj and self.training and torch.is_grad_enabled():
            # Megatron's mla_up_proj: q/k/v are freed once the core attention has them and
            # recomputed from the latents when backward reaches the attention.
            up_projections = CheckpointWithoutOutput()
            query, key, value = up_projections.checkpoint(
                self._up_projections, q_input, kv_latent, k_pos, rotary_pos_emb, True)
        else:
            query, key, value = self._up_projections(q_input, kv_latent, k_pos, rotary_pos_emb)
        if self.selective_recompute and self.training:
            context = checkpoint(self._core_attention, False, query, key, value, attention_mask)
        else:
            context = self._core_attention(query, key, value, attention_mask)
        if up_projections is not None:
            up_projections.discard_output_and_register_recompute(context)
        output, _ = self.linear_proj(context)
        return output


__all__ = ["MLASelfAttention"]
