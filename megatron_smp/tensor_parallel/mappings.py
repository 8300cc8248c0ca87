"""Communication across the tensor-parallel group, as autograd functions.

Each function is paired with its conjugate in backward, so a parallel layer is a few
matrix products between two of these calls:

    forward                       backward
    copy (identity)          <->  all-reduce
    reduce (all-reduce)      <->  identity
    scatter (split last dim) <->  all-gather last dim
    gather (last dim)        <->  split last dim
    scatter to SP (split d0) <->  all-gather d0
    gather from SP (d0)      <->  reduce-scatter d0 (or split d0)
    reduce-scatter to SP     <->  all-gather d0
    all-to-all d0 (splits)   <->  all-to-all d0 (splits swapped)

Every function is the identity (no collective at all) when the group has one rank. The
group is passed explicitly; `None` means the default (world) group.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

ProcessGroup = Optional[dist.ProcessGroup]

# torch >= 2.13 renamed the single-tensor collectives and warns on the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: ProcessGroup) -> int:
    """Number of ranks in `group`; 1 when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup) -> int:
    """This process's rank inside `group`; 0 when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


# Primitive collectives (no autograd). ---------------------------------------------------------


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    # all_reduce works in place: never modify a tensor autograd may have saved.
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
    return x


def _split_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[-1] % world != 0:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by the group size {world}")
    chunk = x.shape[-1] // world
    return x.narrow(-1, group_rank(group) * chunk, chunk).contiguous()


def _gather_last_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    # gloo's all_gather_into_tensor needs the ranks concatenated along dim 0, so gather the
    # last dim moved to the front, then move it back.
    moved = x.movedim(-1, 0).contiguous()
    out = torch.empty((world * moved.shape[0],) + moved.shape[1:], dtype=x.dtype, device=x.device)
    _all_gather_single(out, moved, group=group)
    return out.movedim(0, -1).contiguous()


def _split_first_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[0] % world != 0:
        raise ValueError(f"first dim {x.shape[0]} is not divisible by the group size {world}")
    chunk = x.shape[0] // world
    return x.narrow(0, group_rank(group) * chunk, chunk).contiguous()


def _gather_first_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    out = torch.empty((world * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return out


def _reduce_scatter_first_dim(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[0] % world != 0:
        raise ValueError(f"first dim {x.shape[0]} is not divisible by the group size {world}")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // world,) + x.shape[1:], dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, group=group)
    return out


def _all_to_all_first_dim(x: torch.Tensor, group: ProcessGroup, output_splits=None,
                          input_splits=None) -> torch.Tensor:
    """all_to_all_single along dim 0: rows `input_splits[j]` go to rank j, and `output_splits[i]`
    rows arrive from rank i (None: even splits, x.shape[0] / group size each)."""
    x = x.contiguous()
    if output_splits is None:
        # Not empty_like(x) of a permuted view: it would keep the permuted strides.
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=output_splits,
                           input_split_sizes=input_splits, group=group)
    return out


# Autograd functions. ---------------------------------------------------------------------------


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim(grad, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        # When the consumer of the gathered tensor is itself tensor-parallel (a column linear),
        # each rank holds a partial gradient of the whole sequence: sum them and keep this
        # rank's shard. When the consumer is replicated, every rank already has the full
        # gradient and only needs its shard.
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first_dim(grad, ctx.group), None, None
        return _split_first_dim(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim(grad, ctx.group), None


# Public API. -----------------------------------------------------------------------------------


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Identity in forward, all-reduce of the gradient in backward. Any shape."""
    if group_size(group) == 1:
        return x
    return _CopyToModelParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-reduce (sum) in forward, identity in backward. Any shape."""
    if group_size(group) == 1:
        return x
    return _ReduceFromModelParallelRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Keep this rank's chunk of the last dim: [..., h] -> [..., h/tp]; backward all-gathers."""
    if group_size(group) == 1:
        return x
    return _ScatterToModelParallelRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather the last dim: [..., h/tp] -> [..., h]; backward keeps this rank's chunk."""
    if group_size(group) == 1:
        return x
    return _GatherFromModelParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Keep this rank's chunk of dim 0: [s, b, h] -> [s/tp, b, h]; backward all-gathers."""
    if group_size(group) == 1:
        return x
    return _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """All-gather dim 0: [s/tp, b, h] -> [s, b, h].

    Backward reduce-scatters the gradient when the output feeds a tensor-parallel consumer
    (`tensor_parallel_output_grad=True`, the gradients are partial sums), otherwise it only
    keeps this rank's chunk.
    """
    if group_size(group) == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup
) -> torch.Tensor:
    """Sum over ranks and keep this rank's chunk of dim 0: [s, b, h] -> [s/tp, b, h];
    backward all-gathers dim 0."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group = group
        ctx.splits = (output_splits, input_splits)
        return _all_to_all_first_dim(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all_first_dim(grad, ctx.group, input_splits, output_splits), None, None, None


def all_to_all(x: torch.Tensor, group: ProcessGroup, output_splits=None,
               input_splits=None) -> torch.Tensor:
    """Differentiable all-to-all along dim 0 (even, or uneven with the row splits); backward
    sends the gradients back with the splits swapped. x [sum(input_splits), ...] ->
    [sum(output_splits), ...]."""
    return _AllToAll.apply(x, group, output_splits, input_splits)


__all__ = [
    "all_to_all",
    "group_size",
    "group_rank",
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
]
