"""Contiguous parameter and gradient buffers, split into buckets that are reduced as a unit.

All parameters of one (param dtype, grad dtype) pair live in one flat `param_data` tensor
and their gradients in one flat `grad_data` tensor (fp32 by default): `param.data` and
`param.main_grad` are views into them. Parameters are laid out in *reverse* registration
order, because backward produces the grads of the last layers first: the first bucket of
the buffer is the first one to become complete.

Buckets follow SMDDP's balanced fusion buffers: instead of filling a bucket up to
`--ddp-bucket-size` and leaving a small remainder, the buffer is cut into
ceil(total / bucket_size) buckets of nearly equal size, so every reduction moves about the
same number of bytes. Each bucket's end is padded so its length divides evenly over the
data-parallel ranks: rank i then owns the contiguous shard i of every bucket (what the
reduce-scatter of the distributed optimizer delivers and its all-gather collects).
"""
from __future__ import annotations

import ctypes
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_smp.tensor_parallel.mappings import _all_gather_single, _reduce_scatter_single


def release_freed_host_memory() -> None:
    """Return the free pages of the host heap to the OS (glibc only; elsewhere a no-op).

    Once a tensor of up to 32 MiB has been freed, glibc serves tensors of that size from its
    heap and keeps freed heap memory resident. Building a model leaves its init temporaries
    there, and moving the params into a buffer frees their old storage: together one to two
    copies of the params (400-800 MiB for a 105M fp32 model), resident for the whole run
    unless returned.
    """
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return
    malloc_trim(0)


# glibc's mallopt parameter number of M_MMAP_THRESHOLD (malloc.h).
_M_MMAP_THRESHOLD = -3


