"""Llama 3.1 (scaled RoPE), Qwen2/2.5 (q/k/v biases, tied head, YaRN) and Qwen3-MoE (q/k norms,
renormalised top-k, dense layer): what their configs map to, exact state-dict and config.json
round trips (TP and EP shards too), and clear errors for what does not map. Their HF logits
through smp.transform (at positions past the original RoPE context) are checked with the other
families: TP=1 and TP=2 in test_hf_adapters.py (llama31, qwen2), TP=1, TP=2+SP, EP=2 and
TP=2 x EP=2 -> HF in test_hf_moe.py (qwen3_moe)."""
import warnings

import pytest
import torch

from megatron_smp.config import ConfigError
from megatron_smp.models.hf import config_to_hf, get_adapter
from megatron_smp.models.sharding import (
    expert_parallel_merge,
    expert_parallel_shard,
    merge_state_dicts,
    shard_state_dict,
)
from tests.unit.models.test_hf_adapters import SEQ, build_hf

warnings.filterwarnings("ignore", message=".*")
# family -> HF family name of config_to_hf
FAMILIES = {"llama31": "llama", "qwen2": "qwen2", "qwen3_moe": "qwen3_moe"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_round_trips_are_exact(family):
    hf = build_hf(family)
    adapter = get_adapter(hf)
    config = adapter.config_from_hf(hf.config)
    assert config.kv_channels == 24 != config.hidden_size // config.num_attention_heads
    if family == "llama31":
        assert config.use_rope_scaling
        assert config.rope_scaling_original_max_position_embeddings < SEQ
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
