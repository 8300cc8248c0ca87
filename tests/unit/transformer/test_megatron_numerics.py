"""Megatron-LM's model-numerics flags (core_v0.16.1 semantics), each against an independent
computation: hand-written formulas, complex-number RoPE, Hugging Face Qwen3 / Llama modules,
and Megatron's unfused fp16 attention with query-key layer scaling."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_smp.config import ConfigError, ParallelConfig, TransformerConfig
from megatron_smp.models import GPTModel
from megatron_smp.models.hf import config_to_hf, get_adapter
from megatron_smp.parallel_state import build_parallel_state
from megatron_smp.training.arguments import parse_args
from megatron_smp.transformer import LayerNorm, RMSNorm, RotaryEmbedding, apply_rotary_pos_emb
from megatron_smp.transformer.attention import DotProductAttention
from megatron_smp.transformer.mlp import MLP

warnings.filterwarnings("ignore", message=".*")
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "12", "--max-position-embeddings", "32", "--train-iters", "1",
        "--vocab-size", "1003"]


@pytest.fixture(scope="module")
def state():
    return build_parallel_state(ParallelConfig())


def _model_config(*flags):
    config = parse_args(BASE + list(flags)).model
    return config.replace(vocab_size=1003, hidden_dropout=0.0, attention_dropout=0.0)


def _ids():
    return torch.randint(0, 1003, (2, 12), generator=torch.Generator().manual_seed(3))


# --apply-layernorm-1p --------------------------------------------------------------------------


def test_apply_layernorm_1p_norms_scale_by_one_plus_weight():
    x = torch.randn(5, 3, 16, dtype=torch.float64)
    w, b = 0.1 * torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    layer = LayerNorm(16, eps=1e-5, dtype=torch.float64, zero_centered_gamma=True)
    rms = RMSNorm(16, eps=1e-6, dtype=torch.float64, zero_centered_gamma=True)
    assert torch.equal(layer.weight, torch.zeros(16, dtype=torch.float64))  # starts at scale 1
    assert torch.equal(rms.weight, torch.zeros(16, dtype=torch.float64))
    with torch.no_grad():
        layer.weight.copy_(w), layer.bias.copy_(b), rms.weight.copy_(w)
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    torch.testing.assert_close(layer(x), (x - mean) / torch.sqrt(var + 1e-5) * (1 + w) + b,
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rms(x), x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
                               * (1 + w), rtol=1e-12, atol=1e-12)


def test_apply_layernorm_1p_norms_run_in_fp32_for_16_bit_inputs():
    """1 + w in bf16 keeps 8 mantissa bits: w = 0.003 would vanish. Zero-centred norms compute
    in fp32 (as Gemma's RMSNorm and Transformer Engine's do) and cast the output back."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    for cls in (LayerNorm, RMSNorm):
        norm = cls(16, dtype=torch.bfloat16, zero_centered_gamma=True)
        reference = cls(16, zero_centered_gamma=True)
        with torch.no_grad():
            norm.weight.fill_(0.003), reference.weight.copy_(norm.weight.float())
        out = norm(x.to(torch.bfloat16))
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, reference(x.to(torch.bfloat16).float()).to(torch.bfloat16))


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_layernorm_1p_model_converts_to_hf_llama_with_the_one_added(state, interleaved):
    """Also --rotary-interleaved: its q/k rows are reordered to HF's rotate-half pairing."""
    config = _model_config("--apply-layernorm-1p", "--normalization", "RMSNorm", "--swiglu",
                           "--position-embedding-type", "rope", "--disable-bias-linear",
                           "--untie-embeddings-and-output-weights",
                           "--group-query-attention", "--num-query-groups", "2",
                           *(["--rotary-interleaved"] if interleaved else []))
    assert config.layernorm_zero_centered_gamma
    torch.manual_seed(0)
    model = GPTModel(config, state).eval()
    norms = [p for n, p in model.named_parameters() if n.endswith("layernorm.weight")]
    assert len(norms) == 5 and all(torch.equal(p, torch.zeros_like(p)) for p in norms)
    with torch.no_grad():
        for param in norms:
            param.add_(0.2 * torch.randn_like(param))
    from transformers import LlamaForCausalLM

    adapter = get_adapter("llama")
    ours = model.state_dict()
    hf_sd = adapter.to_hf(ours, config)
    torch.testing.assert_close(hf_sd["model.norm.weight"],
                               ours["decoder.final_layernorm.weight"] + 1)
    hf = LlamaForCausalLM(config_to_hf(config, "llama")).eval()
    hf.load_state_dict(hf_sd, strict=True)
    with torch.no_grad():
        expected = hf(_ids()).logits
        logits = model(_ids())[..., :1003]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    back = adapter.from_hf(hf_sd, config)
    for name, value in ours.items():
        if not name.endswith("_extra_state"):
            torch.testing.assert_close(back[name], value, rtol=0, atol=1e-7)


