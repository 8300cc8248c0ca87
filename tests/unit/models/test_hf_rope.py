"""Scaled RoPE: Llama 3.x (`--use-rope-scaling`) and YaRN (`--position-embedding-type yarn`)
give Hugging Face's logits at positions beyond the original context, their HF
`rope_parameters` dicts convert both ways, and the flags are errors without the RoPE they
scale."""
import warnings

import pytest
import torch

import megatron_smp as smp
from megatron_smp.config import ConfigError, ParallelConfig
from megatron_smp.models.hf import config_to_hf, get_adapter
from megatron_smp.training.arguments import parse_args
from megatron_smp.transformer.rope import (
    Llama3RopeScaling,
    YarnRopeScaling,
    default_inv_freq,
    rope_frequencies,
)

warnings.filterwarnings("ignore", message=".*")

# Small original contexts so that the 40-token inputs reach 2.5x past them, with the
# ramps / smooth bands inside a head dim of 24 (12 frequencies).
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 0.5,
          "high_freq_factor": 2.0, "original_max_position_embeddings": 16}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 0.25,
        "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}
YARN_DEFAULTS = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                 "original_max_position_embeddings": 16}
# --rotary-seq-len-interpolation-factor (Gemma 3's full-attention layers use it).
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}


def build_llama(rope_parameters, seed=0):
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=1003, num_key_value_heads=2, intermediate_size=96,
                            num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                            head_dim=24, max_position_embeddings=64,
                            rope_parameters=dict(rope_parameters))
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("rope", [LLAMA3, YARN, YARN_DEFAULTS, LINEAR],
                         ids=["llama3", "yarn", "yarn_defaults", "linear"])
def test_scaled_rope_matches_hf_beyond_original_context(rope):
    smp.init({"random_seed": 3})
    hf = build_llama(rope)
    ids = torch.randint(0, 1003, (2, 40), generator=torch.Generator().manual_seed(1))
    model = smp.transform(hf)
    with torch.no_grad():
        assert (model(ids).logits - hf(ids).logits).abs().max() < 2e-4
    # The scaling really is applied: HF's own tables (inv_freq and the cos/sin factor).
    ours = [m for m in model.modules() if type(m).__name__ == "RotaryEmbedding"][0]
    assert torch.equal(ours.inv_freq, hf.model.rotary_emb.inv_freq)
    assert ours.attention_scaling == hf.model.rotary_emb.attention_scaling
    assert not torch.equal(ours.inv_freq, default_inv_freq(24, 10000.0))
    # rope_parameters in and out.
    adapter = get_adapter(hf)
    config = adapter.config_from_hf(hf.config)
    back = config_to_hf(config, "llama").rope_parameters
    expected = dict(hf.config.rope_parameters)
    if rope is YARN_DEFAULTS:  # written out explicitly, HF's defaults
        expected.update(beta_fast=32.0, beta_slow=1.0, truncate=True)
    assert back == expected
    assert adapter.config_from_hf(config_to_hf(config, "llama")) == config


def test_scaling_values():
    yarn = YarnRopeScaling(factor=40.0, mscale=1.0, mscale_all_dim=1.0)
    assert yarn.attention_scaling() == 1.0  # DeepSeek-V3's ratio
    assert YarnRopeScaling(factor=4.0).attention_scaling() == pytest.approx(
        0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    inv_freq, scaling = rope_frequencies(8, 500000.0, Llama3RopeScaling())
    assert scaling == 1.0 and inv_freq.shape == (4,)
    base = default_inv_freq(8, 500000.0)
    assert inv_freq[0] == base[0] and inv_freq[-1] == base[-1] / 8  # kept / divided


def _argv(*extra):
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "16", "--train-iters", "2", "--mock-data", "--vocab-size", "100",
            *extra]


def test_flags():
    configs = parse_args(_argv("--position-embedding-type", "rope", "--use-rope-scaling",
                               "--rope-scaling-factor", "32", "--rope-scaling-low-freq-factor",
                               "2"))
    model = configs.model
    assert (model.use_rope_scaling, model.rope_scaling_factor,
            model.rope_scaling_low_freq_factor) == (True, 32.0, 2.0)
    configs = parse_args(_argv("--position-embedding-type", "yarn", "--rotary-scaling-factor",
                               "32", "--yarn-original-max-position-embeddings", "4096",
                               "--yarn-beta-fast", "16", "--mscale", "0.5",
                               "--no-yarn-correction-range-round-to-int"))
    model = configs.model
    assert (model.yarn_rotary_scaling_factor, model.yarn_original_max_position_embeddings,
            model.yarn_beta_fast, model.yarn_beta_slow, model.yarn_mscale,
            model.yarn_correction_range_round_to_int) == (32.0, 4096, 16.0, 1.0, 0.5, False)
    with pytest.raises(ConfigError, match="--rope-scaling-factor.*--use-rope-scaling"):
        parse_args(_argv("--position-embedding-type", "rope", "--rope-scaling-factor", "8"))
    with pytest.raises(ConfigError, match="--mscale.*--position-embedding-type yarn"):
        parse_args(_argv("--position-embedding-type", "rope", "--mscale", "1"))
    both = parse_args(_argv("--position-embedding-type", "yarn", "--use-rope-scaling"))
    with pytest.raises(ConfigError, match="--use-rope-scaling.*rope"):
        both.model.validate(both.parallel)
    config = configs.model.replace(yarn_rotary_scaling_factor=0.0)
    with pytest.raises(ConfigError, match="--rotary-scaling-factor"):
        config.validate(ParallelConfig())


@pytest.mark.parametrize("rope", [LLAMA3, YARN_DEFAULTS], ids=["llama3", "yarn"])
def test_scaled_partial_rope_of_gpt_neox_matches_hf(rope):
    """The scaling applies to the rotated channels only (HF: dim = head_dim x
    partial_rotary_factor; ours: --rotary-percent)."""
    import transformers as tf

    smp.init({"random_seed": 3})
    config = tf.GPTNeoXConfig(vocab_size=1003, intermediate_size=128, num_hidden_layers=2,
                              hidden_size=64, num_attention_heads=2, max_position_embeddings=64,
                              rope_parameters=dict(rope, partial_rotary_factor=0.5))
    torch.manual_seed(0)
    hf = tf.GPTNeoXForCausalLM(config).eval()
    ids = torch.randint(0, 1003, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (smp.transform(hf)(ids).logits - hf(ids).logits).abs().max() < 2e-4
    ours = get_adapter(hf).config_from_hf(hf.config)
    assert ours.rotary_percent == 0.5
    assert get_adapter(hf).config_from_hf(config_to_hf(ours, "gpt_neox")) == ours
