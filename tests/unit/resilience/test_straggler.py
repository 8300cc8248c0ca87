"""The straggler report at three ranks with made-up step times: --straggler-minmax-count names
that many slowest and fastest ranks, a rank is a straggler only when below the threshold in
two reports running, and --disable-straggler-on-startup waits for rank 0's toggle. A phase
outside the step (train_rl.py's rollouts) is reported on its own, its straggler named with the
same rule."""
import re

from megatron_smp.testing import run_distributed


def _reports(rank, world_size):
    import time
    import urllib.request

    import torch

    from megatron_smp.config import ResilienceConfig
    from megatron_smp.resilience.straggler import StragglerDetector

    config = ResilienceConfig(log_straggler=True, straggler_minmax_count=2,
                              disable_straggler_on_startup=True, straggler_ctrlr_port=0)
    detector = StragglerDetector(config, rank, world_size, torch.device("cpu"),
                                 log=lambda line: None)
    # Rank 2 computes 4x as long as the others in the 2nd and 3rd intervals only.
    seconds = {0: [0.01] * 3, 1: [0.01] * 3, 2: [0.01, 0.04, 0.04]}[rank]
    # Rank 1 generates its rollouts 4x as slowly in the 2nd and 3rd intervals.
    rollout = {0: [0.2] * 3, 1: [0.2, 0.8, 0.8], 2: [0.2] * 3}[rank]
    scalars, out = [], []
    for interval, compute in enumerate(seconds):
        detector.phase_finished("rollout", rollout[interval])
        for step in range(3):
            detector.step_started(interval * 3 + step + 1)
            time.sleep(compute)
            detector.compute_finished()
            detector.step_finished()
        lines = detector.report(interval * 3 + 3, lambda *a: scalars.append(a))
        out.append(lines)
        if rank == 0 and interval == 0:  # turn the report on (it starts off)
            reply = urllib.request.urlopen(f"http://127.0.0.1:{detector.toggle.port}",
                                           timeout=10).read().decode()
            assert reply == "straggler report on\n"
    detector.close()
    return out, scalars


def test_minmax_count_persistence_and_toggle():
    results = run_distributed(_reports, 3, timeout=120)
    first, second, third = results[0][0]
    assert first == []  # off on startup, until the toggle
    assert all(r[0] == results[0][0] for r in results)  # alike on every rank
    slowest = re.search(r"slowest (rank \d+).*?, (rank \d+).* \| fastest", second[0])
    assert slowest.group(1) == "rank 2" and len(re.findall(r"rank \d+ \(", second[0])) == 4
    # Below the threshold once: not yet a straggler (forward-backward, then the rollouts).
    assert len(second) == 2
    assert re.match(r" straggler report, rollout phase, iterations 4-6 \(each rank's fastest "
                    r"rollout, .* 200\.0 ms\): slowest rank 1 \(.*\) 800\.0 ms 0\.25x", second[1])
    assert len(third) == 4 and re.match(r" STRAGGLER: rank 2 .* at 0\.[0-4]\dx", third[1])
    assert re.match(r" straggler report, rollout phase", third[2])
    assert re.match(r" STRAGGLER: rank 1 \(.*\) at 0\.25x the median throughput in its "
                    r"rollout phase \(rollout 800\.0 ms, median 200\.0 ms", third[3])
    tags = {tag for tag, _, _ in results[0][1]}
    assert tags == {f"straggler/{phase}{name}" for phase in ("", "rollout/") for name in
                    ("min_relative_throughput", "max_relative_throughput", "slowest_rank",
                     "fastest_rank")} | {"straggler/median_forward_backward_ms",
                                         "straggler/rollout/median_rollout_ms"}
