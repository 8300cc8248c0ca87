"""--log-straggler at DP=2: an even run names no straggler; a rank slowed about 2x by a real CPU
limit (a cgroup's CFS quota and CPU weight, as root) or by the fault injector's "slow" fault
(factor 2) is named within three log intervals, and the slowed run's losses are the even run's.

Both ranks run on the same CPU: on a shared host, other processes load the CPUs unevenly (one
pinned to a CPU slows whichever rank runs there by 2x and more for seconds), which would make
an "even" run uneven; on one CPU whatever else runs slows both ranks alike. There, each rank in
a cgroup of its own -- rank 1's of a third of a CPU (quota) and half the weight of rank 0's --
gets half of rank 0's CPU time whether the CPU is otherwise idle (2/3 against 1/3) or crowded
(weight 512 against 1024; a cgroup each, so that the scheduler treats both alike)."""
import os
import re

import pytest

from megatron_smp.testing import run_distributed

ITERS, INTERVAL = 20, 5
ARGV = (
    "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 4 --global-batch-size 16 "
    f"--train-iters {ITERS} --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 "
    "--hidden-dropout 0 --attention-dropout 0 --lr 1e-3 --lr-warmup-iters 2 "
    f"--log-interval {INTERVAL} --eval-interval 1000 --eval-iters 0 --seed 7 --log-straggler "
    "--straggler-ctrlr-port 0"
).split()
_STRAGGLER = re.compile(r" STRAGGLER: rank (\d+) .* at ([\d.]+)x the median")
_REPORT = re.compile(r" straggler report, iterations (\d+)-(\d+) .*: slowest rank (\d+) ")


class CpuQuota:
    """A cgroup (v1 `cpu` controller, or v2) holding processes to `fraction` of one CPU in
    10 ms periods (a CFS quota: it bites on an idle CPU) and to `weight` of the default CPU
    weight against the other processes (CFS shares: it bites on a crowded CPU, where every
    process gets less than the quota anyway)."""

    def __init__(self, name: str, fraction=None, weight: float = 1.0) -> None:
        period = 10000
        quota = -1 if fraction is None else int(period * fraction)
        if os.path.exists("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
            self.root = "/sys/fs/cgroup/cpu"
            self.path = os.path.join(self.root, name)
            os.makedirs(self.path, exist_ok=True)
            self._write("cpu.cfs_period_us", period)
            self._write("cpu.cfs_quota_us", quota)
            self._write("cpu.shares", int(1024 * weight))  # of the default 1024
        else:
            self.root = "/sys/fs/cgroup"
            self.path = os.path.join(self.root, name)
            os.makedirs(self.path, exist_ok=True)
            self._write("cpu.max", f"{'max' if quota < 0 else quota} {period}")
            self._write("cpu.weight", max(1, int(100 * weight)))  # of the default 100

    def _write(self, name, value):
        with open(os.path.join(self.path, name), "w") as f:
            f.write(str(value))

    def add(self, pid: int) -> None:
        self._write("cgroup.procs", pid)

    def release(self, pid: int) -> None:
        with open(os.path.join(self.root, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        os.rmdir(self.path)


def _quota_possible() -> bool:
    try:
        quota = CpuQuota(f"msmp_probe_{os.getpid()}", 0.5)
        os.rmdir(quota.path)
        return True
    except OSError:
        return False


def _runs(rank, world_size, throttle_fraction):
    """Three runs in one spawn: even; rank 1 in a CPU quota from its first step; rank 1 with
    the injected "slow" fault (2x) from the start."""
    from megatron_smp.training import pretrain
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # both ranks on one CPU

    def run(extra, quota=None):
        calls = [0]

        def forward(data_iterator, model):
            calls[0] += 1
            if quota is not None and calls[0] == 1:
                quota.add(os.getpid())
            return forward_step(data_iterator, model)

        try:
            result = pretrain(train_valid_test_datasets_provider, model_provider, forward,
                              argv=ARGV + extra)
        finally:
            if quota is not None:
                quota.release(os.getpid())
        return {"lines": result.log_lines,
                "losses": {i: v["lm loss"] for i, v in result.train_losses.items()}}

    even = run([])
    quota = (CpuQuota(f"msmp_straggler_{os.getpid()}", throttle_fraction, 0.5) if rank == 1
             else CpuQuota(f"msmp_straggler_{os.getpid()}"))
    throttled = run([], quota)
    slow = run("--fault-injector-ranks 1 --fault-injector-fault-types slow "
               "--fault-injector-fault-delay 0 --fault-injector-slow-factor 2".split())
    return even, throttled, slow


def _named(lines):
    """[(last iteration of the interval, ranks named as stragglers)] per report."""
    out = []
    for line in lines:
        report = _REPORT.match(line)
        if report:
            out.append((int(report.group(2)), []))
        straggler = _STRAGGLER.match(line)
        if straggler:
            out[-1][1].append(int(straggler.group(1)))
    return out


@pytest.mark.skipif(not _quota_possible(), reason="needs a writable cgroup cpu controller "
                    "(root); the injected slow fault is tested in the same run")
def test_slowed_rank_is_named_and_an_even_run_names_nobody():
    results = run_distributed(_runs, 2, args=(1 / 3,), timeout=600, collective_timeout=120)
    even, throttled, slow = results[1]
    assert _named(even["lines"]) == [(i, []) for i in range(INTERVAL, ITERS + 1, INTERVAL)], \
        even["lines"]
    for run in (throttled, slow):
        named = _named(run["lines"])
        assert len(named) == ITERS // INTERVAL
        # Named within three log intervals, and nobody else ever.
        assert any(ranks == [1] for _, ranks in named[:3]), run["lines"]
        assert all(ranks in ([], [1]) for _, ranks in named), run["lines"]
        assert run["losses"] == even["losses"]  # a slow rank changes no number
    def reports(lines):
        return [line for line in lines if "straggler" in line.lower()]
    for name, run in (("even", even), ("cpu quota", throttled), ("injected slow", slow)):
        print(f"\n{name}:\n" + "\n".join(reports(run["lines"])))
    assert reports(results[0][1]["lines"]) == reports(throttled["lines"])  # alike everywhere
