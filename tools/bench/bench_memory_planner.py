"""Validate the memory planner on CPU: predicted per-rank totals vs measured peaks.

Each configuration is pretrain_gpt.py / pretrain_llama.py itself under torchrun on
--mock-data; a rank's measured peak is its peak RSS (VmHWM, sampled from /proc while it runs,
bench_memory.py's method) minus the baseline: the peak RSS of the same entry script training a
tiny model (1 layer x 64, seq 32) at world size 2 in the same run. That baseline is the import
baseline plus what any training process holds besides tensors (gloo, the data pipeline,
Python objects; ~54 MiB on this machine), which the planner does not model. glibc is told
to serve allocations of 64 KiB and more by mmap (MALLOC_MMAP_THRESHOLD_), so freed tensors
leave the resident set at once and the peak follows live tensor bytes rather than allocator
slack. The prediction is tools/estimate_memory.py's for the same flags with --device cpu
(which models the CPU attention kernels). The table gives, per configuration, the largest
rank's prediction and measurement and their ratio; --check fails when any ratio leaves
[0.9, 1.1].

    python tools/bench/bench_memory_planner.py [--only NAME ...] [--json out.json] [--check]
    python tools/bench/bench_memory_planner.py --megatron   # ours beside Megatron's report
    python tools/bench/bench_memory_planner.py --measured out.json  # new predictions, old peaks
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

from bench_memory import (  # noqa: E402  (same directory)
    MIB, _children, _environment, _rank_of, _status_kib, baseline_rss_bytes,
)

BASE = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
        "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "4",
        "--vocab-size", "4000", "--train-iters", "3", "--eval-iters", "0",
        "--eval-interval", "1000000", "--log-interval", "1", "--lr", "1e-4", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--distributed-backend", "gloo"]

# Overrides BASE's shape (argparse keeps the last value).
TINY = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "2",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
        "--vocab-size", "128"]

# (name, entry, world size, extra flags)
CONFIGS = [
    ("dp2 fp32", "gpt", 2, []),
    ("dp2 distopt", "gpt", 2, ["--use-distributed-optimizer"]),
    ("dp2 bf16 distopt", "gpt", 2, ["--bf16", "--use-distributed-optimizer"]),
    ("tp2", "gpt", 2, ["--tensor-model-parallel-size", "2"]),
    ("tp2 sp", "gpt", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("pp2 1f1b mb4", "gpt", 2, ["--pipeline-model-parallel-size", "2",
                                "--global-batch-size", "16"]),
    ("pp2 vpp2 mb4", "gpt", 2, ["--pipeline-model-parallel-size", "2",
                                "--virtual-pipeline-model-parallel-size", "2",
                                "--global-batch-size", "16"]),
    ("cp2 p2p", "gpt", 2, ["--context-parallel-size", "2", "--position-embedding-type", "rope",
                           "--attention-dropout", "0"]),
    ("full recompute", "gpt", 2, ["--recompute-granularity", "full",
                                  "--recompute-method", "uniform",
                                  "--recompute-num-layers", "1"]),
    ("selective attn+mlp", "gpt", 2, ["--recompute-granularity", "selective",
                                      "--recompute-modules", "core_attn", "mlp"]),
    ("llama gqa tp2 sp", "llama", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                      "--group-query-attention", "--num-query-groups", "2"]),
    ("moe ep2 dropless", "llama", 2, ["--num-experts", "4", "--moe-router-topk", "2",
                                      "--expert-model-parallel-size", "2",
                                      "--moe-token-dispatcher-type", "alltoall"]),
    ("moe ep2 capacity", "llama", 2, ["--num-experts", "4", "--moe-router-topk", "2",
                                      "--expert-model-parallel-size", "2",
                                      "--moe-token-dispatcher-type", "alltoall",
                                      "--moe-expert-capacity-factor", "1.0",
                                      "--moe-pad-expert-input-to-capacity"]),
    ("fsdp2 dp2", "gpt", 2, ["--use-torch-fsdp2"]),
]


def _malloc_environment():
    """glibc serves every allocation of 64 KiB or more by mmap (a fixed threshold: no
    dynamic raise), so freed tensors leave the resident set at once and the RSS peak is the
    peak of live tensors plus the heap of small objects, not the allocator's retained slack."""
    return dict(_environment(), MALLOC_MMAP_THRESHOLD_="65536")