def map_large_host_allocations(threshold_bytes: int = 1 << 20) -> None:
    """Serve host allocations of at least `threshold_bytes` by mmap, so freeing one returns it
    to the OS at once (glibc only; elsewhere a no-op). Process-wide and permanent.

    FSDP2 allocates and frees every unit's all-gather output, unsharded grads and
    reduce-scatter buffers each step. glibc's default raises its mmap threshold to the
    largest size freed (up to 32 MiB), after which these buffers come from the heap, where
    freed blocks stay resident between longer-lived shards and activations. Measured at DP=2
    (8 layers, hidden 512, 42M fp32 params): peak RSS 666 -> 492 MiB above the baseline.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return
    mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes))


def pad_to_multiple(size: int, multiple: int) -> int:
    return int(math.ceil(size / multiple) * multiple)


def balanced_bucket_boundaries(
    numels: Sequence[int], bucket_size: Optional[int], own_bucket: Sequence[bool] = ()
) -> List[int]:
    """Indices (exclusive ends into `numels`) where buckets close.

    A parameter never spans two buckets. With `bucket_size=None` everything is one bucket.
    Otherwise ceil(total / bucket_size) targets of equal size are placed along the running
    sum and a bucket closes at the first parameter that reaches its target. Parameters
    flagged in `own_bucket` get a bucket to themselves.
    """
    own_bucket = list(own_bucket) or [False] * len(numels)
    total = sum(numels)
    target = None
    if bucket_size is not None and total > bucket_size:
        target = total / int(math.ceil(total / bucket_size))
    ends, running, next_target = [], 0, target
    for index, numel in enumerate(numels):
        if own_bucket[index] and index > 0 and (not ends or ends[-1] != index):
            ends.append(index)
        running += numel
        close = own_bucket[index]
        if next_target is not None and running >= next_target - 1e-9:
            close = True
            while next_target is not None and running >= next_target - 1e-9:
                next_target += target
        if close and index + 1 < len(numels):
            ends.append(index + 1)
    ends.append(len(numels))
    return ends


def layer_wise_shard_layout(
    numels: Sequence[int], world_size: int, loads: Optional[List[int]] = None
) -> Tuple[List[int], int]:
    """Whole params placed in `world_size` equal shards of one bucket, balanced by size.

    Largest first, each param goes to the rank holding the fewest elements so far (LPT) --
    counted over the buffer's earlier buckets too (`loads`, updated in place), so buckets of
    one large param each still spread over the ranks -- among the shards it fits into without
    growing this bucket past 1.3x an even split (padding); inside a shard params keep their
    order. Returns each param's start in the bucket and the shard size (the fullest shard's:
    the others are padded to it).
    """
    loads = [0] * world_size if loads is None else loads
    cap = max(max(numels, default=0), sum(numels) / world_size * 1.3)
    filled = [0] * world_size
    shard_of = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: -numels[i]):
        fitting = [r for r in range(world_size) if filled[r] + numels[index] <= cap]
        shard = min(fitting or range(world_size), key=lambda r: (loads[r], filled[r], r))
        shard_of[index] = shard
        filled[shard] += numels[index]
        loads[shard] += numels[index]
    shard_size = max(filled)
    cursors = [rank * shard_size for rank in range(world_size)]
    starts = []
    for index, numel in enumerate(numels):
        starts.append(cursors[shard_of[index]])
        cursors[shard_of[index]] += numel
    return starts, shard_size


class Bucket:
    """A slice of a `ParamAndGradBuffer` whose grads are reduced by one collective.

    `grad_data` / `param_data` are views of the bucket's (padded) range; their length is a
    multiple of the group size, so `shard(grad_data)` is this rank's contiguous 1/dp.
    """

    def __init__(
        self,
        index: int,
        params: List[torch.nn.Parameter],
        param_data: torch.Tensor,
        grad_data: torch.Tensor,
        offset: int,
        numel_unpadded: int,
        buffer: "ParamAndGradBuffer",
    ):
        self.index = index
        self.params = params
        self.param_data = param_data
        self.grad_data = grad_data
        self.offset = offset  # start of the bucket within its buffer
        self.numel_unpadded = numel_unpadded
        self.buffer = buffer
        self.params_with_grad: set = set()
        self.is_last_microbatch = True
        self.grad_reduce_handle = None
        self.param_gather_handle = None

    def shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous 1/dp of a bucket-sized tensor."""
        return tensor.view(self.buffer.data_parallel_world_size, -1)[
            self.buffer.data_parallel_rank
        ]

    def reset(self) -> None:
        self.params_with_grad = set()
        self.is_last_microbatch = True
        self.grad_reduce_handle = None

    # Gradients ------------------------------------------------------------------------------
    def start_grad_sync(self, async_op: bool) -> None:
        """Average the bucket's grads over the data-parallel group.

        All-reduce for plain data parallelism; reduce-scatter (rank i keeps shard i) for the
        distributed optimizer, whose other shards are then stale and must not be read.
        """
        if self.grad_reduce_handle is not None:
            raise RuntimeError(
                f"bucket {self.index} reduced twice in one step; call zero_grad_buffer() "
                "between steps"
            )
        buffer = self.buffer
        if buffer.grad_check is not None:  # --check-for-nan-in-loss-and-grad
            buffer.grad_check(self.grad_data)
        if buffer.gradient_scaling_factor != 1.0:
            self.grad_data.mul_(buffer.gradient_scaling_factor)
        op = dist.ReduceOp.AVG if buffer.average_in_collective else dist.ReduceOp.SUM
        if buffer.data_parallel_world_size == 1:
            self.grad_reduce_handle = _DONE
        elif buffer.use_distributed_optimizer and not buffer.reduce_scatter_by_all_reduce:
            handle = _reduce_scatter_single(
                self.shard(self.grad_data), self.grad_data, op=op,
                group=buffer.data_parallel_group, async_op=async_op,
            )
            self.grad_reduce_handle = handle if async_op else _DONE
        else:
            handle = dist.all_reduce(
                self.grad_data, op=op, group=buffer.data_parallel_group, async_op=async_op
            )
            self.grad_reduce_handle = handle if async_op else _DONE
        if buffer.inter_instance_group is not None:
            # --num-distributed-optimizer-instances: this rank's shard, reduced within its
            # instance, is then reduced across the instances (after the first completes).
            self.grad_reduce_handle.wait()
            handle = dist.all_reduce(self.shard(self.grad_data), op=op,
                                     group=buffer.inter_instance_group, async_op=async_op)
            self.grad_reduce_handle = handle if async_op else _DONE
        if buffer.on_grad_sync_start is not None:
            buffer.on_grad_sync_start(self)

    def finish_grad_sync(self) -> None:
        if self.grad_reduce_handle is None:
            missing = [
                self.buffer.param_names.get(p, "?") for p in self.params
                if p not in self.params_with_grad
            ]
            raise RuntimeError(
                f"with --overlap-grad-reduce, the reduction of bucket {self.index} was never "
                f"started: no grad arrived for {missing[:8]} ({len(missing)} params). Every "
                "parameter must take part in the loss on every rank; otherwise disable "
                "--overlap-grad-reduce."
            )
        self.grad_reduce_handle.wait()

    def register_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Called by the grad hook; launches the reduction once every grad has arrived."""
        if not self.is_last_microbatch:
            return
        if param in self.params_with_grad:
            raise RuntimeError(
                f"parameter {self.buffer.param_names.get(param, '?')} produced two grads in "
                "one backward pass, after its bucket was reduced; disable "
                "--overlap-grad-reduce for this model"
            )
        self.params_with_grad.add(param)
        if len(self.params_with_grad) == len(self.params):
            self.start_grad_sync(async_op=True)

    # Parameters ------------------------------------------------------------------------------
    def start_param_sync(self, async_op: bool) -> None:
        """Gather the updated shard of every rank into `param_data`, in place."""
        buffer = self.buffer
        if buffer.data_parallel_world_size == 1:
            return
        if buffer.param_gather_by_broadcast:
            shards = self.param_data.view(buffer.data_parallel_world_size, -1)
            handle = _Handles([
                dist.broadcast(
                    shards[rank], src=source, group=buffer.data_parallel_group, async_op=True
                )
                for rank, source in enumerate(buffer.data_parallel_global_ranks)
            ])
        else:
            handle = _all_gather_single(
                self.param_data, self.shard(self.param_data),
                group=buffer.data_parallel_group, async_op=True,
            )
        if async_op:
            self.param_gather_handle = handle
        else:
            handle.wait()

    def finish_param_sync(self) -> None:
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None


class _Done:
    """Stands in for the handle of a collective that already completed."""

    def wait(self) -> None:
        return None


_DONE = _Done()


class _Handles:
    """One handle for several collectives in flight."""

    def __init__(self, handles: List):
        self.handles = handles

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()


class ParamAndGradBuffer:
    """Flat storage for the params (dtype `param_dtype`) and grads (`grad_dtype`) of a group.

    Args:
        params: parameters in registration order (all of dtype `param_dtype`).
        data_parallel_group: the group grads are reduced over (and shards are taken from).
        bucket_size: target elements per bucket, None for a single bucket.
        gradient_scaling_factor: grads are multiplied by it before the collective (1/dp when
            pre-scaling, or ep-correction with AVG).
        average_in_collective: use ReduceOp.AVG instead of SUM.
        layer_wise: every param lies whole in one data-parallel rank's shard
            (`layer_wise_shard_layout`), as Muon's layer-wise distributed optimizer needs.
        inter_instance_group: with --num-distributed-optimizer-instances, the ranks holding
            this rank's shard in the other instances (`data_parallel_group` is then this
            rank's instance): each shard's reduced grads are all-reduced over it.
        replica_group: every replica of these params (default `data_parallel_group`), from
            whose first member `broadcast_params` copies them.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        data_parallel_group,
        bucket_size: Optional[int],
        gradient_scaling_factor: float,
        average_in_collective: bool,
        use_distributed_optimizer: bool,
        param_names: Optional[Dict[torch.nn.Parameter, str]] = None,
        device: Optional[torch.device] = None,
        layer_wise: bool = False,
        inter_instance_group=None,
        replica_group=None,
    ):
        self.param_dtype = param_dtype
        self.inter_instance_group = inter_instance_group
        self.replica_group = data_parallel_group if replica_group is None else replica_group
        self.grad_dtype = grad_dtype
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = dist.get_world_size(data_parallel_group)
        self.data_parallel_rank = dist.get_rank(data_parallel_group)
        self.gradient_scaling_factor = gradient_scaling_factor
        self.average_in_collective = average_in_collective
        self.use_distributed_optimizer = use_distributed_optimizer
        # gloo's reduce-scatter is slower than its all-reduce of the whole bucket (16 MB fp32:
        # 27 vs 14 ms at DP=2, 50 vs 33 ms at DP=4, tools/bench/bench_collectives.py), so on
        # gloo the distributed optimizer all-reduces and reads its shard; NCCL gets the real
        # reduce-scatter.
        self.reduce_scatter_by_all_reduce = (
            use_distributed_optimizer and dist.get_backend(data_parallel_group) == "gloo"
        )
        # gloo's all-gather stages its whole output in a temporary of the bucket's size and
        # copies it out (+400 MiB per step for a 105M-param fp32 bucket) and is slower than
        # broadcasting each rank's shard in place (105M fp32: 0.13 vs 0.6 s at DP=2, 0.45 vs
        # 2.0 s at DP=4). NCCL's all-gather writes into param_data directly.
        self.param_gather_by_broadcast = dist.get_backend(data_parallel_group) == "gloo"
        self.data_parallel_global_ranks = [
            dist.get_global_rank(data_parallel_group, rank)
            for rank in range(self.data_parallel_world_size)
        ]
        self.param_names = dict(param_names or {})
        # Test/trace hook: called with the bucket whenever its reduction is launched.
        self.on_grad_sync_start = None
        # Called with each bucket's local grads before its reduction (the training loop's
        # NaN/Inf check).
        self.grad_check = None

        ordered = list(reversed(list(params)))
        if not ordered:
            raise ValueError("ParamAndGradBuffer needs at least one parameter")
        device = device or ordered[0].device
        # The tied embedding gets a bucket of its own with the distributed optimizer, so
        # the first and last pipeline stage shard it identically and the embedding
        # all-reduce after the DP reduce-scatter sums matching shards.
        own_bucket = [
            use_distributed_optimizer and getattr(p, "shared_embedding", False) for p in ordered
        ]
        ends = balanced_bucket_boundaries(
            [p.numel() for p in ordered], bucket_size, own_bucket
        )

        # Layout: offsets of each param, each bucket padded to a multiple of dp. Layer-wise
        # (Muon's distributed optimizer), each param lies whole in one rank's shard.
        self.layer_wise = layer_wise
        self.param_index_map: Dict[torch.nn.Parameter, Tuple[int, int, int]] = {}
        bucket_specs = []  # (params, start, unpadded_end, padded_end)
        offset, start_param = 0, 0
        rank_loads = [0] * self.data_parallel_world_size
        for bucket_index, end_param in enumerate(ends):
            bucket_start = offset
            bucket_params = ordered[start_param:end_param]
            if layer_wise:
                starts, shard_size = layer_wise_shard_layout(
                    [p.numel() for p in bucket_params], self.data_parallel_world_size,
                    rank_loads)
                for param, start in zip(bucket_params, starts):
                    begin = bucket_start + start
                    self.param_index_map[param] = (begin, begin + param.numel(), bucket_index)
                offset = bucket_start + shard_size * self.data_parallel_world_size
                unpadded_end = offset
            else:
                for param in bucket_params:
                    self.param_index_map[param] = (offset, offset + param.numel(), bucket_index)
                    offset += param.numel()
                unpadded_end = offset
                offset = bucket_start + pad_to_multiple(
                    unpadded_end - bucket_start, self.data_parallel_world_size
                )
            bucket_specs.append((bucket_params, bucket_start, unpadded_end, offset))
            start_param = end_param
        self.numel = offset
        self.numel_unpadded = sum(p.numel() for p in ordered)

        # Params move into the buffer (freeing their old storage) before the grad buffer is
        # allocated, so construction peaks at two copies of the params, not three (on the
        # host only if the freed memory is returned first).
        release_freed_host_memory()
        self.param_data = torch.zeros(self.numel, dtype=param_dtype, device=device)
        for param, (start, end, _) in self.param_index_map.items():
            view = self.param_data[start:end].view(param.shape)
            view.copy_(param.data)
            param.data = view
        release_freed_host_memory()
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        for param, (start, end, _) in self.param_index_map.items():
            param.main_grad = self.grad_data[start:end].view(param.shape)

        self.buckets: List[Bucket] = []
        self.param_to_bucket: Dict[torch.nn.Parameter, Bucket] = {}
        for index, (bucket_params, start, unpadded_end, end) in enumerate(bucket_specs):
            bucket = Bucket(
                index, list(bucket_params), self.param_data[start:end],
                self.grad_data[start:end], start, unpadded_end - start, self,
            )
            self.buckets.append(bucket)
            for param in bucket_params:
                self.param_to_bucket[param] = bucket

    @property
    def params(self) -> List[torch.nn.Parameter]:
        return list(self.param_index_map)

    def reset(self) -> None:
        """Zero the grads and forget which ones arrived (start of a new step)."""
        self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.reset()

    def set_is_last_microbatch(self, value: bool) -> None:
        for bucket in self.buckets:
            bucket.is_last_microbatch = value
