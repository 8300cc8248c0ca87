"""HF DeepseekV3ForCausalLM (random weights, odd sizes: q latent set and unset, non-zero expert
bias, group-limited routing, a dense first layer, shared experts, YaRN with mscale and
mscale_all_dim at positions beyond the original context) through `smp.transform` gives HF's
logits at TP=1, TP=2+SP and EP=2; the state dict and config (config.json) round-trip exactly."""
import pytest
import torch

import megatron_smp as smp
from megatron_smp.models.hf import config_to_hf, get_adapter
from megatron_smp.testing import run_distributed
from tests.unit.models.common import to_numpy, to_torch

SEQ, BATCH = 12, 2


# YaRN with an original context of 8: the 12 positions of the tests reach beyond it.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 0.9, "mscale_all_dim": 0.7}


def build_hf(q_lora_rank=16, seed=0, yarn=True):
    import transformers as tf

    config = tf.DeepseekV3Config(
        rope_parameters=dict(YARN) if yarn else None,
        vocab_size=1003, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=q_lora_rank,
        kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10,
        max_position_embeddings=32, tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(seed)
    model = tf.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # HF inits norms to one, the bias to zero, the gate to zero
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith("gate.weight"):
                param.normal_(0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.2)
    return model


def _ids():
    return torch.randint(0, 1003, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("q_lora_rank, yarn", [(16, True), (None, False)])
def test_round_trip_and_tp1_logits(q_lora_rank, yarn):
    hf = build_hf(q_lora_rank, yarn=yarn)
    adapter = get_adapter(hf)
    config = adapter.config_from_hf(hf.config)
    hf_sd = hf.state_dict()
    full = adapter.from_hf(hf_sd, config)
    back = adapter.to_hf(full, config)
    assert back.keys() == hf_sd.keys()
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    assert adapter.config_from_hf(config_to_hf(config, "deepseek_v3")) == config
    smp.init({"tensor_parallel_degree": 1})
    with torch.no_grad():
        expected = hf(_ids()).logits
        logits = smp.transform(hf)(_ids()).logits
    assert (logits - expected).abs().max() < 2e-4


def _tp2(rank, world_size, degrees):
    smp.init(degrees)
    hf = build_hf()
    with torch.no_grad():
        # MoE under TP needs sequence parallelism (as in Megatron-LM).
        config = {"sequence_parallel": True} if "tensor_parallel_degree" in degrees else None
        return to_numpy({"hf": hf(_ids()).logits, "ours": smp.transform(hf, config=config)(_ids()).logits})


@pytest.mark.parametrize("degrees", [{"tensor_parallel_degree": 2},
                                     {"expert_parallel_degree": 2}])
def test_tp2_and_ep2_logits(degrees):
    for result in to_torch(run_distributed(_tp2, 2, args=(degrees,), timeout=180)):
        assert (result["ours"] - result["hf"]).abs().max() < 2e-4


def test_convert_hf_to_ours_tp2_to_hf_is_exact(tmp_path):
    """tools/checkpoint/convert.py --model-type deepseek_v3 both ways: every tensor (expert bias
    included) and config.json equal."""
    import json

    import transformers

    from tests.unit.tools.test_convert import _convert_ok

    source = build_hf()
    source.save_pretrained(tmp_path / "hf")
    _convert_ok("deepseek_v3", "hf", "megatron_smp", tmp_path / "hf", tmp_path / "smp",
                "--target-tensor-parallel-size", "2")
    _convert_ok("deepseek_v3", "megatron_smp", "hf", tmp_path / "smp", tmp_path / "hf2")

    def config_json(path):
        with open(path / "config.json") as f:
            return {k: v for k, v in json.load(f).items() if k != "transformers_version"}

    assert config_json(tmp_path / "hf2") == config_json(tmp_path / "hf")
    result = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2")
    expected, actual = source.state_dict(), result.state_dict()
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
