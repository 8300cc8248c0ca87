"""The step-time planner on this CPU: measured step times of pretrain_gpt.py layouts (DP, TP+SP,
PP with and without virtual stages, CP, EP; world 2, and DP at world 4) beside the planner's
prediction with the constants tools/bench/calibrate_planner.py measured (the same run, so the
machine's load is alike). The table gives predicted / measured per layout.

    python tools/bench/planner_cpu.py [--calibration FILE] [--only NAME ...] [--json out.json]

Each run is the entry script under torchrun on --mock-data (fp32, no dropout, one thread per
rank), the median "elapsed time per iteration" after the warm-up iterations.
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


def measure(flags, world_size: int, iters: int = 6, warmup: int = 2,
            timeout: float = 600) -> float:
    """Median seconds per iteration of pretrain_gpt.py with `flags` at `world_size`."""
    argv = flags + [a.format(iters=iters) for a in RUN]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(world_size),
                           os.path.join(REPO, "pretrain_gpt.py")] + argv,
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    times = {int(m.group(1)): float(m.group(2)) / 1e3 for m in _ITERATION_LINE.finditer(output)}
    timed = [t for i, t in sorted(times.items()) if i > warmup]
    if proc.returncode != 0 or not timed:
        raise RuntimeError(f"pretrain_gpt.py failed (exit {proc.returncode}):\n"
                           + output[-3000:])
    return statistics.median(timed)


def predict(flags, world_size: int, calibration: str):
    from plan import build_parser, load_configs

    from megatron_smp.training import planner

    ours, rest = build_parser().parse_known_args(
        ["--gpu", "cpu", "--num-gpus", str(world_size), "--efficiency", calibration] + flags
        + [a.format(iters=1) for a in RUN])
    configs, provider = load_configs(ours, rest)
    cluster = planner.Cluster(planner.cpu_spec(calibration), world_size,
                              efficiency=planner.load_efficiency(calibration))
    return planner.predict(configs, cluster, provider, memory=False)


def compare(layouts, calibration: str, iters: int = 6) -> list:
    rows = []
    for name, world_size, flags in layouts:
        measured = measure(MODEL + flags, world_size, iters)
        p = predict(MODEL + flags, world_size, calibration)
        rows.append({"name": name, "world_size": world_size, "measured_s": measured,
                     "predicted_s": p.step_time, "ratio": p.step_time / measured,
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
          f"{'load':>5}  breakdown (ms)")
    for r in rows:
        print(f"{r['name']:<10} {r['world_size']:>5} {r['measured_s'] * 1e3:>12.1f} "
              f"{r['predicted_s'] * 1e3:>13.1f} {r['ratio']:>6.2f} {r['load_average']:>5.1f}  "
              + " ".join(f"{k}={v}" for k, v in r["breakdown_ms"].items() if v))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
