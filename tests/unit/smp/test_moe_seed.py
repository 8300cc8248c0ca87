"""MoEConfig.random_seed seeds the per-expert-parallel-rank stream the expert modules' random
ops (router jitter) draw from. Checked inside test_torch_fsdp's world-4 run (EP=2)."""
import torch

from tests.unit.models.test_hf_adapters import build_hf


def moe_seed_checks(ids):
    """Run in a process after smp.init({"expert_parallel_degree": 2})."""
    import megatron_smp.smp as tsm
    from megatron_smp.tensor_parallel.random import EXPERT_PARALLEL_RNG, get_rng_tracker

    hf = build_hf("mixtral", router_jitter_noise=0.5)

    def run(seed):
        model = tsm.transform(hf, config=tsm.MoEConfig(moe_load_balancing="aux_loss",
                                                       random_seed=seed)).train()
        stream = get_rng_tracker().states[EXPERT_PARALLEL_RNG].clone()
        default = torch.get_rng_state()
        with torch.no_grad():
            logits = model(ids).logits
        assert torch.equal(torch.get_rng_state(), default)  # the default stream is untouched
        return stream, logits

    first, a = run(7)
    again, b = run(7)
    other, c = run(8)
    expected = torch.Generator().manual_seed(7 + 1024 + 100 * tsm.state.parallel_state.ep_rank)
    return {"stream_is_seeded": torch.equal(first, expected.get_state()),
            "same_seed_same": torch.equal(first, again) and torch.equal(a, b),
            "other_seed_differs": not torch.equal(a, c) and not torch.equal(first, other),
            "ep_rank": tsm.state.parallel_state.ep_rank,
            "stream": first.numpy().copy()}


def test_moe_config_random_seed_seeds_each_expert_parallel_rank_stream():
    from tests.unit.smp.test_torch_fsdp import keys_results

    results = [out["moe_seed"] for out in keys_results()]
    for out in results:
        assert out["stream_is_seeded"] and out["same_seed_same"] and out["other_seed_differs"]
    by_rank = {out["ep_rank"]: out["stream"] for out in results}
    assert sorted(by_rank) == [0, 1] and (by_rank[0] != by_rank[1]).any()  # unique per EP rank
