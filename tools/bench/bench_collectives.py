"""Collective latency on this backend: all-reduce, reduce-scatter, all-gather, and a
reduce-scatter done as all-reduce + slice (what the distributed optimizer uses on gloo).

    python tools/bench/bench_collectives.py --world-sizes 2 4 --numel 4242944
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_smp.testing import run_distributed  # noqa: E402

OPERATIONS = ("all_reduce", "reduce_scatter", "all_gather", "reduce_scatter_by_all_reduce")


def _measure(rank, world_size, numel, repeats):
    import torch
    import torch.distributed as dist

    from megatron_smp.tensor_parallel.mappings import (
        _all_gather_single as all_gather,
        _reduce_scatter_single as reduce_scatter,
    )
    numel = numel // world_size * world_size
    full = torch.randn(numel)
    shard = torch.empty(numel // world_size)
    own = slice(rank * shard.numel(), (rank + 1) * shard.numel())
    run = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: reduce_scatter(shard, full),
        "all_gather": lambda: all_gather(full, shard),
        "reduce_scatter_by_all_reduce": lambda: (dist.all_reduce(full), shard.copy_(full[own])),
    }
    medians = {}
    for name in OPERATIONS:
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            run[name]()
            times.append(time.perf_counter() - start)
        medians[name] = 1000 * statistics.median(times)
    return medians


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--numel", type=int, default=4_242_944, help="fp32 elements")
    parser.add_argument("--repeats", type=int, default=9)
    options = parser.parse_args(argv)
    print(f"{options.numel * 4 / 2**20:.1f} MB fp32, median ms, max over ranks")
    for world_size in options.world_sizes:
        per_rank = run_distributed(_measure, world_size, args=(options.numel, options.repeats),
                                   timeout=600)
        row = "  ".join(f"{name} {max(r[name] for r in per_rank):7.1f}" for name in OPERATIONS)
        print(f"world {world_size}: {row}")


if __name__ == "__main__":
    main()
