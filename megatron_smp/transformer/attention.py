"""Self-attention: fused QKV projection, RoPE / ALiBi, SDPA core attention, output projection.

The fused QKV weight is laid out per query group, `[ng, (q_per_group + 2) * head_dim]` rows:
group g holds its q heads, then its one k head, then its one v head. A contiguous split of
the rows over TP ranks therefore gives each rank whole groups (and their queries), so no
communication is needed before the core attention. With multi-head attention
(q_per_group = 1) this is exactly GPT-NeoX's per-head [q, k, v] layout.

Core attention is `torch.nn.functional.scaled_dot_product_attention`, called so that a GPU
runs the flash or memory-efficient kernel, never the math one (`sdpa_plan`: grouped k/v are
repeated to the query heads where flash cannot take the call), and a fused CPU kernel
otherwise; it sees `[b, n, s, d]` views, never materialises the attention probabilities
itself, and uses `is_causal` when no explicit mask is given. One exception: causal attention
with dropout on the CPU, where no fused kernel exists and SDPA's math fallback does more work
than the product itself (`_causal_attention_with_dropout_cpu`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from megatron_smp.config import TransformerConfig, recompute_modules
from megatron_smp.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    divide,
    dropout,
    hidden_init_method,
    init_method_normal,
    output_init_method,
)
from megatron_smp.tensor_parallel.mappings import ProcessGroup, group_rank, group_size
from megatron_smp.tensor_parallel.random import checkpoint, get_rng_tracker
from megatron_smp.tensor_parallel.utils import set_tensor_model_parallel_attributes
from megatron_smp.transformer.kv_cache import KVCacheContext
from megatron_smp.transformer.norm import build_norm
from megatron_smp.transformer.packed import PackedSequence
from megatron_smp.transformer.rope import RopeScaling, rope_frequencies
from megatron_smp.transformer.spec import ModuleSpec, SelfAttentionSubmodules, build_module
from megatron_smp.transformer.utils import device_capability as _capability

RotaryEmbeddings = Tuple[torch.Tensor, torch.Tensor]


class L2Norm(torch.nn.Module):
    """Megatron-LM main's L2Norm (--qk-l2-norm, Llama 4): x / sqrt(mean(x^2) + eps) over the
    last dimension, in fp32, no weight."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_float = x.float()
        return (x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
                ).type_as(x)


@dataclass(frozen=True)
class LayerTypeRotaryEmbeddings:
    """The cos/sin tables of a model whose sliding-window layers rotate with their own base
    (Gemma 3, --local-rotary-base): each decoder layer takes the one of its kind
    (`for_layer`). Not a tuple, so no attention can mistake it for one (cos, sin) pair."""

    full: RotaryEmbeddings
    sliding: RotaryEmbeddings

    def for_layer(self, sliding_window: bool) -> RotaryEmbeddings:
        return self.sliding if sliding_window else self.full