# --qk-layernorm ---------------------------------------------------------------------------------


def _qwen3(seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=1003, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                         intermediate_size=96, max_position_embeddings=32,
                         tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                     "rope_theta": 1e4})
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # HF sets norms to one: make them count
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model


def test_qk_layernorm_matches_hf_qwen3_and_round_trips(state):
    hf = _qwen3()
    adapter = get_adapter(hf)
    config = adapter.config_from_hf(hf.config)
    assert config.qk_layernorm and config.kv_channels == 24 and config.window_size is None
    full = adapter.from_hf(hf.state_dict(), config)
    model = GPTModel(config, state).eval()
    model.load_state_dict(full, strict=True)
    assert model.decoder.layers[0].self_attention.q_layernorm.weight.shape == (24,)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids())[..., :1003], hf(_ids()).logits,
                                   rtol=1e-5, atol=1e-5)
    back = adapter.to_hf(full, config)
    assert back.keys() == hf.state_dict().keys()
    for name, value in hf.state_dict().items():
        assert torch.equal(back[name], value), name
    assert type(config_to_hf(config, "qwen3")).__name__ == "Qwen3Config"
    with pytest.raises(ConfigError, match="qwen3"):
        config_to_hf(config, "llama")


def test_qk_layernorm_flag_builds_per_head_norms_of_the_models_normalization(state):
    config = _model_config("--qk-layernorm", "--apply-layernorm-1p")
    attention = GPTModel(config, state).decoder.layers[0].self_attention
    assert isinstance(attention.q_layernorm, LayerNorm) and attention.q_layernorm.hidden_size == 16
    assert attention.k_layernorm.zero_centered_gamma
    with pytest.raises(ConfigError, match="--qk-layernorm.*gpt2"):
        get_adapter("gpt2").to_hf(GPTModel(config, state).state_dict(), config)


# --rotary-interleaved, --rotary-percent ----------------------------------------------------------


