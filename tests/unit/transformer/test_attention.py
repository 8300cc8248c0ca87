"""Attention pieces against naive references: SMP's Flash* modules, RoPE, ALiBi, norms."""
import math

import pytest
import torch

from megatron_smp.transformer import (
    FlashGroupedQueryAttention,
    FlashSelfAttention,
    LayerNorm,
    RMSNorm,
    RotaryEmbedding,
    alibi_slopes,
    apply_rotary_pos_emb,
)

B, S, H, D = 2, 7, 4, 8


def naive_attention(q, k, v, causal, scale=None, bias=None):
    """q [b, nq, s, d], k/v [b, nkv, s, d] -> [b, nq, s, d] with an explicit softmax."""
    repeat = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(repeat, dim=1)
    v = v.repeat_interleave(repeat, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    if causal:
        future = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _to_layout(x, layout):  # x is [b, n, s, d]
    return x if layout == "b h s d" else x.transpose(1, 2).contiguous()


@pytest.mark.parametrize("layout", ["b h s d", "b s h d"])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_self_attention_matches_naive(layout, causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    expected = naive_attention(q, k, v, causal, scale=0.3)
    attention = FlashSelfAttention(scale=0.3)
    heads_dim = 2 if layout == "b s h d" else 1
    packed = torch.cat([_to_layout(t, layout) for t in (q, k, v)], dim=heads_dim)
    out_packed = attention(packed, causal=causal, layout=layout)
    out_tuple = attention(tuple(_to_layout(t, layout) for t in (q, k, v)), causal=causal,
                          layout=layout)
    assert out_packed.shape == (B, H, S, D)
    assert (out_packed - expected).abs().max() < 1e-5
    assert (out_tuple - expected).abs().max() < 1e-5


def test_flash_self_attention_alibi_mask_and_cast():
    torch.manual_seed(1)
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float64) for _ in range(3))
    slopes = alibi_slopes(H)
    positions = torch.arange(S, dtype=torch.float32)
    bias = (slopes[:, None] * (positions - (S - 1)))[None, :, None, :]  # SMP's [1, n, 1, s] mask
    expected = naive_attention(q.float(), k.float(), v.float(), True, bias=bias)
    attention = FlashSelfAttention(use_alibi=True, triton_flash_attention=True)
    out = attention((q, k, v), attn_mask=bias, causal=True, cast_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert (out - expected).abs().max() < 1e-5
    with pytest.raises(ValueError):
        FlashSelfAttention()((q, k, v), attn_mask=bias)


@pytest.mark.parametrize("layout", ["b h s d", "b s h d"])
def test_flash_grouped_query_attention_matches_naive(layout):
    torch.manual_seed(2)
    groups = 2
    q = torch.randn(B, H, S, D)
    k, v = torch.randn(B, groups, S, D), torch.randn(B, groups, S, D)
    expected = naive_attention(q, k, v, causal=True)
    attention = FlashGroupedQueryAttention()
    heads_dim = 2 if layout == "b s h d" else 1
    kv = torch.cat([_to_layout(k, layout), _to_layout(v, layout)], dim=heads_dim)
    out_packed = attention(_to_layout(q, layout), kv, causal=True, layout=layout)
    out_tuple = attention(_to_layout(q, layout), (_to_layout(k, layout), _to_layout(v, layout)),
                          causal=True, layout=layout)
    assert out_packed.shape == (B, H, S, D)
    assert (out_packed - expected).abs().max() < 1e-5
    assert (out_tuple - expected).abs().max() < 1e-5


def test_flash_attention_dropout_only_in_training():
    torch.manual_seed(3)
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    attention = FlashSelfAttention(attention_dropout_prob=0.5).eval()
    expected = naive_attention(q, k, v, causal=True)
    assert (attention((q, k, v), causal=True) - expected).abs().max() < 1e-5
    attention.train()
    assert (attention((q, k, v), causal=True) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_rotary_matches_rotate_half_reference(percent):
    torch.manual_seed(4)
    rotary = RotaryEmbedding(D, rotary_percent=percent, rotary_base=500.0)
    x = torch.randn(S, B, H, D)  # [s, b, n, d]
    cos, sin = rotary(S)
    out = apply_rotary_pos_emb(x, (cos, sin))
    dim = int(D * percent)
    inv_freq = 1.0 / 500.0 ** (torch.arange(0, dim, 2).float() / dim)
    for position in range(S):
        for i in range(dim // 2):
            angle = position * inv_freq[i]
            a, b = x[position, ..., i], x[position, ..., i + dim // 2]
            c, s = math.cos(angle), math.sin(angle)
            assert torch.allclose(out[position, ..., i], a * c - b * s, atol=1e-5)
            assert torch.allclose(out[position, ..., i + dim // 2], b * c + a * s, atol=1e-5)
    assert torch.equal(out[..., dim:], x[..., dim:])
    # Explicit position ids [b, s] give the same tables as the default positions.
    ids = torch.arange(S).expand(B, S)
    out_ids = apply_rotary_pos_emb(x, rotary(S, ids))
    assert (out_ids - out).abs().max() < 1e-6


def test_alibi_slopes():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    six = alibi_slopes(6)  # 4 slopes of n=4, then slopes 0 and 2 of n=8
    expected = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    assert torch.allclose(six, torch.tensor(expected))


def test_norms_match_torch():
    torch.manual_seed(5)
    x = torch.randn(S, B, 16)
    norm = LayerNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_()
        norm.bias.uniform_()
    reference = torch.nn.LayerNorm(16, eps=1e-5)
    reference.load_state_dict(norm.state_dict())
    assert (norm(x) - reference(x)).abs().max() < 1e-6
    rms = RMSNorm(16, eps=1e-6, sequence_parallel=True)
    with torch.no_grad():
        rms.weight.uniform_()
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * rms.weight
    assert (rms(x) - expected).abs().max() < 1e-6
    assert rms.weight.sequence_parallel is True
