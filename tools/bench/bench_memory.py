"""Peak memory per rank: plain data parallelism vs the distributed optimizer.

Every configuration is `pretrain_gpt.py` itself, launched with torchrun on --mock-data.
On CPU the peak of a rank is its peak RSS (VmHWM, sampled from /proc/PID/status of every
worker while it runs) minus the peak RSS of a process that only imports torch and
megatron_smp; on CUDA each worker's `torch.cuda.max_memory_allocated()` is read at exit
(a few-line wrapper runs pretrain_gpt.py as __main__; --device cuda).

Beside each measured peak and saving (plain peak - distributed peak, of the largest rank)
stand the bytes that Megatron's table predicts per parameter:

    precision   plain DP                       distributed optimizer
    fp32        4 param + 4 grad + 8 Adam      4 + 4 + 8/dp
    bf16/fp16   2 param + 4 grad + 4 main + 8  2 + 4 + (4 + 8)/dp

(grads are accumulated and reduced in fp32, the default here), and their ratio.

    python tools/bench/bench_memory.py                           # 105M GPT, DP=2 and 4
    python tools/bench/bench_memory.py --world-sizes 2 --precisions fp32 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 1024 * 1024

# Bytes per parameter held on every rank (replicated) and sharded over DP by the
# distributed optimizer; everything sharded is replicated without it.
BYTES_PER_PARAM = {
    "fp32": {"replicated": 4 + 4, "sharded": 8},
    "bf16": {"replicated": 2 + 4, "sharded": 4 + 8},
    "fp16": {"replicated": 2 + 4, "sharded": 4 + 8},
}

# Runs inside each torchrun worker on CUDA: pretrain_gpt.py as __main__, then the peak.
_CUDA_WRAPPER = """
import atexit, os, runpy, sys, torch
def _report():
    with open(os.path.join({out!r}, "rank" + os.environ["RANK"]), "w") as f:
        f.write(str(torch.cuda.max_memory_allocated()))
atexit.register(_report)
sys.argv = [{script!r}] + sys.argv[1:]
runpy.run_path({script!r}, run_name="__main__")
"""


def parameter_count(layers: int, hidden: int, vocab: int, seq: int, divisible_by: int = 128):
    """Parameters of pretrain_gpt.py's GPT (learned positions, LayerNorm, 4h GeLU MLP,
    biases, tied output layer) at TP=1."""
    padded_vocab = -(-vocab // divisible_by) * divisible_by
    per_layer = 12 * hidden * hidden + 13 * hidden
    return padded_vocab * hidden + seq * hidden + layers * per_layer + 2 * hidden


def theoretical_bytes(num_params: int, precision: str, dp: int, distributed: bool) -> int:
    """Bytes per rank of params, grads, main params and Adam state in Megatron's table."""
    table = BYTES_PER_PARAM[precision]
    sharded = table["sharded"] / dp if distributed else table["sharded"]
    return int(num_params * (table["replicated"] + sharded))