def _complex_rope(x, positions, rotary_dim, base):
    """RoFormer / Meta Llama RoPE: channel pairs (2i, 2i+1) as complex numbers times
    exp(1j * position * base^(-2i/dim)), the first `rotary_dim` channels only."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = positions.double()[:, None] * inv_freq[None, :]  # [s, dim/2]
    rot = torch.view_as_complex(x[..., :rotary_dim].double().reshape(
        *x.shape[:-1], rotary_dim // 2, 2).contiguous())
    rot = rot * torch.polar(torch.ones_like(angles), angles)[:, None, None, :]
    out = torch.view_as_real(rot).reshape(*x.shape[:-1], rotary_dim)
    return torch.cat([out, x[..., rotary_dim:].double()], dim=-1)


def _half_rope(x, positions, rotary_dim, base):
    """GPT-NeoX / HF Llama RoPE: channel i pairs with i + dim/2."""
    half = rotary_dim // 2
    permutation = torch.stack([torch.arange(half), torch.arange(half) + half], -1).flatten()
    rest = torch.arange(rotary_dim, x.shape[-1])
    interleaved = x[..., torch.cat([permutation, rest])]
    out = _complex_rope(interleaved, positions, rotary_dim, base)
    return out[..., torch.cat([torch.argsort(permutation), rest])]


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_rotary_interleaved_and_percent_match_complex_rope(interleaved, percent):
    s, d = 9, 16
    x = torch.randn(s, 2, 3, d, dtype=torch.float64)
    rope = RotaryEmbedding(d, percent, 500.0, interleaved=interleaved)
    assert rope.dim == int(d * percent)  # Megatron: kv_channels * rotary_percent
    got = apply_rotary_pos_emb(x, rope(s), interleaved)
    reference = (_complex_rope if interleaved else _half_rope)(x, torch.arange(s), rope.dim, 500.0)
    torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[..., rope.dim:], x[..., rope.dim:])


def test_rotary_interleaved_flag_reaches_the_model(state):
    config = _model_config("--position-embedding-type", "rope", "--rotary-interleaved")
    model = GPTModel(config, state)
    assert model.rotary_pos_emb.interleaved
    assert model.decoder.layers[1].self_attention.rotary_interleaved
    torch.manual_seed(0)
    plain = GPTModel(config.replace(rotary_interleaved=False), state)
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(model(_ids()), plain(_ids()))
    with pytest.raises(ConfigError, match="--rotary-interleaved.*rope"):
        parse_args(BASE + ["--rotary-interleaved"]).model.validate(ParallelConfig())
    with pytest.raises(ConfigError, match="--rotary-interleaved"):
        get_adapter("gpt_neox").to_hf(model.state_dict(), config)


def test_rotary_interleaved_qk_layernorm_model_exports_to_hf_qwen3(state):
    """Interleaved RoPE with per-head q/k norms: the norm weights are reordered with the rows."""
    reference = get_adapter("qwen3").config_from_hf(_qwen3().config)
    config = reference.replace(rotary_interleaved=True)
    torch.manual_seed(1)
    model = GPTModel(config, state).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.add_(0.3 * torch.randn_like(param))
    from transformers import Qwen3ForCausalLM

    hf_sd = get_adapter("qwen3").to_hf(model.state_dict(), config)
    hf = Qwen3ForCausalLM(config_to_hf(config, "qwen3")).eval()
    hf.load_state_dict(hf_sd, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids())[..., :1003], hf(_ids()).logits,
                                   rtol=1e-5, atol=1e-5)
    back = get_adapter("qwen3").from_hf(hf_sd, config)
    for name, value in model.state_dict().items():
        assert torch.equal(back[name], value), name


# --no-position-embedding, --use-rotary-position-embeddings -------------------------------------


def test_no_position_embedding_is_rope_only_and_changes_nothing_there(state):
    rope = _model_config("--position-embedding-type", "rope")
    for flags in (["--position-embedding-type", "rope", "--no-position-embedding"],
                  ["--use-rotary-position-embeddings"],
                  ["--use-rotary-position-embeddings", "--no-position-embedding"]):
        config = _model_config(*flags)
        assert config == rope
        torch.manual_seed(0)
        model = GPTModel(config, state).eval()
        torch.manual_seed(0)
        reference = GPTModel(rope, state).eval()
        assert not hasattr(model.embedding, "position_embeddings")
        with torch.no_grad():
            assert torch.equal(model(_ids()), reference(_ids()))
    with pytest.raises(ConfigError, match="--no-position-embedding.*--position-embedding-type"):
        parse_args(BASE + ["--no-position-embedding"])


# --squared-relu ---------------------------------------------------------------------------------


def test_squared_relu_mlp_is_relu_squared(state):
    config = _model_config("--squared-relu")
    assert config.activation == "squared_relu"
    torch.manual_seed(0)
    mlp = MLP(config, state).double()
    x = torch.randn(5, 2, 64, dtype=torch.float64)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    expected = F.linear(torch.relu(F.linear(x, fc1.weight, fc1.bias)) ** 2, fc2.weight, fc2.bias)
    torch.testing.assert_close(mlp(x), expected, rtol=1e-12, atol=1e-12)
    for other in ("--swiglu", "--openai-gelu"):
        with pytest.raises(ConfigError, match="--squared-relu"):
            parse_args(BASE + ["--squared-relu", other])


# --init-method-std -------------------------------------------------------------------------------


def test_init_method_std_and_scaled_output_projections(state):
    layers, std = 4, 0.05
    config = _model_config("--init-method-std", str(std), "--num-layers", str(layers),
                           "--hidden-size", "128", "--untie-embeddings-and-output-weights")
    torch.manual_seed(0)
    weights = dict(GPTModel(config, state).named_parameters())
    scaled = std / math.sqrt(2 * layers)  # Megatron's output_layer_init_method
    expected = {"embedding.word_embeddings.weight": std,
                "embedding.position_embeddings.weight": std, "output_layer.weight": std}
    for i in range(layers):
        prefix = f"decoder.layers.{i}."
        expected.update({prefix + "self_attention.linear_qkv.weight": std,
                         prefix + "mlp.linear_fc1.weight": std,
                         prefix + "self_attention.linear_proj.weight": scaled,
                         prefix + "mlp.linear_fc2.weight": scaled})
    for name, target in expected.items():
        values = weights[name].detach()[: 1003 if "vocab" in name or "output" in name
                                         or "word" in name else None]
        assert abs(values.std().item() / target - 1) < 0.03, (name, values.std().item(), target)
        assert abs(values.mean().item()) < 0.03 * target, name


# --apply-query-key-layer-scaling (kept in IGNORED_FLAGS) ---------------------------------------


def _megatron_unfused_fp16_attention(q, k, v, layer_number):
    """Megatron's local DotProductAttention with apply_query_key_layer_scaling (core_v0.16.1):
    fp16 scores = baddbmm(q, k^T, alpha=1/(sqrt(d) * coeff)), coeff = layer_number; the softmax
    (forced to fp32) multiplies them by coeff again. Megatron fills masked scores with -10000,
    which differs from -inf only for rows whose visible scores are all below -10000 (as some
    are here), whatever this flag: -inf keeps the comparison about the flag.
    q, k, v [b, n, s, d] fp16 -> [b, n, s, d] fp16."""
    b, n, s, d = q.shape
    coeff = float(layer_number)
    scores = torch.baddbmm(torch.empty(b * n, s, s, dtype=q.dtype), q.reshape(b * n, s, d),
                           k.reshape(b * n, s, d).transpose(1, 2), beta=0.0,
                           alpha=1.0 / (math.sqrt(d) * coeff)).view(b, n, s, s)
    scores = scores.float() * coeff
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return (probs.reshape(b * n, s, s) @ v.reshape(b * n, s, d)).view(b, n, s, d)


def test_query_key_layer_scaling_changes_nothing_with_sdpa(state):
    """The flag divides fp16 scores by the layer number so Megatron's fp16 GEMM output cannot
    overflow, then multiplies them back in an fp32 softmax: the same function. SDPA never
    rounds the scores to fp16, so our output equals Megatron's guarded one (and the exact
    fp64 attention) even where Megatron's unguarded fp16 scores overflow."""
    config = TransformerConfig(num_layers=8, hidden_size=256, num_attention_heads=4,
                               vocab_size=8, max_position_embeddings=16, attention_dropout=0.0)
    attention = DotProductAttention(config, state, layer_number=8)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 16, 64) * scale for scale in (150.0, 150.0, 1.0))
    q, k, v = q.half(), k.half(), v.half()
    ours = attention(*(t.permute(2, 0, 1, 3) for t in (q, k, v)))  # [s, b, n*d]
    ours = ours.view(16, 1, 4, 64).permute(1, 2, 0, 3).double()
    exact = torch.softmax((q.double() @ k.double().transpose(-1, -2) / 8.0).masked_fill(
        torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf")), -1) @ v.double()
    assert not torch.isfinite(_megatron_unfused_fp16_attention(q, k, v, 1)).all()  # overflow
    guarded = _megatron_unfused_fp16_attention(q, k, v, 8).double()
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, guarded, rtol=0, atol=2e-3)
    torch.testing.assert_close(ours, exact, rtol=0, atol=2e-3)
    # Moderate scores, every layer number: the same values to fp16 rounding (Megatron rounds
    # the probabilities to fp16 before multiplying by v).
    q, k = (q.float() / 20).half(), (k.float() / 20).half()
    ours = attention(*(t.permute(2, 0, 1, 3) for t in (q, k, v)))
    ours = ours.view(16, 1, 4, 64).permute(1, 2, 0, 3).double()
    for layer_number in (1, 3, 8):
        megatron = _megatron_unfused_fp16_attention(q, k, v, layer_number).double()
        torch.testing.assert_close(ours, megatron, rtol=0, atol=1e-2)


# Tensor parallelism ------------------------------------------------------------------------------


def _tp_step(rank, world_size):
    """Loss and the replicated norms' grads of a qk-layernorm / 1p / interleaved-RoPE model
    at TP = world_size, after the library's TP reduction of partial grads."""
    from megatron_smp.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
    from megatron_smp.tensor_parallel.random import model_parallel_seed
    from tests.unit.models.common import to_numpy

    state = build_parallel_state(ParallelConfig(tensor_model_parallel_size=world_size))
    config = _model_config("--qk-layernorm", "--apply-layernorm-1p", "--normalization",
                           "RMSNorm", "--position-embedding-type", "rope",
                           "--rotary-interleaved", "--group-query-attention",
                           "--num-query-groups", "2")
    model_parallel_seed(1234, state)
    torch.manual_seed(0)
    model = GPTModel(config, state)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    labels = torch.roll(_ids(), 1, dims=1)
    loss = model(_ids(), labels=labels).mean()
    loss.backward()
    allreduce_sequence_parallel_grads([model], state)
    grads = {n: p.grad for n, p in model.named_parameters() if "layernorm" in n}
    return to_numpy({"loss": loss.detach(), "grads": grads})


def test_qk_layernorm_grads_are_complete_at_tp2():
    from megatron_smp.testing import run_distributed

    one = run_distributed(_tp_step, 1)[0]
    two = run_distributed(_tp_step, 2)
    assert any("q_layernorm" in name for name in one["grads"])
    for result in two:
        assert abs(float(result["loss"]) - float(one["loss"])) < 1e-5
        for name, grad in one["grads"].items():
            torch.testing.assert_close(torch.from_numpy(result["grads"][name]),
                                       torch.from_numpy(grad), rtol=1e-4, atol=1e-6)


def test_qwen3_converts_through_the_checkpoint_tool(tmp_path):
    """tools/checkpoint/convert.py --model-type qwen3: HF -> ours (TP=2 layout) -> HF exact."""
    import contextlib
    import io

    from transformers import AutoModelForCausalLM

    from tools.checkpoint.convert import main

    source = _qwen3()
    source.save_pretrained(tmp_path / "hf")
    for loader, saver, load, save, extra in (
            ("hf", "megatron_smp", "hf", "smp", ["--target-tensor-parallel-size", "2"]),
            ("megatron_smp", "hf", "smp", "hf2", [])):
        stderr = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            status = main(["--model-type", "qwen3", "--loader", loader, "--saver", saver,
                           "--load-dir", str(tmp_path / load), "--save-dir",
                           str(tmp_path / save), *extra])
        assert status == 0, stderr.getvalue()
    result = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2").state_dict()
    assert result.keys() == source.state_dict().keys()
    for name, value in source.state_dict().items():
        assert torch.equal(result[name], value), name


def test_squared_relu_model_converts_to_hf_gpt_neox_relu2(state):
    """HF's "relu2" activation is relu(x)^2: a --squared-relu NeoX-shaped model exports to it."""
    from transformers import GPTNeoXForCausalLM

    config = _model_config("--squared-relu", "--position-embedding-type", "rope",
                           "--rotary-percent", "0.5", "--use-parallel-residual",
                           "--untie-embeddings-and-output-weights")
    torch.manual_seed(0)
    model = GPTModel(config, state).eval()
    adapter = get_adapter("gpt_neox")
    hf_config = config_to_hf(config, "gpt_neox")
    assert hf_config.hidden_act == "relu2"
    assert adapter.config_from_hf(hf_config).activation == "squared_relu"
    hf = GPTNeoXForCausalLM(hf_config).eval()
    hf.load_state_dict(adapter.to_hf(model.state_dict(), config), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids())[..., :1003], hf(_ids()).logits,
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="GPT-NeoX has no 'silu'"):
        config_to_hf(config.replace(activation="silu"), "gpt_neox")