def predict(entry: str, world: int, flags):
    from megatron_smp.training.memory_planner import report_from_argv
    from tools.estimate_memory import entry_script

    provider, defaults = entry_script(entry)
    defaults = {k: v for k, v in defaults.items() if k != "tokenizer_type"}
    return report_from_argv(BASE + flags, world, provider, defaults, "cpu")


def measure(entry: str, world: int, flags, python: str, timeout: float):
    """Per-rank peak RSS (bytes) of one torchrun of the entry script."""
    script = os.path.join(REPO, f"pretrain_{entry}.py")
    torchrun = os.path.join(os.path.dirname(python), "torchrun")
    command = [torchrun, "--standalone", "--nproc-per-node", str(world), script, *BASE, *flags]
    with tempfile.TemporaryDirectory() as out_dir:
        log_path = os.path.join(out_dir, "log")
        with open(log_path, "w") as log:
            process = subprocess.Popen(command, cwd=REPO, env=_malloc_environment(), stdout=log,
                                       stderr=subprocess.STDOUT)
            peaks, ranks, start = {}, {}, time.time()
            while process.poll() is None:
                for pid in _children(process.pid):
                    if pid not in ranks:
                        rank = _rank_of(pid)
                        if rank is None:
                            continue
                        ranks[pid] = rank
                    kib = _status_kib(pid, "VmHWM")
                    if kib is not None:
                        peaks[ranks[pid]] = max(peaks.get(ranks[pid], 0), kib * 1024)
                if time.time() - start > timeout:
                    process.kill()
                    raise RuntimeError(f"timed out: {' '.join(command)}")
                time.sleep(0.02)
        text = open(log_path).read()
        if "iteration        3/       3" not in text:
            raise RuntimeError(f"{' '.join(command)} failed:\n{text[-3000:]}")
    return [peaks[r] for r in range(world)]


# Our flags for the configurations of tests/fixtures/megatron_memory (Megatron-LM's own
# theoretical_memory_usage.py numbers, recorded once), all with pretrain_llama.py's defaults.
_LLAMA = ["--group-query-attention", "--seq-length", "4096", "--micro-batch-size", "1",
          "--bf16", "--mock-data", "--train-iters", "1", "--tokenizer-type", "NullTokenizer"]