# Rotary position embeddings ----------------------------------------------------------------------


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for RoPE over the first `rotary_percent` of each head's channels
    (Megatron's rotary dim: int(kv_channels * rotary_percent)).

    By default the rotated channels use the "rotate half" pairing (channel i with i + d/2),
    as in GPT-NeoX and Hugging Face's Llama, so their q/k weights load without a permutation;
    `interleaved` pairs channels 2i and 2i + 1 (Megatron's --rotary-interleaved).
    `scaling` (see `transformer.rope`): Llama 3.x's frequency scaling or YaRN, whose
    attention scaling multiplies the returned cos and sin.
    """

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float = 1.0,
        rotary_base: float = 10000.0,
        device: Optional[torch.device] = None,
        interleaved: bool = False,
        scaling: Optional[RopeScaling] = None,
    ) -> None:
        super().__init__()
        self.interleaved = interleaved
        dim = int(kv_channels * rotary_percent) if rotary_percent < 1.0 else kv_channels
        if dim < 2 or dim % 2 != 0:
            raise ValueError(
                f"rotary dim {dim} (kv_channels {kv_channels} x rotary_percent {rotary_percent})"
                " must be even and >= 2"
            )
        self.dim = dim
        self.scaling = scaling
        inv_freq, self.attention_scaling = rope_frequencies(dim, rotary_base, scaling)
        if device is not None and torch.device(device).type != "meta":
            inv_freq = inv_freq.to(device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, seq_length: int, position_ids: Optional[torch.Tensor] = None
    ) -> RotaryEmbeddings:
        """cos, sin of shape [s, 1, 1, dim] (default positions) or [s, b, 1, dim]
        (position_ids [b, s]); fp32."""
        inv_freq = self.inv_freq.float()
        if position_ids is None:
            positions = torch.arange(seq_length, device=inv_freq.device, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)[:, None, None, :]
        else:
            positions = position_ids.to(inv_freq.device).transpose(0, 1).float()  # [s, b]
            freqs = (positions[..., None] * inv_freq)[:, :, None, :]
        if self.interleaved:  # frequency i on channels 2i and 2i + 1
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_scaling != 1.0:  # YaRN's mscale, on cos and sin as HF applies it
            return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    if interleaved:  # pairs (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(x: torch.Tensor, rotary: RotaryEmbeddings,
                         interleaved: bool = False) -> torch.Tensor:
    """Rotate the first `dim` channels of x [s, b, n, d] by cos/sin [s, b or 1, 1, dim]
    (from a `RotaryEmbedding` built with the same `interleaved`)."""
    cos, sin = rotary
    dim = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if dim == x.shape[-1]:
        return x * cos + _rotate_half(x, interleaved) * sin
    x_rot, x_pass = x[..., :dim], x[..., dim:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot, interleaved) * sin, x_pass), dim=-1)


# ALiBi -------------------------------------------------------------------------------------------


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Per-head ALiBi slopes (Press et al.), geometric from 2^(-8/n); non-powers of two take
    the closest power's slopes then every other slope of the next power."""

    def power_of_two_slopes(n: int) -> list:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = power_of_two_slopes(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_two_slopes(closest)
        slopes += alibi_slopes(2 * closest).tolist()[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(
    slopes: torch.Tensor, seq_length: int, causal: bool, dtype: torch.dtype,
    query_positions: Optional[torch.Tensor] = None, key_positions: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Additive bias [1, n, s, s]: slope * (j - i), with -inf above the diagonal if causal.

    `query_positions` [sq] / `key_positions` [sk]: the global positions i, j of the rows and
    columns (context parallelism holds a subset), giving [1, n, sq, sk]; default arange(s).
    """
    if query_positions is None:
        query_positions = torch.arange(seq_length, device=slopes.device)
    if key_positions is None:
        key_positions = query_positions
    distance = (key_positions[None, :] - query_positions[:, None]).to(slopes.device).float()
    bias = slopes.float()[:, None, None] * distance[None]
    if causal:
        bias = bias.masked_fill(distance[None] > 0, float("-inf"))
    return bias.unsqueeze(0).to(dtype)


def sliding_window_mask(
    seq_length: int, window_size: Tuple[int, int], device: Optional[torch.device] = None,
    query_positions: Optional[torch.Tensor] = None, key_positions: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Bool [1, 1, s, s], True = masked: the future, and keys more than `left` behind.
    Global `query_positions` [sq] / `key_positions` [sk] give [1, 1, sq, sk] (as `alibi_bias`)."""
    left, right = window_size
    if query_positions is None:
        query_positions = torch.arange(seq_length, device=device)
    if key_positions is None:
        key_positions = query_positions
    behind = query_positions[:, None] - key_positions[None, :]  # i - j
    masked = behind < -right
    if left >= 0:
        masked = masked | (behind > left)
    return masked[None, None]


# Core attention ----------------------------------------------------------------------------------


class SdpaPlan(NamedTuple):
    """How core_attention calls SDPA: `expand_kv` repeats k/v to the query heads (instead of
    `enable_gqa`); `kernel` is the backend torch's rules pick for the call on CUDA."""

    expand_kv: bool
    kernel: str  # "flash", "efficient", or "math" (off CUDA: "device default")


def sdpa_plan(device_type: str, dtype: torch.dtype, head_dim: int, grouped: bool,
              masked: bool, capability: Tuple[int, int] = (9, 0)) -> SdpaPlan:
    """Choose the SDPA call for one attention, from torch's CUDA selection rules (flash first,
    then memory-efficient, then math; cuDNN only on request):

    * flash: no attn_mask, fp16/bf16, head_dim <= 256 and a multiple of 8, sm80+; takes
      grouped-query attention (`enable_gqa`) natively.
    * memory-efficient: takes masks (bool or additive) and fp32, but not `enable_gqa`.
    * math: everything else -- it materialises [b, heads, s, s] scores in fp32.

    So grouped-query attention keeps `enable_gqa` only where flash takes the call; with a
    mask (sliding window, ALiBi, --reset-attention-mask), in fp32 or where flash cannot run,
    k/v are repeated to the query heads ([b, nq, s, d], far smaller than the scores) so the
    memory-efficient kernel takes it instead of math. Off CUDA the call is left as it is
    (`enable_gqa`; the CPU kernels take masks and groups alike).
    """
    if device_type != "cuda":
        return SdpaPlan(False, "device default")
    flash = (not masked and dtype in (torch.float16, torch.bfloat16) and head_dim <= 256
             and head_dim % 8 == 0 and capability >= (8, 0))
    if flash:
        return SdpaPlan(False, "flash")
    return SdpaPlan(grouped, "efficient")


def _repeat_kv(key: torch.Tensor, value: torch.Tensor, num_heads: int):
    """k/v [b, nkv, s, d] -> [b, num_heads, s, d]: query head h reads group h // (nq / nkv)."""
    groups = num_heads // key.shape[1]
    if groups == 1:
        return key, value
    return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)


def build_softmax_offset(config: TransformerConfig, tp_group: ProcessGroup,
                         num_local_heads: int,
                         device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
    """The per-head logit every softmax denominator also holds (Megatron's `softmax_offset`,
    --softmax-type): a Parameter [nh_local] of this rank's heads for "learnable" (gpt-oss's
    attention sinks; the full [nh] drawn on the CPU, N(0, init_method_std), then this rank's
    contiguous heads, so it does not depend on TP), zeros for "off-by-one", None for "vanilla".
    """
    if config.softmax_type == "vanilla":
        return None
    start = group_rank(tp_group) * num_local_heads
    if config.softmax_type == "off-by-one":
        zeros = torch.zeros(num_local_heads, dtype=config.params_dtype)
        return zeros if device is None or torch.device(device).type == "meta" else zeros.to(device)
    master = torch.empty(config.num_attention_heads)
    init_method_normal(config.init_method_std)(master)
    offset = torch.nn.Parameter(
        torch.empty(num_local_heads, dtype=config.params_dtype, device=device))
    if offset.device.type != "meta":
        with torch.no_grad():
            offset.copy_(master[start : start + num_local_heads])
    set_tensor_model_parallel_attributes(offset, True, 0, 1)
    return offset


def register_softmax_offset(module: torch.nn.Module, offset: Optional[torch.Tensor]) -> None:
    """`module.softmax_offset`: a parameter (learnable), a non-persistent buffer (the fixed
    zeros of off-by-one), or None."""
    if isinstance(offset, torch.nn.Parameter) or offset is None:
        module.softmax_offset = offset
    else:
        module.register_buffer("softmax_offset", offset, persistent=False)


def _attention_with_sinks(query, key, value, sinks, mask, dropout_p, scale):
    """softmax over [scores, sink] per row, the sink column dropped: q [b, nq, sq, d],
    k/v [b, nkv, sk, d], sinks [nq], mask additive float [.., sq, sk] or None."""
    key, value = _repeat_kv(key, value, query.shape[1])
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    if dropout_p > 0.0:
        probs = dropout(probs, dropout_p)
    return torch.matmul(probs.to(value.dtype), value)


def _causal_attention_with_dropout_cpu(query, key, value, dropout_p, scale):
    """Causal attention with dropout on the CPU, q/k [b, nq or nkv, s, d], v [b, nkv, s, dv].

    SDPA has no fused CPU kernel with dropout and falls back to its math path, which also
    builds the causal mask, scales q and k separately, and guards its softmax against fully
    masked rows with full-size checks (no causal row is fully masked). This is the same
    arithmetic in two batched products and a softmax, with `dropout`'s CPU mask.
    """
    b, n, s, d = query.shape
    if key.shape[1] != n:
        key, value = _repeat_kv(key, value, n)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    future = torch.full((s, s), float("-inf"), dtype=query.dtype, device=query.device).triu_(1)
    scores = torch.baddbmm(future.expand(b * n, s, s), query.reshape(b * n, s, d),
                           key.reshape(b * n, s, d).transpose(1, 2), alpha=scale)
    probs = dropout(torch.softmax(scores, dim=-1), dropout_p)
    dv = value.shape[-1]  # MLA: other than d
    return torch.bmm(probs, value.reshape(b * n, s, dv)).view(b, n, s, dv)


def core_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    causal: bool = True,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    bias: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """SDPA over q [b, nq, s, d], k/v [b, nkv, s, d] (nkv divides nq: grouped-query).

    `attention_mask` is bool, True = masked, broadcastable to [b, nq, s, s], or a
    `PackedSequence` (documents packed in each row: attention that does no work across them,
    see `transformer.packed`; with a bias or sinks its dense mask); `bias` an additive float
    bias (ALiBi). Without either, `causal` uses the kernel's own causal path.
    The SDPA call follows `sdpa_plan`. `sinks` [nq]: one more logit per head in every softmax
    denominator (no value); SDPA has no such input, so these are computed with explicit
    scores (like HF's eager gpt-oss). Returns [b, nq, s, d].
    """
    if isinstance(attention_mask, PackedSequence):
        if sinks is None and bias is None:
            return attention_mask.attend(query, key, value, dropout_p, scale)
        attention_mask = attention_mask.dense_mask()
    if sinks is not None:
        mask = bias
        if attention_mask is None and causal:
            s_q, s_k = query.shape[-2], key.shape[-2]
            attention_mask = torch.ones(s_q, s_k, dtype=torch.bool,
                                        device=query.device).triu(1)
        if attention_mask is not None:
            base = mask if mask is not None else torch.zeros(
                attention_mask.shape, dtype=query.dtype, device=query.device)
            mask = base.masked_fill(attention_mask, float("-inf"))
        return _attention_with_sinks(query, key, value, sinks, mask, dropout_p, scale)
    gqa = query.shape[1] != key.shape[1]
    masked = attention_mask is not None or bias is not None
    if (dropout_p > 0.0 and causal and not masked and query.device.type == "cpu"
            and query.dtype == torch.float32 and query.shape[-2] == key.shape[-2]):
        return _causal_attention_with_dropout_cpu(query, key, value, dropout_p, scale)
    plan = sdpa_plan(query.device.type, query.dtype, query.shape[-1], gqa, masked,
                     _capability(query.device))
    if gqa and plan.expand_kv:
        key, value = _repeat_kv(key, value, query.shape[1])
        gqa = False
    if not masked:
        return F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout_p, is_causal=causal, scale=scale,
            enable_gqa=gqa,
        )
    if bias is None:
        mask = ~attention_mask  # SDPA's bool masks mean True = attend
    elif attention_mask is None:
        mask = bias
    else:
        mask = bias.masked_fill(attention_mask, float("-inf"))
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=False, scale=scale,
        enable_gqa=gqa,
    )


class DotProductAttention(torch.nn.Module):
    """Core attention of this rank's heads: softmax(q k^T / sqrt(d) + mask) v, through SDPA,
    with sliding window (this layer's, `layer_window_size`), ALiBi, attention sinks
    (`softmax_offset`, --softmax-type) and attention dropout.

    forward(query [s, b, nh_local, d], key/value [s, b, ng_local, d], attention_mask=None)
    -> context [s, b, nh_local * d]. attention_mask: bool [b, 1, s, s], True = masked, a
    `PackedSequence`, None = causal, or at inference a `KVCacheContext` (the keys/values
    are cached and the queries attend over their request's cache).
    """

    def __init__(
        self,
        config: TransformerConfig,
        state,
        layer_number: int = 1,
        device: Optional[torch.device] = None,
        softmax_scale: Optional[float] = None,
    ) -> None:
        super().__init__()
        tp_group = state.tp_group
        self.layer_number = layer_number
        self.num_heads_per_partition = divide(config.num_attention_heads, group_size(tp_group))
        self.head_dim = config.kv_channels
        # None: 1/sqrt(head_dim), or the config's (--softmax-scale, Gemma's query_pre_attn_scalar).
        self.softmax_scale = (config.attention_softmax_scale() if softmax_scale is None
                              else softmax_scale)
        self.attention_dropout = config.attention_dropout
        # This layer's window (--window-attn-skip-freq); (-1, 0) is plain causal attention:
        # keep SDPA's causal kernel for it.
        window = config.layer_window_size(layer_number)
        self.window_size = window if (window or (-1,))[0] >= 0 else None
        register_softmax_offset(self, build_softmax_offset(
            config, tp_group, self.num_heads_per_partition, device))
        self.use_alibi = config.position_embedding_type == "alibi"
        if self.use_alibi:
            # Slopes of the full head set, then this rank's heads (contiguous, like the qkv split).
            start = group_rank(tp_group) * self.num_heads_per_partition
            slopes = alibi_slopes(config.num_attention_heads)
            slopes = slopes[start : start + self.num_heads_per_partition]
            if device is not None and torch.device(device).type != "meta":
                slopes = slopes.to(device)
            self.register_buffer("alibi_slopes", slopes, persistent=False)

    def forward(self, query, key, value, attention_mask=None, softmax_offset=None):
        """`softmax_offset` [nh_local]: the sinks of these heads when an outer module owns
        them (Ulysses' head share); default this module's own (--softmax-type)."""
        if softmax_offset is None:
            softmax_offset = self.softmax_offset
        s, b = query.shape[:2]
        if isinstance(attention_mask, KVCacheContext):
            context = attention_mask.attend(
                self.layer_number, query, key, value, self.softmax_scale, self.window_size,
                softmax_offset, self.alibi_slopes if self.use_alibi else None)
            return context.reshape(s, b, self.num_heads_per_partition * self.head_dim)
        # [s, b, n, d] -> [b, n, s, d] views: SDPA takes strided inputs.
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.window_size is not None:
            # An explicit mask: SDPA's flash kernel has no window, its memory-efficient one
            # takes the mask (a packed sequence's dense document mask with it).
            if isinstance(attention_mask, PackedSequence):
                attention_mask = attention_mask.dense_mask()
            window = sliding_window_mask(s, self.window_size, query.device)
            attention_mask = window if attention_mask is None else attention_mask | window
        bias = None
        if self.use_alibi:
            bias = alibi_bias(self.alibi_slopes, s, attention_mask is None, query.dtype)
        dropout_p = self.attention_dropout if self.training else 0.0
        if dropout_p > 0.0:
            # Heads are split over TP ranks: each rank drops its own heads' probabilities.
            with get_rng_tracker().fork():
                context = core_attention(query, key, value, attention_mask, True, dropout_p,
                                         self.softmax_scale, bias, softmax_offset)
        else:
            context = core_attention(query, key, value, attention_mask, True, 0.0,
                                     self.softmax_scale, bias, softmax_offset)
        # [b, n, s, d] -> [s, b, n * d]
        width = self.num_heads_per_partition * self.head_dim
        return context.permute(2, 0, 1, 3).reshape(s, b, width)


class SelfAttention(torch.nn.Module):
    """Tensor-parallel self-attention over [s, b, h] (or [s/tp, b, h] with SP).

    forward(hidden_states, attention_mask=None, rotary_pos_emb=None) -> [s(/tp), b, h]
      * attention_mask: bool [b, 1, s, s], True = masked; None = causal.
      * rotary_pos_emb: (cos, sin) from `RotaryEmbedding`, for RoPE models.
    `submodules.core_attention` builds the core attention (default `DotProductAttention`).
    With `config.qk_layernorm`, `q_layernorm` / `k_layernorm` normalise each head's query and
    key over the head dim before RoPE (megatron-core's names and order).
    """

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
        self.head_dim = config.kv_channels
        self.num_heads = config.num_attention_heads
        self.num_query_groups = config.num_query_groups
        self.q_per_group = divide(self.num_heads, self.num_query_groups)
        self.num_heads_per_partition = divide(self.num_heads, tp_size)
        self.num_groups_per_partition = divide(self.num_query_groups, tp_size)
        self.selective_recompute = "core_attn" in recompute_modules(config)
        self.rotary_interleaved = config.rotary_interleaved
        self.q_layernorm = self.k_layernorm = None
        if config.qk_l2_norm:  # Megatron-LM main: L2Norm replaces the q/k norms
            if config.multi_latent_attention:
                raise ValueError("qk_l2_norm is not supported with MLA.")
            self.q_layernorm = L2Norm(config.layernorm_epsilon)
            self.k_layernorm = L2Norm(config.layernorm_epsilon)
        elif config.qk_layernorm:
            # One weight shared by all heads, and each TP rank holds other heads: its grad is
            # partial and is summed over TP like a sequence-parallel norm's (hence the mark).
            partial = tp_size > 1
            self.q_layernorm = build_norm(config, self.head_dim, partial, device)
            self.k_layernorm = build_norm(config, self.head_dim, partial, device)
        # --test-mode: the groups whose replicas of the q/k norms are compared each forward.
        self._test_groups = ((("DP", state.dp_group), ("TP", tp_group))
                             if config.test_mode and config.qk_layernorm else ())

        # --attention-output-gate: each group's rows also hold a gate per query channel,
        # [q heads, gates, k, v], so the TP split by groups keeps a head's gate with it.
        self.output_gate = config.attention_output_gate
        gated_heads = self.num_heads if self.output_gate else 0
        qkv_size = (self.num_heads + gated_heads + 2 * self.num_query_groups) * self.head_dim
        init_method = hidden_init_method(config)
        output_init = output_init_method(config)
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size,
            qkv_size,
            config=config,
            tp_group=tp_group,
            init_method=init_method,
            bias=config.add_attention_bias and (config.add_bias_linear or config.add_qkv_bias),
            gather_output=False,
            device=device,
        )
        # Rows of q, k and v per query group: Muon orthogonalises each part on its own.
        self.linear_qkv.weight.qkv_split_shapes = (
            self.q_per_group * self.head_dim, self.head_dim, self.head_dim)
        submodules = submodules or SelfAttentionSubmodules(
            core_attention=ModuleSpec(DotProductAttention))
        self.core_attention = build_module(
            submodules.core_attention, config, state, layer_number=layer_number, device=device
        )
        self.linear_proj = RowParallelLinear(
            self.num_heads * self.head_dim,
            config.hidden_size,
            config=config,
            tp_group=tp_group,
            init_method=output_init,
            bias=config.add_attention_bias and config.add_bias_linear,
            input_is_parallel=True,
            device=device,
        )

    def run_realtime_tests(self) -> None:
        """Megatron's --test-mode check: this rank's q/k norm parameters equal those of every
        data-parallel and tensor-parallel replica (they are replicated; a difference is a
        silent corruption of memory or of a transfer). One all-gather per group; every
        member raises RuntimeError naming the parameter, the parallelism and the ranks."""
        import torch.distributed as dist

        named = [(f"{which}_{kind}", getattr(norm, attribute))
                 for which, norm in (("q", self.q_layernorm), ("k", self.k_layernorm))
                 for kind, attribute in (("w", "weight"), ("b", "bias"))
                 if getattr(norm, attribute, None) is not None]
        local = torch.stack([param.detach() for _, param in named])
        for parallelism, group in self._test_groups:
            size = group_size(group)
            if size == 1:
                continue
            gathered = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(gathered, local, group=group)
            rank = group_rank(group)
            for other, values in enumerate(gathered):
                for (name, _), theirs, ours in zip(named, values, local):
                    if not torch.equal(theirs, ours):
                        raise RuntimeError(
                            f"--test-mode: discrepancy between {name} in {parallelism} ranks "
                            f"{other} and {rank} (layer {self.layer_number}). Diff: "
                            f"{torch.norm(theirs - ours).item()}")

    def _split_qkv(self, mixed: torch.Tensor):
        """[s, b, ng_local * (qpg + 2) * d] -> q [s, b, nh_local, d], k, v [s, b, ng_local, d],
        gate [s, b, nh_local * d] (--attention-output-gate: qpg more rows per group) or None."""
        s, b = mixed.shape[:2]
        gates = self.q_per_group if self.output_gate else 0
        mixed = mixed.view(s, b, self.num_groups_per_partition, self.q_per_group + gates + 2,
                           self.head_dim)
        query, gate, key, value = torch.split(mixed, [self.q_per_group, gates, 1, 1], dim=3)
        query = query.reshape(s, b, self.num_heads_per_partition, self.head_dim)
        gate = gate.reshape(s, b, -1) if self.output_gate else None
        return query, key.squeeze(3), value.squeeze(3), gate

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[RotaryEmbeddings] = None,
    ) -> torch.Tensor:
        mixed, _ = self.linear_qkv(hidden_states)
        query, key, value, gate = self._split_qkv(mixed)
        if self.q_layernorm is not None:
            query, key = self.q_layernorm(query), self.k_layernorm(key)
        if self._test_groups:
            self.run_realtime_tests()
        if rotary_pos_emb is not None:
            query = apply_rotary_pos_emb(query, rotary_pos_emb, self.rotary_interleaved)
            key = apply_rotary_pos_emb(key, rotary_pos_emb, self.rotary_interleaved)
        if self.selective_recompute and self.training:
            context = checkpoint(self.core_attention, False, query, key, value, attention_mask)
        else:
            context = self.core_attention(query, key, value, attention_mask)
        if gate is not None:
            context = context * torch.sigmoid(gate)
        output, _ = self.linear_proj(context)
        return output


# SMP v2 attention modules ------------------------------------------------------------------------

_LAYOUTS = ("b h s d", "b s h d")


def _check_layout(layout: str) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")


def _to_bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x if layout == "b h s d" else x.transpose(1, 2)


class FlashSelfAttention(torch.nn.Module):
    """SMP v2's `torch.sagemaker.nn.attn.FlashSelfAttention`, on SDPA.

    forward(qkv, attn_mask=None, causal=False, cast_dtype=None, layout="b h s d")
      * qkv: one tensor [b, s, 3 * n, d] ("b s h d") or [b, 3 * n, s, d] ("b h s d"), or a
        tuple (q, k, v) of [b, s, n, d] / [b, n, s, d] tensors.
      * attn_mask: with `use_alibi`, the additive ALiBi mask [b or 1, n, 1 or s, s] (e.g. from
        SMP's `generate_alibi_attn_mask`), added to the scores.
    Returns [b, n, s, d] (the reference's documented shape, whatever the input layout).
    """

    def __init__(
        self,
        attention_dropout_prob: float = 0.0,
        scale: Optional[float] = None,
        triton_flash_attention: bool = False,
        use_alibi: bool = False,
    ) -> None:
        super().__init__()
        self.attention_dropout_prob = attention_dropout_prob
        self.scale = scale
        # Kept for API compatibility: SDPA picks its own kernel, with or without ALiBi.
        self.triton_flash_attention = triton_flash_attention
        self.use_alibi = use_alibi

    def forward(
        self,
        qkv: Union[torch.Tensor, Sequence[torch.Tensor]],
        attn_mask: Optional[torch.Tensor] = None,
        causal: bool = False,
        cast_dtype: Optional[torch.dtype] = None,
        layout: str = "b h s d",
    ) -> torch.Tensor:
        _check_layout(layout)
        if torch.is_tensor(qkv):
            heads_dim = 2 if layout == "b s h d" else 1
            q, k, v = qkv.chunk(3, dim=heads_dim)
        else:
            q, k, v = qkv
        if attn_mask is not None and not self.use_alibi:
            raise ValueError("FlashSelfAttention: attn_mask needs use_alibi=True (as in SMP v2)")
        return _flash_forward(
            q, k, v, attn_mask, causal, cast_dtype, layout, self.attention_dropout_prob,
            self.scale, self.training,
        )


class FlashGroupedQueryAttention(torch.nn.Module):
    """SMP v2's `torch.sagemaker.nn.attn.FlashGroupedQueryAttention`, on SDPA.

    forward(q, kv, causal=False, cast_dtype=None, layout="b s h d")
      * q: [b, s, nq, d] ("b s h d") or [b, nq, s, d] ("b h s d").
      * kv: one tensor [b, s, 2 * nkv, d] / [b, 2 * nkv, s, d], or a tuple (k, v).
    Returns [b, nq, s, d].
    """

    def __init__(self, attention_dropout_prob: float = 0.0, scale: Optional[float] = None) -> None:
        super().__init__()
        self.attention_dropout_prob = attention_dropout_prob
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,
        kv: Union[torch.Tensor, Sequence[torch.Tensor]],
        causal: bool = False,
        cast_dtype: Optional[torch.dtype] = None,
        layout: str = "b s h d",
    ) -> torch.Tensor:
        _check_layout(layout)
        if torch.is_tensor(kv):
            k, v = kv.chunk(2, dim=2 if layout == "b s h d" else 1)
        else:
            k, v = kv
        return _flash_forward(
            q, k, v, None, causal, cast_dtype, layout, self.attention_dropout_prob, self.scale,
            self.training,
        )


def _flash_forward(q, k, v, bias, causal, cast_dtype, layout, dropout_p, scale, training):
    if cast_dtype is not None:
        q, k, v = q.to(cast_dtype), k.to(cast_dtype), v.to(cast_dtype)
    q, k, v = (_to_bhsd(t, layout) for t in (q, k, v))
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
        )
    if bias is not None:
        s_q, s_k = q.shape[2], k.shape[2]
        bias = bias.to(q.dtype)[..., -s_k:]
        if causal:
            future = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1)
            bias = bias.masked_fill(future, float("-inf"))
        causal = False
    return core_attention(
        q, k, v, None, causal, dropout_p if training else 0.0, scale, bias,
    )


__all__ = [
    "LayerTypeRotaryEmbeddings",
    "RotaryEmbedding",
    "apply_rotary_pos_emb",
    "alibi_slopes",
    "alibi_bias",
    "sliding_window_mask",
    "SdpaPlan",
    "sdpa_plan",
    "core_attention",
    "build_softmax_offset",
    "register_softmax_offset",
    "DotProductAttention",
    "SelfAttention",
    "FlashSelfAttention",
    "FlashGroupedQueryAttention",
]
