"""The step-time planner on this CPU: measured step times of pretrain_gpt.py layouts (DP, TP+SP,
PP with and without virtual stages, CP, EP; world 2, and DP at world 4) beside the planner's
prediction with the constants tools/bench/calibrate_planner.py measured (the same run, so the
machine's load is alike). The table gives predicted / measured per layout.

    python tools/bench/planner_cpu.py [--calibration FILE] [--only NAME ...] [--json out.json]

Each run is the entry script under torchrun on --mock-data (fp32, no dropout, one thread per
rank), the median "elapsed time per iteration" after the warm-up iterations. The machine is
shared: the prediction uses the calibration's idle-core figures scaled by the share of a core
the ranks got over the timed iterations (their CPU time / wall time / ranks, from /proc, over
the part of the step they were not waiting in the pipeline bubble: `busy_share`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))

from bench_throughput import _ITERATION_LINE  # noqa: E402  (same directory)

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "256", "--max-position-embeddings", "256", "--vocab-size", "4000",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
RUN = ["--train-iters", "{iters}", "--mock-data", "--tokenizer-type", "NullTokenizer",
       "--lr", "1e-4", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100000",
       "--distributed-backend", "gloo", "--no-check-for-nan-in-loss-and-grad"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type",
       "alltoall"]

# (name, world size, flags)
LAYOUTS = [
    ("dp2", 2, ["--micro-batch-size", "2", "--global-batch-size", "8"]),
    ("tp2 sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                   "--micro-batch-size", "2", "--global-batch-size", "4"]),
    ("pp2 1f1b", 2, ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
                     "--global-batch-size", "4"]),
    ("pp2 vpp2", 2, ["--pipeline-model-parallel-size", "2",
                     "--virtual-pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
                     "--global-batch-size", "4"]),
    ("cp2", 2, ["--context-parallel-size", "2", "--micro-batch-size", "2",
                "--global-batch-size", "4"]),
    ("ep2 moe", 2, MOE + ["--expert-model-parallel-size", "2", "--micro-batch-size", "2",
                          "--global-batch-size", "8"]),
    ("dp4", 4, ["--micro-batch-size", "1", "--global-batch-size", "8"]),
]


def _descendants(pid: int) -> list:
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _cpu_seconds(pids) -> float:
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            pass
    return total


def measure(flags, world_size: int, iters: int = 6, warmup: int = 2,
            timeout: float = 600) -> tuple:
    """(median seconds per iteration after the warm-up, the share of a core each rank got
    over those iterations: the ranks' CPU time / wall time / world size) of pretrain_gpt.py
    with `flags` at `world_size`. A rank waiting in a bubble or a collective uses no CPU, so
    the share reads low for layouts that wait."""
    import time

    argv = flags + [a.format(iters=iters) for a in RUN]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", str(world_size),
                             os.path.join(REPO, "pretrain_gpt.py")] + argv,
                            cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    output, marks, pids = [], {}, []
    deadline = time.time() + timeout
    try:
        for line in proc.stdout:
            output.append(line)
            match = _ITERATION_LINE.search(line)
            if match and int(match.group(1)) in (warmup, iters):
                if not pids:
                    pids = _descendants(proc.pid)
                marks[int(match.group(1))] = (time.perf_counter(), _cpu_seconds(pids))
            if time.time() > deadline:
                raise TimeoutError(f"pretrain_gpt.py ran past {timeout} s")
        proc.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(output)
    times = {int(m.group(1)): float(m.group(2)) / 1e3 for m in _ITERATION_LINE.finditer(text)}
    timed = [t for i, t in sorted(times.items()) if i > warmup]
    if proc.returncode != 0 or not timed or len(marks) < 2:
        raise RuntimeError(f"pretrain_gpt.py failed (exit {proc.returncode}):\n"
                           + text[-3000:])
    (wall0, cpu0), (wall1, cpu1) = marks[warmup], marks[iters]
    share = min(1.0, (cpu1 - cpu0) / (wall1 - wall0) / world_size)
    return statistics.median(timed), share


def predict(flags, world_size: int, calibration: str, share: float = 1.0):
    """The planner's prediction with the calibration's constants at CPU `share`."""
    import tempfile

    from calibrate_planner import at_share
    from plan import build_parser, load_configs

    from megatron_smp.training import planner

    with open(calibration) as f:
        scaled = at_share(json.load(f), share)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(scaled, f)
    try:
        ours, rest = build_parser().parse_known_args(
            ["--gpu", "cpu", "--num-gpus", str(world_size), "--efficiency", f.name] + flags
            + [a.format(iters=1) for a in RUN])
        configs, provider = load_configs(ours, rest)
        cluster = planner.Cluster(planner.cpu_spec(f.name), world_size,
                                  efficiency=planner.load_efficiency(f.name))
    finally:
        os.unlink(f.name)
    return planner.predict(configs, cluster, provider, memory=False)


def busy_share(flags, world_size: int, calibration: str, share: float) -> float:
    """The share of a core the ranks got while they ran: their CPU time / wall time / ranks
    (`measure`'s) reads low by the pipeline bubble, where they wait; divided by the share of
    the step the prediction has them busy."""
    p = predict(flags, world_size, calibration, share)
    busy = 1.0 - p.breakdown["pp_bubble"] / p.step_time
    return min(1.0, share / busy)


def compare(layouts, calibration: str, iters: int = 6) -> list:
    """Per layout: the measured step, the share of a core its ranks got meanwhile (other
    sessions' load moves it), and the prediction at that share."""
    rows = []
    for name, world_size, flags in layouts:
        measured, share = measure(MODEL + flags, world_size, iters)
        share = busy_share(MODEL + flags, world_size, calibration, share)
        p = predict(MODEL + flags, world_size, calibration, share)
        rows.append({"name": name, "world_size": world_size, "measured_s": measured,
                     "predicted_s": p.step_time, "ratio": p.step_time / measured,
                     "cpu_share": share,
                     "breakdown_ms": {k: round(v * 1e3, 1) for k, v in p.breakdown.items()},
                     "load_average": os.getloadavg()[0]})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", default=None,
                        help="calibrate_planner.py's JSON (default: measure now)")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    calibration = args.calibration
    if calibration is None:
        from calibrate_planner import calibrate

        calibration = os.path.join(REPO, ".planner_cpu_calibration.json")
        with open(calibration, "w") as f:
            json.dump(calibrate(), f, indent=1)
    layouts = [l for l in LAYOUTS if args.only is None or l[0] in args.only]
    rows = compare(layouts, calibration, args.iters)
    print(f"{'layout':<10} {'world':>5} {'measured ms':>12} {'predicted ms':>13} {'ratio':>6} "
          f"{'share':>5} {'load':>5}  breakdown (ms)")
    for r in rows:
        print(f"{r['name']:<10} {r['world_size']:>5} {r['measured_s'] * 1e3:>12.1f} "
              f"{r['predicted_s'] * 1e3:>13.1f} {r['ratio']:>6.2f} {r['cpu_share']:>5.2f} "
              f"{r['load_average']:>5.1f}  "
              + " ".join(f"{k}={v}" for k, v in r["breakdown_ms"].items() if v))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
