"""`tensor_parallel.dropout`: F.dropout's semantics, its CPU mask drawn with `rand`."""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_smp.tensor_parallel import checkpoint, dropout, get_rng_tracker
from megatron_smp.transformer.attention import core_attention


def test_cpu_mask_scale_and_grad():
    p = 0.25
    x = torch.randn(64, 1024, requires_grad=True)
    torch.manual_seed(3)
    y = dropout(x, p)
    torch.manual_seed(3)
    keep = torch.rand(x.shape) >= p  # the documented draw: one uniform per element
    assert torch.equal(y != 0, keep)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.01
    torch.testing.assert_close(y[keep], x[keep] / (1 - p), rtol=1e-6, atol=0)
    grad = torch.randn_like(x)
    y.backward(grad)
    torch.testing.assert_close(x.grad, grad * keep / (1 - p), rtol=1e-6, atol=0)
    # The same expectation as F.dropout: the mean of dropped ones stays 1.
    assert abs(dropout(torch.ones(1 << 20), 0.1).mean().item() - 1.0) < 0.01


def test_identity_cases_bf16_and_p_one():
    x = torch.randn(8, 8)
    assert dropout(x, 0.5, training=False) is x and dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))  # F.dropout's path
    y = dropout(torch.ones(4096, dtype=torch.bfloat16), 0.5)
    assert y.dtype == torch.bfloat16 and set(y.unique().tolist()) == {0.0, 2.0}


def test_streams_and_recompute_replay_the_mask():
    get_rng_tracker().reset()
    get_rng_tracker().add("model-parallel-rng", 99)
    torch.manual_seed(0)
    x = torch.randn(32, 32)
    with get_rng_tracker().fork():
        inside = dropout(x, 0.5)
    outside = dropout(x, 0.5)
    torch.manual_seed(0)
    torch.randn(32, 32)
    assert torch.equal(outside, dropout(x, 0.5))  # the fork left the default stream alone
    assert not torch.equal(inside, outside)

    weight = torch.randn(32, 32)

    def block(a, w):
        return dropout(torch.tanh(a @ w), 0.5).sin()

    grads = []
    for recompute in (False, True):
        a = x.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        torch.manual_seed(11)
        out = checkpoint(block, False, a, w) if recompute else block(a, w)
        out.sum().backward()
        grads.append((out.detach(), a.grad, w.grad))
    for plain, recomputed in zip(*grads):
        assert torch.equal(plain, recomputed)


@pytest.mark.parametrize("kv_heads, dv", [(4, 8), (2, 8), (4, 6)])  # MHA, GQA, MLA-like
def test_cpu_causal_attention_with_dropout_matches_the_explicit_product(kv_heads, dv):
    """core_attention's CPU path with dropout (not SDPA's math fallback) computes
    dropout(softmax(q k^T / sqrt(d) + causal)) v with the mask `dropout` draws."""
    b, n, s, d, p = 2, 4, 16, 8, 0.2
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(b, n, s, d, generator=generator, requires_grad=True)
    k = torch.randn(b, kv_heads, s, d, generator=generator, requires_grad=True)
    v = torch.randn(b, kv_heads, s, dv, generator=generator, requires_grad=True)
    grad = torch.randn(b, n, s, dv, generator=generator)
    torch.manual_seed(5)
    out = core_attention(q, k, v, None, True, p)
    out.backward(grad)
    ours = (out.detach(), q.grad, k.grad, v.grad)

    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    kr = k2.repeat_interleave(n // kv_heads, dim=1)
    vr = v2.repeat_interleave(n // kv_heads, dim=1)
    scores = q2 @ kr.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    torch.manual_seed(5)
    keep = torch.rand(b * n, s, s).view(b, n, s, s) >= p
    reference = (F.softmax(scores, -1) * keep / (1 - p)) @ vr
    reference.backward(grad)
    for a, e in zip(ours, (reference.detach(), q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    # Without dropout the call is SDPA's (its fused CPU kernel), unchanged.
    torch.testing.assert_close(core_attention(q, k, v, None, True, 0.0),
                               F.scaled_dot_product_attention(q, kr, vr, is_causal=True))
