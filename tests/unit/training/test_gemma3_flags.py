"""Gemma 3's flags: what each sets, what each needs (clear errors naming the flag), and
pretrain_llama.py's SwiGLU default giving way to --geglu."""
import pytest

from megatron_smp.config import ConfigError
from megatron_smp.training.arguments import parse_args, validate_configs

BASE = ("--num-layers 6 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--train-iters 10 --mock-data --micro-batch-size 2 --vocab-size 1000 "
        "--tokenizer-type NullTokenizer").split()
GEMMA3 = ("--normalization RMSNorm --apply-layernorm-1p --qk-layernorm --sandwich-norm "
          "--apply-embedding-scaling --geglu --ffn-hidden-size 96 --disable-bias-linear "
          "--position-embedding-type rope --rotary-base 1000000 "
          "--rotary-seq-len-interpolation-factor 8 --local-rotary-base 10000 "
          "--window-size 511,0 --window-attn-skip-freq 6 --softmax-scale 0.0625 "
          "--final-logit-softcapping 30").split()


def parse(argv, **kwargs):
    configs = parse_args(argv, **kwargs)
    validate_configs(configs)
    return configs


def test_gemma3_flags_fill_the_config():
    model = parse(BASE + GEMMA3).model
    assert (model.gated_linear_unit, model.activation, model.ffn_hidden_size) == (
        True, "gelu_tanh", 96)
    assert (model.sandwich_norm, model.apply_embedding_scaling, model.qk_layernorm,
            model.layernorm_zero_centered_gamma) == (True, True, True, True)
    assert (model.rotary_base, model.rotary_seq_len_interpolation_factor,
            model.local_rotary_base) == (1e6, 8.0, 1e4)
    assert model.window_layer_pattern() == [1, 1, 1, 1, 1, 0]
    assert (model.softmax_scale, model.final_logit_softcapping) == (0.0625, 30.0)


def test_geglu_takes_over_pretrain_llamas_swiglu_default():
    from pretrain_llama import LLAMA_DEFAULTS

    model = parse(BASE + ["--geglu"], args_defaults=LLAMA_DEFAULTS).model
    assert model.activation == "gelu_tanh" and model.gated_linear_unit
    assert parse(BASE, args_defaults=LLAMA_DEFAULTS).model.activation == "silu"
    with pytest.raises(ConfigError, match="--swiglu and --geglu each pick the MLP activation"):
        parse(BASE + ["--swiglu", "--geglu"], args_defaults=LLAMA_DEFAULTS)


@pytest.mark.parametrize("extra,message", [
    (["--position-embedding-type", "rope", "--local-rotary-base", "1e4"],
     "--local-rotary-base applies to the sliding-window layers, and this model has none"),
    (["--local-rotary-base", "1e4", "--window-size", "7,0"],
     "--local-rotary-base is the RoPE base of the sliding-window layers: it needs "
     "--position-embedding-type rope"),
    (["--position-embedding-type", "yarn", "--rotary-seq-len-interpolation-factor", "4"],
     "--rotary-seq-len-interpolation-factor scales plain RoPE linearly"),
    (["--position-embedding-type", "rope", "--use-rope-scaling",
      "--rotary-seq-len-interpolation-factor", "4"],
     "--rotary-seq-len-interpolation-factor scales plain RoPE linearly"),
    (["--sandwich-norm", "--use-parallel-residual"],
     "--sandwich-norm normalises each branch's output before its residual add"),
    (["--final-logit-softcapping", "0"], "--final-logit-softcapping must be finite and > 0"),
    (["--softmax-scale", "-1"], "--softmax-scale must be finite and > 0"),
])
def test_gemma3_flags_need_what_they_scale(extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse(BASE + extra)
