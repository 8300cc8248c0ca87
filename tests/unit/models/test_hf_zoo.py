"""Llama 3.1 (scaled RoPE), Qwen2/2.5 (q/k/v biases, tied head, YaRN) and Qwen3-MoE (q/k norms,
renormalised top-k, dense layer): exact state-dict and config round trips (TP and EP shards
too), and HF's logits (within 2e-4, at positions past the original RoPE context) from
smp.transform at TP=1, TP=2 with sequence parallelism and, for the MoE, EP=2."""
import warnings

import pytest
import torch

import megatron_smp as smp
from megatron_smp.config import ConfigError
from megatron_smp.models.hf import config_to_hf, get_adapter
from megatron_smp.models.sharding import (
    expert_parallel_merge,
    expert_parallel_shard,
    merge_state_dicts,
    shard_state_dict,
)
from megatron_smp.testing import run_distributed
from tests.unit.models.test_hf_adapters import SEQ, _ids, build_hf

warnings.filterwarnings("ignore", message=".*")
# family -> HF family name of config_to_hf
FAMILIES = {"llama31": "llama", "qwen2": "qwen2", "qwen3_moe": "qwen3_moe"}
TOLERANCE = 2e-4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_round_trips_are_exact(family):
    hf = build_hf(family)
    adapter = get_adapter(hf)
    config = adapter.config_from_hf(hf.config)
    assert config.kv_channels == 24 != config.hidden_size // config.num_attention_heads
    if family == "llama31":
        assert config.use_rope_scaling and config.rope_scaling_original_max_position_embeddings < SEQ
    if family == "qwen2":
        assert config.add_qkv_bias and not config.add_bias_linear
        assert config.position_embedding_type == "yarn"
        assert not config.untie_embeddings_and_output_weights
    if family == "qwen3_moe":
        assert config.qk_layernorm and config.moe_layer_pattern() == [1, 0]
        assert not config.moe_router_pre_softmax  # norm_topk_prob=True
    hf_sd = hf.state_dict()
    full = adapter.from_hf(hf_sd, config)
    back = adapter.to_hf(full, config)
    assert back.keys() == hf_sd.keys()
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    hf_config = config_to_hf(config, FAMILIES[family])
    assert adapter.config_from_hf(hf_config) == config
    source = {k: v for k, v in hf.config.to_diff_dict().items() if k != "transformers_version"}
    again = {k: v for k, v in hf_config.to_diff_dict().items() if k != "transformers_version"}
    for key in ("bos_token_id", "eos_token_id"):  # not model fields; we write values out
        if source.get(key) is None:
            source.pop(key, None)
            again.pop(key, None)
    assert again == source
    experts = config.num_moe_experts or 1
    for tp, ep in ((2, 1), (2, 2)) if config.num_moe_experts else ((2, 1),):
        per_ep = []
        for ep_rank in range(ep):
            shards = [expert_parallel_shard(shard_state_dict(full, config, tp, r), experts, ep,
                                            ep_rank) if ep > 1 else
                      shard_state_dict(full, config, tp, r) for r in range(tp)]
            per_ep.append(merge_state_dicts(shards, config))
        merged = expert_parallel_merge(per_ep, experts) if ep > 1 else per_ep[0]
        assert merged.keys() == full.keys()
        assert all(torch.equal(merged[k], full[k]) for k in full), (tp, ep)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transform_tp1_matches_hf_logits(family):
    smp.init({"random_seed": 3})
    hf = build_hf(family)
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        assert (smp.transform(hf)(ids) - hf(ids).logits).abs().max() < TOLERANCE


def _parallel_worker(rank, world_size):
    out = {}
    for layout in ({"tensor_parallel_degree": 2}, {"expert_parallel_degree": 2}):
        smp.init(dict(layout))
        for family in FAMILIES:
            hf = build_hf(family)
            if "expert_parallel_degree" in layout and hf.config.model_type != "qwen3_moe":
                continue
            ids = _ids(hf.config.vocab_size)
            model = smp.transform(hf, config={"sequence_parallel": True})
            with torch.no_grad():
                error = (model(ids) - hf(ids).logits).abs().max().item()
            out[(tuple(layout.items()), family)] = error
    return out


def test_transform_tp2_and_ep2_match_hf_logits():
    for result in run_distributed(_parallel_worker, 2, timeout=300):
        assert len(result) == 4 and max(result.values()) < TOLERANCE, result


def test_unsupported_configs_are_clear_errors():
    hf = build_hf("qwen2")
    hf.config.use_sliding_window = True
    with pytest.raises(ConfigError, match="use_sliding_window"):
        get_adapter(hf).config_from_hf(hf.config)
    config = get_adapter("qwen2").config_from_hf(build_hf("qwen2").config)
    with pytest.raises(ConfigError, match="not a Qwen2"):
        config_to_hf(config.replace(add_qkv_bias=False), "qwen2")
    with pytest.raises(ConfigError, match="not a Llama"):
        config_to_hf(config, "llama")
    moe = get_adapter("qwen3_moe").config_from_hf(build_hf("qwen3_moe").config)
    with pytest.raises(ConfigError, match="not a Qwen3-MoE"):
        config_to_hf(moe.replace(qk_layernorm=False), "qwen3_moe")
