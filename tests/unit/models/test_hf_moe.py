"""Mixtral, Qwen2-MoE and Qwen3-MoE: exact state-dict and config round trips (TP and EP shards
too), smp.transform gives HF's logits at TP=1, TP=2 (+SP), EP=2 and TP=2 x EP=2, MoEConfig maps
onto Megatron's settings, and HF -> framework (TP=2, EP=2) -> HF is tensor-exact."""
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
from tests.unit.models.test_hf_adapters import _ids, build_hf

warnings.filterwarnings("ignore", message=".*")
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trips_are_exact(family):
    hf = build_hf(family)
    adapter = get_adapter(hf)
    config = adapter.config_from_hf(hf.config)
    assert config.num_moe_experts == 4 and config.moe_router_topk == 2
    if family == "qwen2_moe":
        assert config.moe_layer_pattern() == [1, 0] and config.moe_router_pre_softmax
    hf_sd = hf.state_dict()
    full = adapter.from_hf(hf_sd, config)
    back = adapter.to_hf(full, config)
    assert back.keys() == hf_sd.keys()
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    assert adapter.config_from_hf(config_to_hf(config, family)) == config
    hf_fields = {k: v for k, v in hf.config.to_diff_dict().items() if k != "transformers_version"}
    again = {k: v for k, v in config_to_hf(config, family).to_diff_dict().items()
             if k != "transformers_version"}
    # Not model fields (token ids) or HF's "hidden / heads" left unset: we write values out.
    for key in ("head_dim", "bos_token_id", "eos_token_id"):
        if hf_fields.get(key) is None:
            hf_fields.pop(key, None)
            again.pop(key, None)
    assert again == hf_fields  # config.json round trip (the converter keeps the source's)
    for tp, ep in ((2, 2), (1, 4)):
        per_ep = []
        for ep_rank in range(ep):
            shards = [expert_parallel_shard(shard_state_dict(full, config, tp, r), 4, ep, ep_rank)
                      for r in range(tp)]
            assert sorted(k for k in shards[0] if k.startswith("decoder.layers.0.mlp.experts")
                          and k.endswith("fc1.weight")) == [
                f"decoder.layers.0.mlp.experts.local_experts.{i}.linear_fc1.weight"
                for i in range(4 // ep)]  # this rank's experts, under local names
            per_ep.append(merge_state_dicts(shards, config))
        merged = expert_parallel_merge(per_ep, 4)
        assert merged.keys() == full.keys()
        assert all(torch.equal(merged[k], full[k]) for k in full), (tp, ep)


@pytest.mark.parametrize("family", FAMILIES)
def test_transform_tp1_matches_hf_logits(family):
    smp.init({"random_seed": 3})
    hf = build_hf(family)
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        expected = hf(ids).logits
        assert (smp.transform(hf)(ids) - expected).abs().max() < 1e-4
        model = smp.transform(hf, config=smp.MoEConfig(moe_load_balancing="aux_loss",
                                                       moe_all_to_all_dispatcher=False))
        assert (model(ids) - expected).abs().max() < 1e-4
    config = model.config
    assert config.moe_router_load_balancing_type == "aux_loss"
    assert config.moe_token_dispatcher_type == "allgather"
    assert (config.moe_aux_loss_coeff, config.moe_z_loss_coeff) == (0.001, 0.001)


def test_moe_config_mapping_and_errors():
    overrides = smp.MoEConfig().transformer_overrides()  # SMP's defaults
    assert overrides == {"moe_router_load_balancing_type": "sinkhorn", "moe_aux_loss_coeff": 0.0,
                         "moe_z_loss_coeff": 0.001, "moe_token_dispatcher_type": "alltoall"}
    balanced = smp.MoEConfig(moe_load_balancing="balanced").transformer_overrides()
    assert balanced["moe_expert_capacity_factor"] == 1.0
    for bad, message in ((dict(moe_load_balancing="greedy"), "moe_load_balancing"),
                         (dict(smp_moe=False), "smp_moe=False"),
                         (dict(global_token_shuffle=True), "global_token_shuffle"),
                         (dict(moe_z_loss_coeff=-1.0), "moe_z_loss_coeff")):
        with pytest.raises(ConfigError, match=message):
            smp.MoEConfig(**bad).transformer_overrides()
    smp.init({})
    with pytest.raises(ConfigError, match="has no experts"):
        smp.transform(build_hf("llama"), config=smp.MoEConfig())


def _parallel_worker(rank, world_size, layouts):
    """HF logits error per (layout, family) and, for the last layout, this rank's state dict."""
    import numpy as np

    out = {}
    for layout in layouts:
        smp.init(dict(layout))
        for family in FAMILIES:
            hf = build_hf(family)
            ids = _ids(hf.config.vocab_size)
            model = smp.transform(hf, config={"sequence_parallel": True})
            with torch.no_grad():
                error = (model(ids) - hf(ids).logits).abs().max().item()
            out[(tuple(sorted(layout.items())), family)] = error
            out[family] = {k: np.asarray(v.detach()) for k, v in
                           model.module.state_dict().items()}
    out["coords"] = (smp.state.tp_rank, smp.state.parallel_state.ep_rank)
    return out


def test_transform_tp2_and_ep2_match_hf_logits():
    layouts = ({"tensor_parallel_degree": 2}, {"expert_parallel_degree": 2})
    for result in run_distributed(_parallel_worker, 2, args=(layouts,), timeout=300):
        errors = {k: v for k, v in result.items() if isinstance(k, tuple)}
        assert len(errors) == 2 * len(FAMILIES) and max(errors.values()) < 1e-4, errors


def test_tp2_ep2_back_to_hf_is_exact():
    layouts = ({"tensor_parallel_degree": 2, "expert_parallel_degree": 2},)
    results = run_distributed(_parallel_worker, 4, args=(layouts,), timeout=300)
    for family in FAMILIES:
        hf = build_hf(family)
        adapter = get_adapter(hf)
        config = adapter.config_from_hf(hf.config)
        per_ep = []
        for ep_rank in range(2):
            shards = sorted((r["coords"][0], r[family]) for r in results
                            if r["coords"][1] == ep_rank)
            per_ep.append(merge_state_dicts(
                [{k: torch.from_numpy(v) for k, v in sd.items()} for _, sd in shards], config))
        back = adapter.to_hf(expert_parallel_merge(per_ep, 4), config)
        expected = hf.state_dict()
        assert back.keys() == expected.keys()
        assert all(torch.equal(back[k], expected[k]) for k in expected), family
    for result in results:
        errors = [v for k, v in result.items() if isinstance(k, tuple)]
        assert max(errors) < 1e-4, errors
