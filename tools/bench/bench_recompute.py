"""Peak memory of selective recompute: --recompute-granularity selective with each
--recompute-modules choice, against no recompute, on one `pretrain_gpt.py` process (torchrun,
--mock-data, fp32). The peak is measured as bench_memory.py measures it: peak RSS above an
import baseline on CPU, `torch.cuda.max_memory_allocated()` with --device cuda.

    python tools/bench/bench_recompute.py                 # 4 x 512, seq 2048, 8 heads
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_memory  # noqa: E402

MIB = 1024 * 1024
CONFIGS = {
    "none": [],
    "core_attn": ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"],
    "mlp": ["--recompute-granularity", "selective", "--recompute-modules", "mlp"],
    "layernorm": ["--recompute-granularity", "selective", "--recompute-modules", "layernorm"],
    "all three": ["--recompute-granularity", "selective", "--recompute-modules", "core_attn",
                  "mlp", "layernorm"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--python", default=os.path.join(bench_memory.REPO, ".venv", "bin",
                                                         "python"))
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    args.initial_loss_scale = 4096.0
    baseline = bench_memory.baseline_rss_bytes(args.python) if args.device == "cpu" else 0
    print(f"GPT {args.layers}x{args.hidden}, {args.heads} heads, seq {args.seq}, micro-batch 1, "
          f"fp32, {args.device}; peak MiB above the import baseline")
    none = None
    for name, flags in CONFIGS.items():
        args.extra_flags = flags
        peak = bench_memory.run_config(args, "fp32", 1, False)[0] - baseline
        none = peak if none is None else none
        print(f"{name:>10}: {peak / MIB:7.0f} MiB  ({(none - peak) / MIB:+.0f} MiB saved)",
              flush=True)


if __name__ == "__main__":
    main()
