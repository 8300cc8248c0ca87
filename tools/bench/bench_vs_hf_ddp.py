"""Our training step at DP=2 beside Hugging Face GPT-2 under torch DDP, same shape, alternating.

    python tools/bench/bench_vs_hf_ddp.py                       # 4 layers x 256, seq 128, mb 4
    python tools/bench/bench_vs_hf_ddp.py --rounds 5 --iters 20 --json
    python tools/bench/bench_vs_hf_ddp.py --variant no_nan_check=--no-check-for-nan-in-loss-and-grad

Both sides run in the same `--world-size` gloo processes (one thread each), one after the other,
`--rounds` times, so machine noise hits them alike:

  ours   `pretrain(...)` of pretrain_gpt.py (our GPTModel, our DDP with bucketed all-reduce,
         Megatron's optimizer wrapper around torch's AdamW, grad clipping 1.0) with its default
         checks on: --check-for-nan-in-loss-and-grad, the logged-loss reduction over the
         data-parallel ranks every step. Mock data through our data loader.
  HF     `GPT2LMHeadModel` (sdpa attention) in `torch.nn.parallel.DistributedDataParallel`,
         torch's AdamW (fused on CPU where torch has it, as ours), clip_grad_norm_(1.0), the
         summed loss read on the host at the log interval (as our log line reads it).

Same shape on both: layers, hidden, heads, seq, micro-batch, vocab (a multiple of 128, so our
vocabulary is not padded), tied embeddings, learned positions, dropout `--dropout` on both.
One micro-batch per rank per step (global batch = micro-batch x world size).

A step's time is the wall time from the start of one iteration to the start of the next, on
each rank; the first `--warmup` iterations of every run are dropped; the per-run figure is the
median over iterations of the maximum over ranks, and the report gives the median over rounds
and the spread (min..max), and the median of the per-round ratios (each round's runs were
back to back). For ours it also counts the collectives issued per steady-state
iteration (torch.distributed calls, by name). The CPU time of the process per step
(time.process_time, every thread) is reported beside the wall time: on a shared machine it
moves less with the other jobs' load. `--variant NAME=FLAGS` adds runs of ours with extra
flags (e.g. with --exit-signal-handler, or with the NaN check off), alternated too.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron_smp.testing import run_distributed  # noqa: E402

# torch.distributed calls counted per iteration (the ones our training code issues; isend and
# irecv are left alone: P2POp checks that its op *is* dist.isend / dist.irecv).
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "reduce_scatter_tensor", "all_to_all_single", "barrier", "send", "recv",
               "batch_isend_irecv")


def _ours_argv(shape: dict, iterations: int, world_size: int, extra) -> list:
    return [
        "--num-layers", str(shape["layers"]), "--hidden-size", str(shape["hidden"]),
        "--num-attention-heads", str(shape["heads"]), "--seq-length", str(shape["seq"]),
        "--max-position-embeddings", str(shape["seq"]),
        "--micro-batch-size", str(shape["micro_batch"]),
        "--global-batch-size", str(shape["micro_batch"] * world_size),
        "--train-iters", str(iterations), "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(shape["vocab"] - 1),  # NullTokenizer adds the EOD id
        "--hidden-dropout", str(shape["dropout"]), "--attention-dropout", str(shape["dropout"]),
        "--lr", "1e-4", "--min-lr", "1e-4", "--clip-grad", "1.0", "--weight-decay", "0.01",
        "--log-interval", str(shape["log_interval"]), "--eval-interval", "100000",
        "--eval-iters", "0", "--seed", "1234",
    ] + list(extra)


class _CountCollectives:
    """Counts torch.distributed calls by name while active (module attributes are patched,
    which is how our code calls them: `dist.all_reduce(...)`)."""

    def __init__(self):
        self.counts: dict = {}
        self._saved: dict = {}

    def __enter__(self):
        import torch.distributed as dist

        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original

            def counted(*args, _name=name, _original=original, **kwargs):
                self.counts[_name] = self.counts.get(_name, 0) + 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, original in self._saved.items():
            setattr(dist, name, original)
        return False


def _run_ours(argv: list) -> dict:
    """One pretrain(...) run; per-iteration start times and collective counts."""
    import importlib

    import pretrain_gpt

    # The module (megatron_smp.training's `pretrain` attribute is the function).
    pretrain_module = importlib.import_module("megatron_smp.training.pretrain")

    starts, cpu_starts, counts = [], [], []
    original = pretrain_module.Trainer.train_step
    counter = _CountCollectives()

    def timed_train_step(*args, **kwargs):
        starts.append(time.perf_counter())
        cpu_starts.append(time.process_time())
        counts.append(dict(counter.counts))
        return original(*args, **kwargs)

    pretrain_module.Trainer.train_step = timed_train_step
    try:
        with counter, contextlib.redirect_stdout(io.StringIO()):
            result = pretrain_module.pretrain(
                pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                pretrain_gpt.forward_step, argv=argv,
                args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    finally:
        pretrain_module.Trainer.train_step = original
    per_iteration = []
    for before, after in zip(counts, counts[1:]):
        per_iteration.append({k: after.get(k, 0) - before.get(k, 0) for k in after
                              if after.get(k, 0) != before.get(k, 0)})
    losses = [result.train_losses[i]["lm loss"] for i in sorted(result.train_losses)]
    return {"step_s": [b - a for a, b in zip(starts, starts[1:])],
            "cpu_s": [b - a for a, b in zip(cpu_starts, cpu_starts[1:])],
            "collectives": per_iteration, "losses": losses}


def _build_hf(shape: dict):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=shape["vocab"], n_positions=shape["seq"], n_embd=shape["hidden"],
        n_layer=shape["layers"], n_head=shape["heads"], resid_pdrop=shape["dropout"],
        embd_pdrop=shape["dropout"], attn_pdrop=shape["dropout"], bos_token_id=0,
        eos_token_id=0)
    torch.manual_seed(1234)
    return GPT2LMHeadModel._from_config(config, attn_implementation="sdpa").train()


def _run_hf(model, shape: dict, iterations: int, rank: int) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from megatron_smp.optimizer import _fused_supported

    ddp = DistributedDataParallel(model)
    fused = _fused_supported(torch.device("cpu"))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4, weight_decay=0.01,
                                  **({"fused": True} if fused else {"foreach": True}))
    generator = torch.Generator().manual_seed(rank)
    vocab, seq, batch = shape["vocab"], shape["seq"], shape["micro_batch"]
    starts, cpu_starts, loss_sum, losses = [], [], None, []
    for iteration in range(1, iterations + 1):
        starts.append(time.perf_counter())
        cpu_starts.append(time.process_time())
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        optimizer.zero_grad(set_to_none=True)
        logits = ddp(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        optimizer.step()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        if iteration % shape["log_interval"] == 0:
            losses.append(float(loss_sum) / shape["log_interval"])
            loss_sum = None
    starts.append(time.perf_counter())
    cpu_starts.append(time.process_time())
    return {"step_s": [b - a for a, b in zip(starts, starts[1:])],
            "cpu_s": [b - a for a, b in zip(cpu_starts, cpu_starts[1:])], "losses": losses}


def _body(rank, world_size, shape, iterations, rounds, variants):
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    sys.path.insert(0, ROOT)  # pretrain_gpt
    runs = []
    hf_model = None
    for round_index in range(rounds):
        # Alternate which side goes first, so neither always follows the other.
        order = ["hf"] + list(variants) if round_index % 2 else list(variants) + ["hf"]
        for name in order:
            dist.barrier()
            if name == "hf":
                hf_model = _build_hf(shape)
                record = _run_hf(hf_model, shape, iterations, rank)
            else:
                record = _run_ours(_ours_argv(shape, iterations, world_size, variants[name]))
            record.update(name=name, round=round_index)
            runs.append(record)
    return runs


def _summary(results, warmup: int) -> dict:
    by_name: dict = {}
    rounds = len(results[0])
    for index in range(rounds):
        name = results[0][index]["name"]
        per_rank = [r[index]["step_s"][warmup:] for r in results]
        steps = [max(values) for values in zip(*per_rank)]
        cpu = [max(values) for values in zip(*[r[index]["cpu_s"][warmup:] for r in results])]
        entry = by_name.setdefault(name, {"run_medians_ms": [], "cpu_run_medians_ms": [],
                                          "collectives": None})
        entry["run_medians_ms"].append(statistics.median(steps) * 1e3)
        entry["cpu_run_medians_ms"].append(statistics.median(cpu) * 1e3)
        if "collectives" in results[0][index]:
            # A steady-state iteration's collectives (the same on every steady iteration).
            steady = results[0][index]["collectives"][warmup:]
            entry["collectives"] = steady[len(steady) // 2] if steady else {}
            entry["collectives_all_same"] = all(c == steady[0] for c in steady)
        entry["losses"] = results[-1][index]["losses"]
    for entry in by_name.values():
        medians = entry["run_medians_ms"]
        entry.update(median_ms=statistics.median(medians), min_ms=min(medians),
                     max_ms=max(medians),
                     cpu_median_ms=statistics.median(entry["cpu_run_medians_ms"]),
                     cpu_min_ms=min(entry["cpu_run_medians_ms"]),
                     cpu_max_ms=max(entry["cpu_run_medians_ms"]))
    return by_name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192,
                        help="a multiple of 128 (our vocabulary is then not padded)")
    parser.add_argument("--dropout", type=float, default=0.1, help="on both (their defaults)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iters", type=int, default=15, help="iterations per run")
    parser.add_argument("--warmup", type=int, default=3, help="iterations dropped per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--log-interval", type=int, default=5)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="another run of ours with extra flags (repeatable)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.vocab % 128:
        parser.error(f"--vocab must be a multiple of 128, got {args.vocab}")
    if args.iters <= args.warmup + 1:
        parser.error("--iters must exceed --warmup + 1")
    shape = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                 micro_batch=args.micro_batch, vocab=args.vocab, dropout=args.dropout,
                 log_interval=args.log_interval)
    variants = {"ours": []}
    for spec in args.variant:
        name, _, flags = spec.partition("=")
        if not name or name in variants or name == "hf":
            parser.error(f"--variant needs a new NAME=FLAGS, got {spec!r}")
        variants[name] = flags.split()
    results = run_distributed(_body, args.world_size,
                              args=(shape, args.iters, args.rounds, variants),
                              timeout=3600, collective_timeout=600)
    summary = _summary(results, args.warmup)
    summary["ratio_ours_over_hf"] = summary["ours"]["median_ms"] / summary["hf"]["median_ms"]
    # Each round's ours and HF ran back to back: the median of the per-round ratios is the
    # figure least moved by load that changes between rounds.
    for kind, key in (("wall", "run_medians_ms"), ("cpu", "cpu_run_medians_ms")):
        ratios = [a / b for a, b in zip(summary["ours"][key], summary["hf"][key])]
        summary[f"paired_{kind}_ratios"] = ratios
        summary[f"paired_{kind}_ratio"] = statistics.median(ratios)
    if args.json:
        print(json.dumps({"shape": shape, "world_size": args.world_size, **summary}, indent=1))
        return
    print(f"DP={args.world_size}, {args.layers} layers x {args.hidden} (heads {args.heads}), "
          f"seq {args.seq}, micro-batch {args.micro_batch}, vocab {args.vocab}, dropout "
          f"{args.dropout}; {args.rounds} alternating rounds of {args.iters} iterations "
          f"({args.warmup} dropped); step = max over ranks, median over iterations")
    for name in list(variants) + ["hf"]:
        entry = summary[name]
        runs = ", ".join(f"{m:.1f}" for m in entry["run_medians_ms"])
        print(f"  {name:18s} median {entry['median_ms']:7.1f} ms/step  spread "
              f"{entry['min_ms']:.1f}..{entry['max_ms']:.1f}  (runs: {runs})")
        print(f"  {'':18s} CPU time {entry['cpu_median_ms']:7.1f} ms/step  spread "
              f"{entry['cpu_min_ms']:.1f}..{entry['cpu_max_ms']:.1f}")
        if entry.get("collectives") is not None:
            print(f"  {'':18s} collectives per step: {entry['collectives']}"
                  + ("" if entry.get("collectives_all_same") else " (varies)"))
    print(f"  ours / HF = {summary['ratio_ours_over_hf']:.3f} (wall), "
          f"{summary['ours']['cpu_median_ms'] / summary['hf']['cpu_median_ms']:.3f} (CPU time)")
    for kind in ("wall", "cpu"):
        ratios = summary[f"paired_{kind}_ratios"]
        print(f"  ours / HF per round ({kind}): median {summary[f'paired_{kind}_ratio']:.3f}, "
              f"spread {min(ratios):.3f}..{max(ratios):.3f}")
    for name in variants:
        if name != "ours":
            print(f"  {name} / ours = "
                  f"{summary[name]['median_ms'] / summary['ours']['median_ms']:.3f}")


if __name__ == "__main__":
    main()
