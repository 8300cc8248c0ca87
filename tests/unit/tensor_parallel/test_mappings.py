"""Each mapping's forward and backward at TP=2 against the formula it implements."""
import torch
import torch.distributed as dist

from megatron_smp.testing import run_distributed
from megatron_smp.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)


def _tensor(seed, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _mappings_body(rank, world_size):
    group = dist.group.WORLD
    single_group, _ = dist.new_subgroups(group_size=1)
    full, shard = (4, 2, 6), (2, 2, 6)  # [s, b, h] and its half along s (or h, same size here)
    last_shard = (4, 2, 3)

    def rank_chunk(t, dim):
        return t.chunk(world_size, dim)[rank]

    # name -> (function, input shape, output shape, expected output(xs), expected grad(gs))
    # xs[r] / gs[r] are rank r's input / output grad; a replicated input uses xs[0] everywhere.
    cases = {
        "copy": (copy_to_tensor_model_parallel_region, full, full,
                 lambda xs: xs[rank], lambda gs: sum(gs)),
        "reduce": (reduce_from_tensor_model_parallel_region, full, full,
                   lambda xs: sum(xs), lambda gs: gs[rank]),
        "scatter_last": (scatter_to_tensor_model_parallel_region, full, last_shard,
                         lambda xs: rank_chunk(xs[rank], -1), lambda gs: torch.cat(gs, -1)),
        "gather_last": (gather_from_tensor_model_parallel_region, last_shard, full,
                        lambda xs: torch.cat(xs, -1), lambda gs: rank_chunk(gs[rank], -1)),
        "scatter_sp": (scatter_to_sequence_parallel_region, full, shard,
                       lambda xs: rank_chunk(xs[rank], 0), lambda gs: torch.cat(gs, 0)),
        "gather_sp": (gather_from_sequence_parallel_region, shard, full,
                      lambda xs: torch.cat(xs, 0), lambda gs: rank_chunk(sum(gs), 0)),
        "gather_sp_replicated_grad": (
            lambda x, g: gather_from_sequence_parallel_region(x, g, False), shard, full,
            lambda xs: torch.cat(xs, 0), lambda gs: rank_chunk(gs[rank], 0)),
        "reduce_scatter_sp": (reduce_scatter_to_sequence_parallel_region, full, shard,
                              lambda xs: rank_chunk(sum(xs), 0), lambda gs: torch.cat(gs, 0)),
    }
    diffs = {}
    for index, (name, (fn, in_shape, out_shape, expected_out, expected_grad)) in enumerate(
        cases.items()
    ):
        xs = [_tensor(100 * index + r, in_shape) for r in range(world_size)]
        gs = [_tensor(100 * index + 50 + r, out_shape) for r in range(world_size)]
        if name.startswith("scatter"):  # scatter takes a replicated input
            xs = [xs[0]] * world_size
        x = xs[rank].clone().requires_grad_(True)
        out = fn(x, group)
        out.backward(gs[rank])
        diffs[name] = max(
            (out - expected_out(xs)).abs().max().item(),
            (x.grad - expected_grad(gs)).abs().max().item(),
        )
        # One rank: the input itself, no collective and no autograd node.
        assert fn(x, single_group) is x, name
    return diffs


def test_mappings_tp2():
    for rank, diffs in enumerate(run_distributed(_mappings_body, 2)):
        assert len(diffs) == 8
        assert all(v < 1e-6 for v in diffs.values()), (rank, diffs)