def _status_kib(pid: int, field: str) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _children(pid: int) -> List[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _rank_of(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"RANK="):
                    return int(item[5:])
    except (OSError, ValueError):
        return None
    return None


def baseline_rss_bytes(python: str) -> int:
    """Peak RSS of a process that imports torch and megatron_smp and does nothing else."""
    code = (
        "import torch, megatron_smp, megatron_smp.training\n"
        "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])"
    )
    out = subprocess.run(
        [python, "-c", code], cwd=REPO, env=_environment(), capture_output=True, text=True,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[-1]) * 1024


def _environment() -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("MASTER_PORT", None)
    return env


def pretrain_flags(args, precision: str, distributed: bool) -> List[str]:
    flags = [
        "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
        "--max-position-embeddings", str(args.seq), "--micro-batch-size", "1",
        "--train-iters", str(args.iters), "--eval-iters", "0", "--eval-interval", "1000000",
        "--log-interval", "1", "--lr", "1e-4", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(args.vocab),
        "--distributed-backend", "nccl" if args.device == "cuda" else "gloo",
    ]
    if precision != "fp32":
        flags.append("--" + precision)
    if precision == "fp16":
        # The default initial scale (2^32) overflows and skips the first steps, which then
        # never allocate the optimizer state that is being measured.
        flags += ["--initial-loss-scale", str(args.initial_loss_scale)]
    if distributed:
        flags.append("--use-distributed-optimizer")
    return flags + list(getattr(args, "extra_flags", []))


def run_config(args, precision: str, dp: int, distributed: bool) -> List[int]:
    """One torchrun of pretrain_gpt.py; the peak bytes of each rank, by rank."""
    script = os.path.join(REPO, "pretrain_gpt.py")
    torchrun = os.path.join(os.path.dirname(args.python), "torchrun")
    with tempfile.TemporaryDirectory() as out_dir:
        target = [script]
        if args.device == "cuda":
            wrapper = os.path.join(out_dir, "wrapper.py")
            with open(wrapper, "w") as f:
                f.write(_CUDA_WRAPPER.format(out=out_dir, script=script))
            target = [wrapper]
        command = [torchrun, "--standalone", "--nproc-per-node", str(dp), *target,
                   *pretrain_flags(args, precision, distributed)]
        log_path = os.path.join(out_dir, "log")
        with open(log_path, "w") as log:
            process = subprocess.Popen(command, cwd=REPO, env=_environment(), stdout=log,
                                       stderr=subprocess.STDOUT)
            peaks: Dict[int, int] = {}
            ranks: Dict[int, int] = {}
            start = time.time()
            # VmHWM only grows, so a sample shortly before a worker exits holds its peak.
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
                if time.time() - start > args.timeout:
                    process.kill()
                    raise RuntimeError(f"timed out after {args.timeout} s: {' '.join(command)}")
                time.sleep(0.02)
        with open(log_path) as f:
            log_text = f.read()
        finished = f"iteration {args.iters:8d}/{args.iters:8d}" in log_text
        if process.returncode != 0 and not finished:
            raise RuntimeError(f"{' '.join(command)} failed:\n{log_text[-4000:]}")
        if process.returncode != 0:
            # Seen once in ~30 runs: gloo aborting in process teardown after the last
            # iteration; the peak of the training itself was measured.
            print(f"warning: exit code {process.returncode} after the last iteration "
                  f"({precision}, dp={dp}, distributed={distributed})", file=sys.stderr)
        skipped = re.findall(r"number of skipped iterations:\s*(\d+)", log_text)
        if not skipped or int(skipped[-1]):
            raise RuntimeError(
                f"{' '.join(command)}: {skipped[-1] if skipped else 'unknown'} iterations "
                "skipped (fp16 overflow?); their optimizer state was never allocated, so the "
                "peak would not count it: lower --initial-loss-scale"
            )
        if args.device == "cuda":
            return [int(open(os.path.join(out_dir, f"rank{r}")).read()) for r in range(dp)]
    return [peaks[r] for r in range(dp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "fp16"],
                        choices=sorted(BYTES_PER_PARAM))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--initial-loss-scale", type=float, default=4096.0,
                        help="fp16 runs only")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--python", default=os.path.join(REPO, ".venv", "bin", "python"))
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()

    num_params = parameter_count(args.layers, args.hidden, args.vocab, args.seq)
    baseline = baseline_rss_bytes(args.python) if args.device == "cpu" else 0
    what = "peak RSS - import baseline" if args.device == "cpu" else "max_memory_allocated"
    print(f"GPT {args.layers}x{args.hidden}, vocab {args.vocab}, seq {args.seq}: "
          f"{num_params / 1e6:.1f}M params, {args.iters} iterations, {args.device}; "
          f"{what}" + (f" (baseline {baseline / MIB:.0f} MiB)" if baseline else ""))
    print("MiB per rank (largest rank; theory: model state only, no activations)")
    print(f"{'precision':>9} {'dp':>3} {'plain':>6} {'(theory)':>8} {'distopt':>8} "
          f"{'(theory)':>8} {'saved':>6} {'(theory)':>8} {'ratio':>6}   "
          "per rank (plain | distopt)")
    rows = []
    for dp in args.world_sizes:
        for precision in args.precisions:
            plain = [p - baseline for p in run_config(args, precision, dp, False)]
            sharded = [p - baseline for p in run_config(args, precision, dp, True)]
            saved = max(plain) - max(sharded)
            plain_theory = theoretical_bytes(num_params, precision, dp, False)
            sharded_theory = theoretical_bytes(num_params, precision, dp, True)
            theory = plain_theory - sharded_theory
            row = {
                "precision": precision, "dp": dp, "plain_bytes": plain,
                "distributed_bytes": sharded, "saved_bytes": saved,
                "theoretical_plain_bytes": plain_theory,
                "theoretical_distributed_bytes": sharded_theory,
                "theoretical_saving_bytes": theory, "ratio": saved / theory,
            }
            rows.append(row)
            per_rank = (" ".join(f"{p / MIB:.0f}" for p in plain) + " | "
                        + " ".join(f"{p / MIB:.0f}" for p in sharded))
            print(f"{precision:>9} {dp:>3} {max(plain) / MIB:>6.0f} {plain_theory / MIB:>8.0f} "
                  f"{max(sharded) / MIB:>8.0f} {sharded_theory / MIB:>8.0f} "
                  f"{saved / MIB:>6.0f} {theory / MIB:>8.0f} {row['ratio']:>6.2f}   {per_rank}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"num_params": num_params, "baseline_bytes": baseline, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
