"""Context parallelism: peak activation memory per rank and step time, per comm type.

A tiny Llama-style GPTModel (RoPE, RMSNorm, SwiGLU, GQA) at one long sequence, one
forward + backward of the loss per step, on gloo processes (`run_distributed`), at CP=1
(`DotProductAttention`, SDPA) and CP=2/4 for p2p / all_gather / a2a.

Memory is measured, not summed from tensor sizes: each rank makes glibc return every freed
block of >= 128 KiB to the OS (mallopt), runs one warm-up step, resets its peak RSS
(`/proc/self/clear_refs`), and reports VmHWM minus the VmRSS just before the measured step.
Weights, grads and the allocator's caches are in the baseline, so the figure is what the
step's activations and communication buffers add. On CUDA the same figure comes from
`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`.

`torch.distributed.tensor.experimental.context_parallel` is tried on the same shape (its
ring attention replaces SDPA inside the context); the script prints whether it runs here.

    python tools/bench/bench_context_parallel.py                       # seq 8192, CP 1/2/4
    python tools/bench/bench_context_parallel.py --seq-length 4096 --cp-sizes 1 2 --json out.json
    python tools/bench/bench_context_parallel.py --cp-sizes 1 2 --block-kernels auto math

p2p and all_gather attend block by block on aten's fused flash-attention op where it applies
(`fused_blocks_supported`; "vs a2a" is the step time over a2a's at the same CP size);
`--block-kernels math` also runs them on the tiled math fallback.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megatron_smp.testing import proc_status_kib  # noqa: E402

MIB = 1024 * 1024


def _model_config(args, comm_type):
    import torch

    from megatron_smp.config import TransformerConfig

    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_heads, num_query_groups=args.num_query_groups,
        ffn_hidden_size=2 * args.hidden_size, vocab_size=args.vocab_size,
        max_position_embeddings=args.seq_length, normalization="RMSNorm", activation="silu",
        gated_linear_unit=True, position_embedding_type="rope", add_bias_linear=False,
        untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
        cp_comm_type=comm_type, params_dtype=torch.float32,
    )


def _return_freed_memory_to_os() -> None:
    import ctypes

    from megatron_smp.distributed.param_and_grad_buffer import map_large_host_allocations

    map_large_host_allocations(128 * 1024)
    m_trim_threshold = -1
    ctypes.CDLL("libc.so.6").mallopt(m_trim_threshold, 128 * 1024)


class _Peak:
    """Peak bytes above the level at `start()`: RSS on CPU, the allocator on CUDA."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        import gc

        import torch

        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.base = proc_status_kib("VmRSS") * 1024

    def stop(self) -> int:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return proc_status_kib("VmHWM") * 1024 - self.base


def _bench_rank(rank, world_size, args, comm_type, block_kernel="auto"):
    import torch

    from megatron_smp.context_parallel import attention

    attention.BLOCK_KERNEL = block_kernel  # p2p / all_gather blocks: fused kernel or math

    from megatron_smp.config import ParallelConfig
    from megatron_smp.context_parallel import (
        get_batch_on_this_cp_rank, masked_mean_over_context_parallel,
    )
    from megatron_smp.models.gpt import GPTModel
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.tensor_parallel.random import model_parallel_seed

    _return_freed_memory_to_os()
    state = build_parallel_state(ParallelConfig(context_parallel_size=world_size))
    model_parallel_seed(1234, state)
    model = GPTModel(_model_config(args, comm_type), state).to(state.device)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length),
                           generator=generator)
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1),
             "loss_mask": torch.ones(tokens.shape)}
    batch = {k: v.to(state.device) for k, v in get_batch_on_this_cp_rank(
        batch, state.cp_size, state.cp_rank).items()}
    cp_group = state.cp_group if state.cp_size > 1 else None

    def step():
        losses = model(batch["tokens"], labels=batch["labels"])
        loss, report = masked_mean_over_context_parallel(losses, batch["loss_mask"], cp_group)
        loss.backward()
        return float(report)

    loss = step()  # warm-up: grads allocated, lazy kernels loaded
    peak = _Peak(state.device)
    peak.start()
    step()
    activation_bytes = peak.stop()
    times = []
    for _ in range(args.steps):
        torch.distributed.barrier()
        start = time.perf_counter()
        step()
        if state.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"loss": loss, "activation_mib": activation_bytes / MIB,
            "step_ms": 1000 * statistics.median(times)}


