"""TransformerBlock: activation recompute reproduces the plain run (dropout included), explicit
masks match the causal default, and the layer options build and run."""
import pytest
import torch

from megatron_smp.config import ParallelConfig, TransformerConfig
from megatron_smp.parallel_state import build_parallel_state
from megatron_smp.tensor_parallel.random import model_parallel_seed
from megatron_smp.transformer import TransformerBlock

S, B, H = 8, 2, 32


@pytest.fixture(scope="module")
def state():
    return build_parallel_state(ParallelConfig())


def _config(**overrides):
    settings = dict(num_layers=3, hidden_size=H, num_attention_heads=4, vocab_size=100,
                    max_position_embeddings=S, hidden_dropout=0.1, attention_dropout=0.1)
    settings.update(overrides)
    return TransformerConfig(**settings)


def _run(state, config, mask=None):
    """Loss and grads of one forward/backward with fixed weights, input and RNG streams."""
    torch.manual_seed(0)
    block = TransformerBlock(config, state, init_seed=11).train()
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    model_parallel_seed(5, state)
    out = block(x, mask)
    loss = (out * out).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    return loss.detach(), x.grad.clone(), grads


@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="full"),
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
        dict(recompute_granularity="selective"),
    ],
)
def test_recompute_matches_plain_run_with_dropout(state, recompute):
    loss, x_grad, grads = _run(state, _config())
    loss_r, x_grad_r, grads_r = _run(state, _config(**recompute))
    assert torch.equal(loss, loss_r)
    assert torch.allclose(x_grad, x_grad_r, atol=1e-6, rtol=0)
    for name in grads:
        assert torch.allclose(grads[name], grads_r[name], atol=1e-6, rtol=0), name


@pytest.mark.parametrize(
    "family",
    [
        dict(),
        dict(position_embedding_type="alibi"),
        dict(normalization="RMSNorm", gated_linear_unit=True, activation="silu",
             num_query_groups=2, add_bias_linear=False),
        dict(parallel_residual=True, kv_channels=4),
    ],
)
def test_explicit_causal_mask_matches_default(state, family):
    config = _config(hidden_dropout=0.0, attention_dropout=0.0, **family)
    causal = torch.ones(S, S, dtype=torch.bool).triu(1).expand(B, 1, S, S)
    loss, x_grad, _ = _run(state, config)
    loss_m, x_grad_m, _ = _run(state, config, causal)
    assert torch.allclose(loss, loss_m, rtol=1e-5)
    assert torch.allclose(x_grad, x_grad_m, atol=1e-5)


def test_padding_mask_hides_keys(state):
    """A key masked for every query has no influence on the outputs."""
    config = _config(hidden_dropout=0.0, attention_dropout=0.0, num_layers=1)
    torch.manual_seed(0)
    block = TransformerBlock(config, state).eval()
    x = torch.randn(S, B, H)
    mask = torch.ones(S, S, dtype=torch.bool).triu(1).expand(B, 1, S, S).clone()
    mask[..., 0] = True  # hide key 0 ...
    mask[..., 0, 0] = False  # ... except from itself (a fully masked row has no softmax)
    y = block(x, mask)
    x2 = x.clone()
    x2[0] += 1.0
    y2 = block(x2, mask)
    assert torch.allclose(y[1:], y2[1:], atol=1e-6)


def test_layers_are_seeded_by_global_number(state):
    config = _config()
    torch.manual_seed(0)
    full = TransformerBlock(config, state, init_seed=3)
    torch.manual_seed(99)  # a different stream: the per-layer seeds alone decide
    tail = TransformerBlock(config, state, layer_offset=1, num_layers=2, init_seed=3)
    assert [layer.layer_number for layer in tail.layers] == [2, 3]
    for index in (0, 1):
        for (name, a), (_, b) in zip(full.layers[index + 1].named_parameters(),
                                     tail.layers[index].named_parameters()):
            assert torch.equal(a, b), name