MEGATRON_CASES = {
    "llama3_70b_tp8_pp4_dp4_distopt_sp_selective": (128, _LLAMA + [
        "--num-layers", "80", "--hidden-size", "8192", "--ffn-hidden-size", "28672",
        "--num-attention-heads", "64", "--num-query-groups", "8", "--vocab-size", "128256",
        "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
        "--sequence-parallel", "--global-batch-size", "128", "--use-distributed-optimizer",
        "--recompute-granularity", "selective"]),
    "llama2_7b_tp2_dp4_sp_selective": (8, _LLAMA + [
        "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "11008",
        "--num-attention-heads", "32", "--num-query-groups", "32", "--vocab-size", "32000",
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "32",
        "--recompute-granularity", "selective"]),
    "mixtral_8x7b_ep8_dp8_distopt_full_recompute": (8, _LLAMA + [
        "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
        "--num-attention-heads", "32", "--num-query-groups", "8", "--vocab-size", "32000",
        "--num-experts", "8", "--moe-ffn-hidden-size", "14336", "--moe-router-topk", "2",
        "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "8",
        "--global-batch-size", "256", "--use-distributed-optimizer",
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"]),
}


def compare_with_megatron() -> None:
    """Ours (largest rank, CUDA kernels) beside Megatron-LM's theoretical report, MiB.
    Megatron's report is for its most loaded rank (the first pipeline stage) and leaves out
    recompute and the transient buffers; its activation formula assumes an ungated MLP and
    LayerNorm (see tests/unit/training/test_memory_planner.py for the term-by-term
    difference)."""
    from megatron_smp.training.memory_planner import report_from_argv
    from tools.estimate_memory import entry_script

    fixture = os.path.join(REPO, "tests", "fixtures", "megatron_memory", "megatron_memory.json")
    megatron = json.load(open(fixture))["cases"]
    provider, defaults = entry_script("llama")
    print(f"{'configuration':<46} {'weights+optim':>21} {'activations':>21} {'total':>21}")
    print(f"{'':<46} {'ours':>10} {'Megatron':>10} {'ours':>10} {'Megatron':>10} "
          f"{'ours':>10} {'Megatron':>10}")
    for name, (world, flags) in MEGATRON_CASES.items():
        rank = report_from_argv(flags, world, provider, defaults, "cuda").ranks[0]
        theirs = megatron[name]
        state = (rank.params + rank.grads + rank.optimizer) / MIB
        print(f"{name:<46} {state:>10.0f} {theirs['weight_and_optimizer_mib']:>10.0f} "
              f"{rank.activations / MIB:>10.0f} {theirs['activation_mib']:>10.0f} "
              f"{rank.total / MIB:>10.0f} {theirs['total_mib']:>10.0f}", flush=True)


def rank_stage(rank: int, world: int, flags) -> int:
    """Pipeline rank of a global rank (pp is the slowest-varying dimension)."""
    pp = int(flags[flags.index("--pipeline-model-parallel-size") + 1]) \
        if "--pipeline-model-parallel-size" in flags else 1
    return rank // (world // pp)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="configuration names to run")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--measured", help="reuse the peaks of an earlier run's --json")
    parser.add_argument("--megatron", action="store_true",
                        help="only print ours beside Megatron-LM's theoretical report")
    args = parser.parse_args()
    if args.megatron:
        compare_with_megatron()
        return 0
    stored = None
    if args.measured:
        # Peaks of an earlier run (its --json): only the predictions are computed again.
        with open(args.measured) as f:
            stored = json.load(f)
        baseline = stored["baseline_bytes"]
        stored = {row["config"]: row["measured_bytes"] for row in stored["rows"]}
        print(f"measured peaks from {args.measured}; MiB per rank above its baseline")
    else:
        imports = baseline_rss_bytes(args.python)
        baseline = max(measure("gpt", 2, TINY, args.python, args.timeout))
        print(f"baseline: tiny run {baseline / MIB:.0f} MiB (imports alone "
              f"{imports / MIB:.0f} MiB); MiB per rank above it")
    print(f"{'config':<20} {'params':>7} {'grads':>7} {'optim':>7} {'acts':>7} {'trans':>7} "
          f"{'predicted':>9} {'measured':>9} {'ratio':>6}")
    rows, worst = [], 0.0
    for name, entry, world, flags in CONFIGS:
        if args.only and name not in args.only:
            continue
        report = predict(entry, world, flags)
        if stored is not None:
            measured = stored[name]
        else:
            measured = [m - baseline for m in measure(entry, world, flags, args.python,
                                                      args.timeout)]
        per_rank = [report.ranks[rank_stage(r, world, flags)] for r in range(world)]
        largest = max(range(world), key=lambda r: measured[r])
        predicted = per_rank[largest]
        ratio = predicted.total / measured[largest]
        worst = max(worst, abs(ratio - 1))
        print(f"{name:<20} {predicted.params / MIB:>7.0f} {predicted.grads / MIB:>7.0f} "
              f"{predicted.optimizer / MIB:>7.0f} {predicted.activations / MIB:>7.0f} "
              f"{predicted.transient / MIB:>7.0f} {predicted.total / MIB:>9.0f} "
              f"{measured[largest] / MIB:>9.0f} {ratio:>6.3f}", flush=True)
        rows.append({"config": name, "predicted_bytes": [p.total for p in per_rank],
                     "measured_bytes": measured, "ratio": ratio})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baseline_bytes": baseline, "rows": rows}, f, indent=1)
    print(f"worst |predicted / measured - 1| = {worst:.3f}")
    return 1 if args.check and worst > 0.10 else 0


if __name__ == "__main__":
    sys.exit(main())