def _torch_context_parallel_rank(rank, world_size, args):
    """The same model's attention under torch's experimental context_parallel: does it run?"""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (world_size,))
    heads, head_dim = args.num_heads, args.hidden_size // args.num_heads
    qkv = torch.nn.Linear(args.hidden_size, 3 * args.hidden_size, device=device)
    x = torch.randn(args.micro_batch_size, args.seq_length, args.hidden_size, device=device)

    def attention(hidden):
        b, s, _ = hidden.shape
        q, k, v = qkv(hidden).view(b, s, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    try:
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            start = time.perf_counter()
            attention(x).sum().backward()
            return {"runs": True, "attention_step_ms": 1000 * (time.perf_counter() - start)}
    except Exception as error:  # report why, whatever torch raises
        return {"runs": False, "error": f"{type(error).__name__}: {error}"[:300]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--comm-types", nargs="+", default=["p2p", "all_gather", "a2a"])
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-query-groups", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--block-kernels", nargs="+", default=["auto"], choices=["auto", "math"],
                        help="p2p / all_gather block kernels to run: auto (aten's fused "
                        "flash-attention op where supported) and/or math (the fallback)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    from megatron_smp.testing import run_distributed

    results = {"shape": vars(args).copy(), "runs": []}
    for cp in args.cp_sizes:
        runs = [("p2p", "auto")] if cp == 1 else [
            (comm_type, kernel) for comm_type in args.comm_types
            for kernel in (args.block_kernels if comm_type != "a2a" else ["auto"])]
        for comm_type, kernel in runs:
            ranks = run_distributed(_bench_rank, cp, args=(args, comm_type, kernel),
                                    timeout=1800, collective_timeout=600)
            label = comm_type if kernel == "auto" else f"{comm_type}/{kernel}"
            row = {
                "cp": cp, "comm_type": "-" if cp == 1 else label,
                "loss": ranks[0]["loss"],
                "activation_mib_max_rank": max(r["activation_mib"] for r in ranks),
                "step_ms": max(r["step_ms"] for r in ranks),
            }
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
    baseline = results["runs"][0]["activation_mib_max_rank"]
    print(f"\nseq {args.seq_length}, {args.num_layers} layers x hidden {args.hidden_size}, "
          f"{args.num_heads} heads / {args.num_query_groups} groups, mb "
          f"{args.micro_batch_size}, fp32")
    print(f"{'cp':>3} {'comm':>14} {'act MiB/rank':>13} {'vs CP=1':>8} {'goal 1/N+10%':>12} "
          f"{'step ms':>9} {'vs a2a':>7} {'loss':>9}")
    a2a_ms = {row["cp"]: row["step_ms"] for row in results["runs"] if row["comm_type"] == "a2a"}
    for row in results["runs"]:
        ratio = row["activation_mib_max_rank"] / baseline
        goal = 1 / row["cp"] + 0.10
        vs_a2a = (f"{row['step_ms'] / a2a_ms[row['cp']]:>7.2f}" if row["cp"] in a2a_ms
                  else f"{'-':>7}")
        print(f"{row['cp']:>3} {row['comm_type']:>14} {row['activation_mib_max_rank']:>13.1f} "
              f"{ratio:>8.3f} {goal:>12.3f} {row['step_ms']:>9.1f} {vs_a2a} "
              f"{row['loss']:>9.5f}")
    if max(args.cp_sizes) > 1:
        cp = max(args.cp_sizes)
        torch_cp = run_distributed(_torch_context_parallel_rank, cp, args=(args,), timeout=900)
        results["torch_context_parallel"] = torch_cp[0]
        print(f"\ntorch.distributed.tensor.experimental.context_parallel at CP={cp}: "
              f"{json.dumps(torch_cp[0])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
