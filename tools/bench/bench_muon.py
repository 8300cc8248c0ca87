"""Step time of Muon against Adam at the same size and layout, and the Newton-Schulz share.

One process, the GPT model of `pretrain_gpt.py` (fp32 params), a training step (forward,
backward, optimizer step) on a random batch and the optimizer step alone, alternating the
optimizers each round so the machine's noise falls on all alike; medians are printed. Muon
runs with the bf16 iteration (`--muon-fp32-matmul-prec medium`, Megatron's default) and the
fp32 one (`high`); its scalar params (embeddings, norms, biases) take Adam either way.

    python tools/bench/bench_muon.py                      # 2 x 256, seq 256, micro-batch 4

Measured on this 2-core CPU host (2 x 256, 2.7M params, 2 threads, loaded machine): Adam's
optimizer step 62 ms; Muon's 667 ms with the fp32 iteration (533 ms of it Newton-Schulz) and
14.3 s with the bf16 one -- a CPU without bf16 matrix units runs bf16 matmuls far slower than
fp32, so on CPU give --muon-fp32-matmul-prec high.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_smp.config import OptimizerConfig, ParallelConfig, TransformerConfig  # noqa: E402
from megatron_smp.models.gpt import GPTModel  # noqa: E402
from megatron_smp.optimizer import get_megatron_optimizer  # noqa: E402
from megatron_smp.parallel_state import build_parallel_state  # noqa: E402

OPTIMIZERS = {
    "adam": dict(optimizer="adam"),
    "muon bf16 NS": dict(optimizer="muon", muon_fp32_matmul_prec="medium"),
    "muon fp32 NS": dict(optimizer="muon", muon_fp32_matmul_prec="high"),
}


def build(args, state, settings):
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden,
                               num_attention_heads=args.heads, vocab_size=args.vocab,
                               max_position_embeddings=args.seq, hidden_dropout=0.0,
                               attention_dropout=0.0)
    model = GPTModel(config, state)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-4, **settings), [model], state)
    return model, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    state = build_parallel_state(ParallelConfig())
    runs = {name: build(args, state, settings) for name, settings in OPTIMIZERS.items()}
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq))
    params = sum(p.numel() for p in next(iter(runs.values()))[0].parameters())
    times = {name: {"step": [], "optimizer": [], "ns": []} for name in runs}
    for round_index in range(args.rounds + 1):  # round 0 warms up (lazy state, allocator)
        for name, (model, optimizer) in runs.items():
            start = time.perf_counter()
            optimizer.zero_grad()
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), tokens.reshape(-1))
            loss.backward()
            before_step = time.perf_counter()
            optimizer.step()
            end = time.perf_counter()
            if round_index:
                times[name]["step"].append(end - start)
                times[name]["optimizer"].append(end - before_step)
                times[name]["ns"].append(getattr(optimizer.optimizer, "last_ns_seconds", 0.0))
    print(f"GPT {args.layers}x{args.hidden}, {args.heads} heads, vocab {args.vocab}, seq "
          f"{args.seq}, micro-batch {args.micro_batch}, {params / 1e6:.1f}M params, fp32, "
          f"{args.threads} threads; medians of {args.rounds} rounds (ms)")
    adam_step = statistics.median(times["adam"]["step"])
    for name, measured in times.items():
        step = statistics.median(measured["step"])
        optimizer_step = statistics.median(measured["optimizer"])
        ns = statistics.median(measured["ns"])
        print(f"{name:>13}: step {step * 1e3:8.1f} ({step / adam_step:4.2f}x adam)   "
              f"optimizer {optimizer_step * 1e3:7.1f}   Newton-Schulz {ns * 1e3:7.1f} "
              f"({ns / step * 100:4.1f}% of the step)", flush=True)


if __name__ == "__main__":
    main()
