"""MoE layer timings on this machine (CPU, fp32, one thread per process).

1. Forward + backward of our `MoELayer` (one process, EP=1) against transformers'
   `MixtralSparseMoeBlock` holding the same weights (outputs checked equal first), with the
   per-expert matmul loop and with `--moe-grouped-gemm` (torch._grouped_mm).
2. allgather vs alltoall token dispatch at EP=2 and EP=4 (one rank per process, gloo).

    python tools/bench/bench_moe.py [--tokens 2048] [--hidden 256] [--ffn 512] [--experts 8]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _config(args, **overrides):
    from megatron_smp.models.llama import llama_config

    settings = dict(num_moe_experts=args.experts, moe_router_topk=args.topk,
                    moe_ffn_hidden_size=args.ffn, ffn_hidden_size=args.ffn)
    settings.update(overrides)
    return llama_config(num_layers=1, hidden_size=args.hidden, num_attention_heads=4,
                        vocab_size=128, **settings)


def _time_steps(step, iters: int) -> float:
    """Median seconds of `step()` over `iters` runs after two warm-up runs."""
    for _ in range(2):
        step()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def single_process(rank, world_size, args) -> dict:
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from megatron_smp.config import ParallelConfig
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.transformer.moe import MoELayer

    state = build_parallel_state(ParallelConfig())
    hf = MixtralSparseMoeBlock(MixtralConfig(
        hidden_size=args.hidden, intermediate_size=args.ffn, num_local_experts=args.experts,
        num_experts_per_tok=args.topk))
    for param in hf.parameters():
        torch.nn.init.normal_(param, std=0.02)
    results = {}
    tokens = torch.randn(1, args.tokens, args.hidden)
    for name, grouped in (("loop", False), ("grouped_gemm", True)):
        torch.manual_seed(0)
        ours = MoELayer(_config(args, moe_grouped_gemm=grouped), state)
        with torch.no_grad():
            ours.router.weight.copy_(hf.gate.weight)
            for index, expert in enumerate(ours.experts.local_experts):
                expert.linear_fc1.weight.copy_(hf.experts.gate_up_proj[index])
                expert.linear_fc2.weight.copy_(hf.experts.down_proj[index])
        ours_input = tokens.transpose(0, 1).contiguous()  # [s, b, h]
        with torch.no_grad():
            difference = (ours(ours_input).transpose(0, 1) - hf(tokens)).abs().max().item()

        def ours_step():
            x = ours_input.clone().requires_grad_()
            ours(x).sum().backward()

        results[name] = (_time_steps(ours_step, args.iters), difference)

    def hf_step():
        x = tokens.clone().requires_grad_()
        hf(x).sum().backward()

    results["hf"] = (_time_steps(hf_step, args.iters), 0.0)
    return results


def _dispatch_worker(rank, world_size, args, dispatcher):
    import torch

    from megatron_smp.config import ParallelConfig
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.transformer.moe import MoELayer

    state = build_parallel_state(ParallelConfig(expert_model_parallel_size=world_size))
    torch.manual_seed(0)
    layer = MoELayer(_config(args, moe_token_dispatcher_type=dispatcher), state)
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randn(args.tokens, 1, args.hidden, generator=generator)

    def step():
        x = tokens.clone().requires_grad_()
        layer(x).sum().backward()

    return _time_steps(step, args.iters)


def main(argv=None) -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per process")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--ep-sizes", type=int, nargs="*", default=[2, 4])
    args = parser.parse_args(argv)
    from megatron_smp.testing import run_distributed

    shape = (f"{args.tokens} tokens, hidden {args.hidden}, ffn {args.ffn}, {args.experts} "
             f"experts, top-{args.topk}, fp32, 1 thread")
    print(f"MoE layer forward+backward, one process ({shape}), median of {args.iters}:")
    results = run_distributed(single_process, 1, args=(args,), timeout=900)[0]
    hf_time = results["hf"][0]
    print(f"  transformers MixtralSparseMoeBlock  {hf_time * 1e3:8.1f} ms")
    for name in ("loop", "grouped_gemm"):
        seconds, difference = results[name]
        print(f"  megatron_smp MoELayer ({name:12s}) {seconds * 1e3:8.1f} ms  "
              f"({seconds / hf_time:.2f}x HF; max |output diff| {difference:.1e})")
    print(f"Token dispatch, forward+backward per rank ({args.tokens} tokens per rank):")
    for ep in args.ep_sizes:
        line = f"  EP={ep}:"
        for dispatcher in ("allgather", "alltoall"):
            times = run_distributed(_dispatch_worker, ep, args=(args, dispatcher), timeout=900)
            line += f"  {dispatcher} {max(times) * 1e3:8.1f} ms"
        print(line)


if __name__ == "__main__":
    main()
