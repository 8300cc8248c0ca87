"""Data-parallel step time and memory: megatron_smp vs torch DDP, DDP + ZeRO, FSDP2.

Every implementation trains the same plain-torch transformer (no megatron_smp model code)
with AdamW (torch's fused kernel where it exists, for all of them) and grad clipping, on
CPU gloo with one thread per rank. Each (implementation, DP size) runs in fresh processes
so the peak RSS (VmHWM from /proc/self/status) is its own. The machine is shared and noisy:
with --repeats R the implementations run interleaved R times and the fastest median counts.

Per rank it reports: median step time, peak RSS, and exact bytes of params, grads and
optimizer state (tensors actually held, local shards for the sharded ones).

    python tools/bench/bench_data_parallel.py                 # DP=2 and DP=4
    python tools/bench/bench_data_parallel.py --world-sizes 2 --steps 4 --json out.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_smp.testing import proc_status_kib, run_distributed  # noqa: E402

# megatron_smp: our DDP + DistributedOptimizer (reduce-scatter, sharded Adam, all-gather);
# megatron_smp_ddp: our DDP (bucketed all-reduce overlapped with backward) + full Adam.
OURS = ("megatron_smp", "megatron_smp_ddp")
IMPLEMENTATIONS = OURS + ("torch_ddp", "ddp_zero", "fsdp2")


def build_model(vocab: int, hidden: int, layers: int, seq: int):
    import torch

    class Transformer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, hidden)
            self.position = torch.nn.Parameter(torch.randn(seq, hidden) * 0.02)
            self.blocks = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(
                    hidden, nhead=max(1, hidden // 64), dim_feedforward=4 * hidden,
                    dropout=0.0, batch_first=True, norm_first=True,
                )
                for _ in range(layers)
            )
            self.norm = torch.nn.LayerNorm(hidden)
            self.head = torch.nn.Linear(hidden, vocab)

        def forward(self, tokens):
            h = self.embed(tokens) + self.position[: tokens.shape[1]]
            for block in self.blocks:
                h = block(h, is_causal=False)
            return self.head(self.norm(h))

    torch.manual_seed(0)
    return Transformer()


def _tensor_bytes(tensors) -> int:
    import torch

    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if torch.is_tensor(local):
            total += local.numel() * local.element_size()
    return total


def _optimizer_state_bytes(optimizer) -> int:
    return _tensor_bytes(
        value for per_param in optimizer.state.values() for key, value in per_param.items()
        if key != "step"
    )


def _status_mib(field: str) -> float:
    return proc_status_kib(field) / 1024.0


def _adamw(params, lr: float):
    import torch

    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=True), "fused"
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, foreach=True), "foreach"


def _bench(rank, world_size, impl, args):
    import warnings

    import torch
    import torch.distributed as dist

    from megatron_smp.config import OptimizerConfig, ParallelConfig

    # FSDP2 warns about a view output of the root module; nothing here modifies it in place.
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")

    # Library start-up costs the same for everyone: the first torch.optim optimizer alone
    # adds ~70 MB of RSS (lazy imports). Pay them before the baseline reading.
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.optim  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    import megatron_smp.distributed  # noqa: F401
    import megatron_smp.optimizer  # noqa: F401

    torch.optim.AdamW([torch.zeros(1)])
    baseline_rss_mb = _status_mib("VmRSS")
    from megatron_smp.parallel_state import build_parallel_state

    model = build_model(args["vocab"], args["hidden"], args["layers"], args["seq"])
    num_params = sum(p.numel() for p in model.parameters())
    lr, clip = 1e-3, 1.0
    generator = torch.Generator().manual_seed(1 + rank)

    if impl in OURS:
        from megatron_smp.distributed import DistributedDataParallel, finalize_model_grads
        from megatron_smp.optimizer import get_megatron_optimizer

        state = build_parallel_state(ParallelConfig())
        sharded = impl == "megatron_smp"
        config = OptimizerConfig(
            lr=lr, weight_decay=0.01, clip_grad=clip, use_distributed_optimizer=sharded,
            overlap_grad_reduce=True, overlap_param_gather=sharded,
            ddp_bucket_size=args["bucket_size"],
        )
        wrapped = DistributedDataParallel(model, config, state)
        optimizer = get_megatron_optimizer(config, [wrapped], state)
        adam_kind = type(optimizer.optimizer).__name__ + (
            "(fused)" if optimizer.optimizer.defaults.get("fused") else ""
        )

        def step(tokens):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(
                wrapped(tokens).flatten(0, 1), tokens.flatten()
            )
            loss.backward()
            finalize_model_grads([wrapped], state)
            optimizer.step()
            return loss

        def held_bytes():
            buffers = wrapped.param_and_grad_buffers
            return {
                "params": _tensor_bytes(b.param_data for b in buffers),
                "grads": _tensor_bytes(b.grad_data for b in buffers),
                "optimizer_state": _optimizer_state_bytes(optimizer.optimizer),
            }
    else:
        from torch.nn.parallel import DistributedDataParallel as TorchDDP

        if impl == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            wrapped = fully_shard(model)
        else:
            wrapped = TorchDDP(model, gradient_as_bucket_view=True)
        if impl == "ddp_zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            try:
                optimizer = ZeroRedundancyOptimizer(
                    model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr,
                    weight_decay=0.01, fused=True,
                )
                adam_kind = "ZeroRedundancyOptimizer(AdamW fused)"
            except (RuntimeError, ValueError, TypeError):
                optimizer = ZeroRedundancyOptimizer(
                    model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr,
                    weight_decay=0.01,
                )
                adam_kind = "ZeroRedundancyOptimizer(AdamW)"
        else:
            optimizer, kind = _adamw(model.parameters(), lr)
            adam_kind = f"AdamW({kind})"

        def step(tokens):
            optimizer.zero_grad(set_to_none=impl != "torch_ddp")
            loss = torch.nn.functional.cross_entropy(
                wrapped(tokens).flatten(0, 1), tokens.flatten()
            )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            return loss

        def held_bytes():
            params = list(model.parameters())
            return {
                "params": _tensor_bytes(params),
                "grads": _tensor_bytes(p.grad for p in params),
                "optimizer_state": _optimizer_state_bytes(
                    optimizer.optim if impl == "ddp_zero" else optimizer
                ),
            }

    times, cpu_times, losses = [], [], []
    for iteration in range(args["warmup"] + args["steps"]):
        tokens = torch.randint(0, args["vocab"], (args["micro_batch"], args["seq"]), generator=generator)
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        losses.append(step(tokens).item())
        cpu_time = time.process_time() - cpu_start  # all threads of this rank, before the barrier
        dist.barrier()
        if iteration >= args["warmup"]:
            times.append(time.perf_counter() - start)
            cpu_times.append(cpu_time)
    # Grads are still held after the last step (our buffers and DDP's bucket views keep
    # them; FSDP2/ZeRO hold .grad until the next zero_grad).
    measured = held_bytes()
    return {
        "step_ms": 1000 * statistics.median(times),
        "cpu_ms": 1000 * statistics.median(cpu_times),
        "peak_rss_mb": _status_mib("VmHWM"),
        "peak_above_baseline_mb": _status_mib("VmHWM") - baseline_rss_mb,
        "num_params": num_params,
        "first_loss": losses[0],
        "adam": adam_kind,
        **measured,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS),
                        choices=IMPLEMENTATIONS)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--bucket-size", type=int, default=1_000_000,
                        help="our --ddp-bucket-size (elements); torch DDP keeps its 25 MB")
    parser.add_argument("--repeats", type=int, default=2,
                        help="interleaved runs per configuration; the fastest is reported")
    parser.add_argument("--json", help="also write the results here")
    options = parser.parse_args(argv)
    args = {k: getattr(options, k) for k in (
        "steps", "warmup", "vocab", "hidden", "layers", "seq", "micro_batch", "bucket_size")}

    results = {}
    for repeat in range(options.repeats):
        for world_size in options.world_sizes:
            for impl in options.implementations:
                per_rank = run_distributed(_bench, world_size, args=(impl, args), timeout=900,
                                           collective_timeout=300)
                result = {
                    "step_ms": max(r["step_ms"] for r in per_rank),
                    "cpu_ms": max(r["cpu_ms"] for r in per_rank),
                    "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
                    "peak_above_baseline_mb": max(r["peak_above_baseline_mb"] for r in per_rank),
                    "params": max(r["params"] for r in per_rank),
                    "grads": max(r["grads"] for r in per_rank),
                    "optimizer_state": max(r["optimizer_state"] for r in per_rank),
                    "num_params": per_rank[0]["num_params"],
                    "first_loss": per_rank[0]["first_loss"],
                    "adam": per_rank[0]["adam"],
                }
                print(f"run {repeat} dp={world_size} {impl:13s} {result}", flush=True)
                best = results.get((impl, world_size))
                if best is None or result["step_ms"] < best["step_ms"]:
                    results[(impl, world_size)] = result

    print("\nper rank (max over ranks); bytes are exact tensor sizes, RSS is VmHWM, 'above "
          "base' is VmHWM minus VmRSS after imports")
    header = (f"{'dp':>3} {'implementation':16} {'step ms':>8} {'CPU ms':>7} {'peak RSS MB':>12} "
              f"{'above base':>10} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} "
              f"{'B/param':>8}")
    print(header)
    mb = 1024.0 ** 2
    for (impl, world_size), r in results.items():
        per_param = (r["params"] + r["grads"] + r["optimizer_state"]) / r["num_params"]
        print(f"{world_size:>3} {impl:16} {r['step_ms']:8.1f} {r['cpu_ms']:7.1f} "
              f"{r['peak_rss_mb']:12.1f} {r['peak_above_baseline_mb']:10.1f} "
              f"{r['params'] / mb:10.2f} {r['grads'] / mb:9.2f} "
              f"{r['optimizer_state'] / mb:9.2f} {per_param:8.2f}")
    print("\nratios of ours to each peer (time: <1 is faster; memory: <1 is smaller)")
    for world_size in options.world_sizes:
        for our_impl, impl in itertools.product(OURS, options.implementations):
            ours, peer = results.get((our_impl, world_size)), results.get((impl, world_size))
            if impl in OURS or ours is None or peer is None:
                continue
            print(f"  dp={world_size} {our_impl:16s} vs {impl:10s}"
                  f"  step time {ours['step_ms'] / peer['step_ms']:.2f}"
                  f"  CPU time {ours['cpu_ms'] / peer['cpu_ms']:.2f}"
                  f"  optimizer state {ours['optimizer_state'] / max(peer['optimizer_state'], 1):.2f}"
                  f"  peak RSS {ours['peak_rss_mb'] / peer['peak_rss_mb']:.2f}"
                  f"  peak RSS above baseline "
                  f"{ours['peak_above_baseline_mb'] / peer['peak_above_baseline_mb']:.2f}")
    if options.json:
        with open(options.json, "w") as out:
            json.dump({f"{impl}@dp{ws}": r for (impl, ws), r in results.items()}, out, indent=1)


if __name__ == "__main__":
    main()
