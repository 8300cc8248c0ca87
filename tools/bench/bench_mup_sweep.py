"""The muP property on a small sweep: the learning rate that trains best at the base width
stays best at 2x and 4x the width with --use-mup (--mup-base-hidden-size the base), while
under the standard parametrisation the best learning rate moves.

    python tools/bench/bench_mup_sweep.py                 # widths 64 128 256, Adam, 60 steps

Each run is `pretrain_gpt.py`'s loop in one process (--mock-data, fp32, constant LR after a
short warm-up); its figure is the mean lm loss of the last 10 iterations. Prints, per
parametrisation and width, the loss at each LR and the best LR.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def _argv(width: int, base: int, lr: float, mup: bool, steps: int, seed: int):
    argv = (f"--num-layers 2 --hidden-size {width} --num-attention-heads 4 "
            f"--seq-length 64 --max-position-embeddings 64 --micro-batch-size 8 "
            f"--global-batch-size 8 --train-iters {steps} --mock-data "
            f"--tokenizer-type NullTokenizer --vocab-size 512 --hidden-dropout 0 "
            f"--attention-dropout 0 --lr {lr} --min-lr {lr} --lr-decay-style constant "
            f"--lr-warmup-iters 5 --log-interval 1000 --eval-interval 100000 --eval-iters 0 "
            f"--untie-embeddings-and-output-weights --seed {seed}").split()
    if mup:
        argv += ["--use-mup", "--mup-base-hidden-size", str(base)]
    return argv


def _sweep(rank, world_size, runs):
    import pretrain_gpt
    from megatron_smp.training import pretrain

    out = []
    for argv in runs:
        result = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                          pretrain_gpt.model_provider, pretrain_gpt.forward_step, argv=argv)
        losses = [result.train_losses[i]["lm loss"] for i in sorted(result.train_losses)]
        out.append(sum(losses[-10:]) / len(losses[-10:]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--lrs", type=float, nargs="+",
                        default=[1e-3, 3e-3, 1e-2, 3e-2, 1e-1])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from megatron_smp.testing import run_distributed

    base = args.widths[0]
    runs, keys = [], []
    for mup in (True, False):
        for width in args.widths:
            for lr in args.lrs:
                runs.append(_argv(width, base, lr, mup, args.steps, args.seed))
                keys.append(("muP" if mup else "standard", width, lr))
    (losses,) = run_distributed(_sweep, 1, args=(runs,), timeout=3600)
    table = {}
    for (name, width, lr), loss in zip(keys, losses):
        table.setdefault(name, {}).setdefault(width, {})[lr] = loss
    for name, by_width in table.items():
        print(f"{name} (base width {base}): mean lm loss of the last 10 of {args.steps} steps")
        print("  width  " + "  ".join(f"lr {lr:<8g}" for lr in args.lrs) + "  best lr")
        for width, by_lr in by_width.items():
            best = min(by_lr, key=by_lr.get)
            print(f"  {width:5d}  " + "  ".join(f"{by_lr[lr]:<11.4f}" for lr in args.lrs)
                  + f"  {best:g}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({name: {str(w): {str(lr): v for lr, v in d.items()}
                              for w, d in by_width.items()} for name, by_width in table.items()},
                      handle, indent=1)


if __name__ == "__main__":
    main()
