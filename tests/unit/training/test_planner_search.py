"""--search on a small CPU model at world 2 (this machine's constants, measured by
tools/bench/calibrate_planner.py, in tests/fixtures/planner/cpu_calibration.json): it returns
exactly the layouts the memory planner says fit, ranked by predicted tokens/s; the best of them
then runs (pretrain_gpt.py under torchrun) faster than the slowest. Other processes share this
machine's cores, so the two runs are compared in idle-core terms: each step's time times the
share of a core its ranks got (tools/bench/planner_cpu.py's measure and busy_share), which
other processes' load cancels out of."""
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CALIBRATION = os.path.join(HERE, "..", "..", "fixtures", "planner", "cpu_calibration.json")
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "256", "--max-position-embeddings", "256", "--vocab-size", "4000",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "8"]
SPACE = dict(recompute=(None, "full"), shardings=("distributed-optimizer",),
             micro_batch_sizes=(1, 4))


def test_search_returns_what_fits_ranked():
    from tools.plan import build_parser, load_configs

    from megatron_smp.training import planner
    from megatron_smp.training.memory_planner import GIB, estimate_memory

    ours, rest = build_parser().parse_known_args(["--num-gpus", "2"] + MODEL)
    configs, provider = load_configs(ours, rest)
    cluster = planner.Cluster(planner.cpu_spec(CALIBRATION), 2,
                              efficiency=planner.load_efficiency(CALIBRATION))
    candidates = list(planner.candidate_layouts(configs, cluster, **SPACE))
    assert {(c.tp, c.pp, c.cp, c.vpp) for c in candidates} >= {
        (1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (1, 2, 1, 2), (1, 1, 2, 1)}
    # The memory planner's own figure for every candidate; a limit between them.
    memory = {c.name(): estimate_memory(planner.configs_for(configs, c), 2, provider,
                                        "cuda").largest.total for c in candidates}
    limit = sorted(memory.values())[len(memory) // 2]
    options = planner.PlanOptions(memory_fraction=limit / cluster.gpu.hbm_bytes)
    fitting, count = planner.search(configs, cluster, provider, options, top=0, **SPACE)
    assert count == len(candidates)
    assert {p.layout.name() for p in fitting} == {name for name, total in memory.items()
                                                   if total <= limit}
    assert 0 < len(fitting) < len(candidates)
    for p in fitting:
        assert p.fits and p.memory_gib == pytest.approx(memory[p.layout.name()] / GIB)
    speeds = [p.tokens_per_second_per_gpu for p in fitting]
    assert speeds == sorted(speeds, reverse=True)

    best, slowest = fitting[0], fitting[-1]
    assert best.step_time < 0.8 * slowest.step_time  # the search separates the layouts

    # The best runs faster than the slowest (the faster of two runs each if the first pair
    # disagrees: a burst of load can land on one run alone).
    from tools.bench.planner_cpu import busy_share, measure

    model = [a for i, a in enumerate(MODEL)
             if "--global-batch-size" not in MODEL[max(0, i - 1):i + 1]]

    def idle_core_seconds(plan):
        flags = model + plan.layout.flags()
        step, share = measure(flags, 2, iters=4, warmup=1, timeout=300)
        return step * busy_share(flags, 2, CALIBRATION, share)

    times = {"best": [idle_core_seconds(best)], "slowest": [idle_core_seconds(slowest)]}
    if not times["best"][0] < times["slowest"][0]:
        times["best"].append(idle_core_seconds(best))
        times["slowest"].append(idle_core_seconds(slowest))
    assert min(times["best"]) < min(times["slowest"]), (best.layout.name(),
                                                        slowest.layout.name(), times)
