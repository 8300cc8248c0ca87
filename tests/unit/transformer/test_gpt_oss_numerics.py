"""gpt-oss's numerics as Megatron's flags: the clamped quick-GeGLU with offset, the softmax
offsets (off-by-one, learnable sinks) against explicit formulas, per-layer windows from
--window-attn-skip-freq, and clear errors for flags that cannot work."""
import pytest
import torch

from megatron_smp.config import ConfigError, ParallelConfig, TransformerConfig
from megatron_smp.training.arguments import parse_args

BASE = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--train-iters 1 --mock-data --vocab-size 100").split()


def _config(**fields):
    return TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=100,
                             max_position_embeddings=16, **fields)


def test_clamped_quick_geglu_with_offset():
    from megatron_smp.transformer.mlp import activation_function, gated_linear_unit

    config = _config(gated_linear_unit=True, activation="quick_gelu", glu_linear_offset=1.0,
                     activation_func_clamp_value=0.7)
    x = torch.randn(5, 6) * 2
    gate, up = x[:, :3].clamp(max=0.7), x[:, 3:].clamp(-0.7, 0.7)
    expected = gate * torch.sigmoid(1.702 * gate) * (up + 1.0)
    got = gated_linear_unit(x, activation_function("quick_gelu"), config)
    assert torch.allclose(got, expected, atol=0, rtol=1e-6)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_softmax_offsets_match_the_explicit_formula(softmax_type):
    from megatron_smp.transformer.attention import DotProductAttention

    class _State:
        tp_group = None

    torch.manual_seed(0)
    config = _config(num_query_groups=2, softmax_type=softmax_type, attention_dropout=0.0)
    attention = DotProductAttention(config, _State())
    offset = attention.softmax_offset
    assert isinstance(offset, torch.nn.Parameter) == (softmax_type == "learnable")
    assert offset.shape == (4,) and (softmax_type == "learnable") == bool(offset.abs().sum())
    q, k, v = torch.randn(6, 2, 4, 8), torch.randn(6, 2, 2, 8), torch.randn(6, 2, 2, 8)
    got = attention(q, k, v).view(6, 2, 4, 8)
    k, v = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / 8 ** 0.5
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    weights = scores.exp() / (scores.exp().sum(-1, keepdim=True)
                              + offset.detach().exp().view(1, 4, 1, 1))
    expected = torch.einsum("bnst,tbnd->sbnd", weights, v)
    assert (got - expected).abs().max() < 1e-6


def test_window_attn_skip_freq_picks_the_window_layers():
    assert _config(window_size=(3, 0)).window_layer_pattern() == [1, 1, 1, 1]
    assert _config(window_size=(3, 0), window_attn_skip_freq=2).window_layer_pattern() == [
        1, 0, 1, 0]
    assert _config(window_size=(3, 0), window_attn_skip_freq=4).window_layer_pattern() == [
        1, 1, 1, 0]
    pattern = _config(window_size=(3, 0), window_attn_skip_freq="[0,1]*2")
    assert pattern.window_layer_pattern() == [0, 1, 0, 1]
    assert pattern.layer_window_size(2) == (3, 0) and pattern.layer_window_size(1) is None
    configs = parse_args(BASE + ["--window-size", "3,0", "--window-attn-skip-freq", "[1,1,0,0]",
                                 "--softmax-type", "learnable", "--quick-geglu",
                                 "--glu-linear-offset", "1", "--activation-func-clamp-value",
                                 "7"])
    model = configs.model
    assert model.window_layer_pattern() == [1, 1, 0, 0]
    assert (model.softmax_type, model.activation, model.gated_linear_unit,
            model.glu_linear_offset, model.activation_func_clamp_value) == (
        "learnable", "quick_gelu", True, 1.0, 7.0)


@pytest.mark.parametrize("flags,message", [
    ("--window-attn-skip-freq 2", "--window-attn-skip-freq chooses the layers that use"),
    ("--window-size 3,0 --window-attn-skip-freq [1,0]", "must hold one 0 or 1 per layer"),
    ("--window-size 3,0 --window-attn-skip-freq x", "--window-attn-skip-freq 'x'"),
    ("--glu-linear-offset 1", "--glu-linear-offset shape the gated linear unit"),
    ("--swiglu --activation-func-clamp-value -1", "must be finite and > 0"),
    ("--swiglu --quick-geglu", "--swiglu and --quick-geglu each pick the MLP activation"),
])
def test_flags_that_cannot_work_are_clear_errors(flags, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        configs = parse_args(BASE + flags.split())
        configs.model.validate(ParallelConfig(), 16)
