"""SMP v2's `save` / `async_save` on top of torch.distributed.checkpoint (DCP).

Both write DCP's file-system format (one data file per rank plus a `.metadata` written by the
coordinator after every rank reported its writes). `async_save` copies every tensor to CPU
memory before it returns (or, with `stage_in_background`, on the writer thread until
`wait_for_staging()`), then the writes -- and the collectives DCP needs to plan them -- run on
a background thread over a dedicated gloo process group, so they can never interleave with
the training thread's collectives.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

from megatron_smp.checkpointing.engine.agreement import (
    global_ranks,
    is_distributed,
    raise_if_any_rank_failed,
)
from megatron_smp.checkpointing.engine.async_queue import (
    DEFAULT_ASYNC_QUEUE,
    AsyncCallsQueue,
    AsyncRequest,
)
from megatron_smp.checkpointing.engine.sharded_tensor import ShardedTensorView, make_sharded_tensor
from megatron_smp.checkpointing.engine.storage import (
    gc_paused,
    CheckpointError,
    HookedSavePlanner,
    check_plain_data,
    make_storage_writer,
    maybe_test_staging_delay,
)
from megatron_smp.parallel_state import new_group


def reject_s3(s3_region, s3client_config) -> None:
    if s3_region is not None or s3client_config is not None:
        raise NotImplementedError(
            "S3 checkpoints (s3_region / s3client_config) are not supported by megatron_smp; "
            "save to a file-system path (checkpoint_id=...) or pass your own storage_writer"
        )


def _writer_for(checkpoint_id, storage_writer):
    if storage_writer is None:
        if checkpoint_id is None:
            raise CheckpointError("save needs checkpoint_id (a directory) or a storage_writer")
        return make_storage_writer(os.fspath(checkpoint_id))
    if checkpoint_id is not None:
        storage_writer.reset(checkpoint_id)
    return storage_writer


class PyTorchDistSaveShardedStrategy:
    """SMP v2's default sharded strategy: PyTorch DCP's own format, which is what `save` and
    `async_save` write (Megatron names it ("torch_dist", version)). Any other backend is an
    error; passing this (or nothing) changes nothing."""

    def __init__(self, backend: str = "torch_dist", version: int = 1) -> None:
        if backend != "torch_dist":
            raise NotImplementedError(
                f"PyTorchDistSaveShardedStrategy backend {backend!r} is not supported; "
                "only 'torch_dist' (PyTorch DCP) is written"
            )
        self.backend = backend
        self.version = version

    def __repr__(self) -> str:
        return f"PyTorchDistSaveShardedStrategy({self.backend!r}, {self.version})"


def _check_strategy(sharded_strategy) -> None:
    # SMP's default strategy is DCP itself; Megatron spells it ("torch_dist", version).
    if sharded_strategy is None or isinstance(sharded_strategy, PyTorchDistSaveShardedStrategy):
        return
    if isinstance(sharded_strategy, tuple) and sharded_strategy[:1] == ("torch_dist",):
        return
    raise NotImplementedError(
        f"sharded_strategy {sharded_strategy!r} is not supported; use None, "
        "PyTorchDistSaveShardedStrategy() or ('torch_dist', 1)"
    )


def check_state_dict(state_dict: Dict[str, Any], prefix: str = "") -> None:
    """Every leaf is a tensor (plain, DTensor, ShardedTensor, ShardedTensorView) or plain data."""
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"a state dict must be a dict, got {type(state_dict).__name__}")
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise CheckpointError(
                f"state dict key {prefix}{key!r} is a {type(key).__name__}; DCP flattens keys "
                "to dotted strings, so use str keys (e.g. for optimizer state param ids)"
            )
        if isinstance(value, dict):
            check_state_dict(value, f"{prefix}{key}.")
        else:
            check_plain_data(value, f"{prefix}{key}")


def _run_dcp_save(state_dict, writer, planner, process_group, coordinator_rank, what) -> None:
    try:
        _save_state_dict(
            state_dict,
            storage_writer=writer,
            process_group=process_group,
            coordinator_rank=coordinator_rank,
            no_dist=not is_distributed(),
            planner=planner,
        )
    except CheckpointException as error:
        # DCP has already shared the failure with every rank.
        failures = getattr(error, "failures", {}) or {}
        first = next(iter(failures.values()), error)
        if isinstance(first, tuple):  # DCP stores (exception, stack summary)
            first = first[0]
        raise CheckpointError(
            f"{what} failed on rank(s) {sorted(failures)}: {type(first).__name__}: {first}"
        ) from error


def save(
    state_dict: Dict[str, Any],
    *,
    checkpoint_id: Union[str, os.PathLike, None] = None,
    storage_writer=None,
    planner=None,
    process_group: Optional[dist.ProcessGroup] = None,
    coordinator_rank: int = 0,
    wait_error_handling: bool = True,
    force_check_all_plans: bool = True,
    s3_region: Optional[str] = None,
    s3client_config=None,
) -> None:
    """Save `state_dict` synchronously into `checkpoint_id` (a directory); collective.

    Each rank writes its own tensors and shards (`ShardedTensorView`, DTensor, ShardedTensor).
    A plain tensor or value under the same key on several ranks is taken as replicated and
    written by one of them: keep per-rank data under per-rank keys or in a ShardedTensorView.
    `wait_error_handling`: a local problem found before writing (e.g. a non-plain value) is
    agreed on by all ranks and raised everywhere; with False it is raised on the rank that found
    it only. `force_check_all_plans`: this engine caches no plans, so every save gathers and
    validates all ranks' plans whatever its value. `coordinator_rank` is a rank of
    `process_group`; it writes `.metadata`.
    """
    reject_s3(s3_region, s3client_config)
    what = f"saving checkpoint {checkpoint_id or ''}".rstrip()
    writer = _prepare(
        state_dict, checkpoint_id, storage_writer, process_group, wait_error_handling, what
    )
    with gc_paused():
        _run_dcp_save(state_dict, writer, planner or HookedSavePlanner(), process_group,
                      coordinator_rank, what)


def _prepare(state_dict, checkpoint_id, storage_writer, process_group, wait_error_handling, what):
    error, writer = None, None
    try:
        check_state_dict(state_dict)
        writer = _writer_for(checkpoint_id, storage_writer)
    except Exception as caught:  # shared with the other ranks below
        error = caught
    if wait_error_handling:
        raise_if_any_rank_failed(error, process_group, what)
    elif error is not None:
        raise error
    return writer


# -- asynchronous save ------------------------------------------------------------------------

_CHECKPOINT_GROUPS: Dict[Tuple[int, Tuple[int, ...]], dist.ProcessGroup] = {}


def _checkpoint_group(
    process_group: Optional[dist.ProcessGroup], backend: Optional[str] = "gloo"
) -> Optional[dist.ProcessGroup]:
    """A group with the ranks of `process_group`, used only by the writer thread: gloo, or
    with `backend=None` the default backend's (Megatron's --disable-gloo-process-groups).

    Created on first use, which is collective over `process_group` (async_save is).
    """
    if not is_distributed():
        return None
    ranks = tuple(global_ranks(process_group))
    # Keyed by the default group too: a re-initialised job must not reuse dead groups.
    key = (id(dist.group.WORLD), ranks, backend)
    if key not in _CHECKPOINT_GROUPS:
        _CHECKPOINT_GROUPS[key] = new_group(
            list(ranks), backend=backend, use_local_synchronization=True
        )
    return _CHECKPOINT_GROUPS[key]


class _StagingCopies:
    """The tensor copies of a planned staging, run by `run()` on any thread.

    With `record_ready()` called on the training thread, an accelerator copy runs on a side
    stream that first waits for the work queued before that call, so a background copy sees
    the values at call time and does not serialise with later training kernels.
    """

    def __init__(self) -> None:
        self.pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (CPU destination, source)
        self.ready_event = None

    def _cuda_sources(self) -> List[torch.Tensor]:
        return [src for _, src in self.pairs if src.device.type == "cuda"]

    def record_ready(self) -> None:
        sources = self._cuda_sources()
        if sources:
            self.ready_event = torch.cuda.Event()
            self.ready_event.record(torch.cuda.current_stream(sources[0].device))

    def run(self) -> None:
        sources = self._cuda_sources()
        if not sources:
            for staged, tensor in self.pairs:
                maybe_test_staging_delay()
                staged.copy_(tensor)
            return
        device = sources[0].device
        stream = torch.cuda.current_stream(device)
        if self.ready_event is not None:
            stream = torch.cuda.Stream(device)
            stream.wait_event(self.ready_event)
        with torch.cuda.stream(stream):
            for staged, tensor in self.pairs:
                # Pinned destinations make these copies asynchronous; one sync at the end.
                staged.copy_(tensor, non_blocking=tensor.device.type == "cuda")
        stream.synchronize()


def _plan_staging(
    value: Any, buffers: Optional[Dict[Any, torch.Tensor]]
) -> Tuple[Any, _StagingCopies]:
    """The staged structure of `value` (CPU destination tensors, plain data deep-copied now)
    and the copies that fill those tensors. Runs on the caller's thread."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    copies = _StagingCopies()

    def copy_tensor(tensor: torch.Tensor, path) -> torch.Tensor:
        tensor = tensor.detach()
        staged = buffers.get(path) if buffers is not None else None
        if staged is None or staged.shape != tensor.shape or staged.dtype != tensor.dtype:
            # Pinned host memory lets an accelerator copy run asynchronously.
            pin = tensor.device.type == "cuda"
            staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            if buffers is not None:
                buffers[path] = staged
        copies.pairs.append((staged, tensor))
        return staged

    def stage(obj, path):
        if isinstance(obj, dict):
            return {k: stage(v, path + (k,)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(stage(v, path + (i,)) for i, v in enumerate(obj))
        if isinstance(obj, ShardedTensorView):
            chunks = [
                (offsets, copy_tensor(t, path + (i,)))
                for i, (offsets, t) in enumerate(obj.chunks)
            ]
            return ShardedTensorView(chunks, obj.global_shape, obj.dtype, torch.device("cpu"))
        if isinstance(obj, DTensor):
            chunk = obj.__create_chunk_list__()[0]
            return make_sharded_tensor(copy_tensor(obj.to_local(), path), obj.shape, chunk.offsets)
        if isinstance(obj, ShardedTensor):
            chunks = [
                (tuple(s.metadata.shard_offsets), copy_tensor(s.tensor, path + (i,)))
                for i, s in enumerate(obj.local_shards())
            ]
            return ShardedTensorView(chunks, obj.size(), obj.dtype, torch.device("cpu"))
        if isinstance(obj, torch.Tensor):
            return copy_tensor(obj, path)
        return copy.deepcopy(obj)

    return stage(value, ()), copies


def stage_to_cpu(value: Any, buffers: Optional[Dict[Any, torch.Tensor]] = None) -> Any:
    """A CPU copy of a state dict that training may modify as soon as this returns.

    `buffers` (path -> tensor), when given, supplies reusable destination tensors and receives
    new ones. DTensor and torch ShardedTensor values are staged as `ShardedTensorView`s with
    the same chunks, which DCP writes in the same format.
    """
    staged, copies = _plan_staging(value, buffers)
    copies.run()
    return staged


def prepare_staging(value: Any, queue: Optional[AsyncCallsQueue] = None) -> None:
    """Allocate `queue`'s reusable CPU staging buffers for a state dict shaped like `value`
    now, and write every page of them on the writer thread (no collective).

    The first asynchronous save otherwise copies into fresh memory, which the kernel must
    first zero page by page: on a CPU host about twice the time of a copy into warm memory,
    all of it time a training step may wait for (`wait_for_staging`). Call it once the
    model and optimizer exist (a training loop: before its first step); the buffers are the
    ones every later save copies into, so the memory is the same, held from here on. A no-op
    while a save holds the buffers.
    """
    queue = queue if queue is not None else DEFAULT_ASYNC_QUEUE
    buffers = queue.borrow_staging_buffers()
    if buffers is None:
        return None
    try:
        _, copies = _plan_staging(value, buffers)
    finally:
        queue.return_staging_buffers()
    destinations = [staged for staged, _ in copies.pairs]

    def touch() -> None:
        for staged in destinations:
            staged.zero_()

    queue.prepare_staging_buffers_in_background(touch)


def schedule_staged_write(
    value: Any,
    write: Callable[[Any], None],
    queue: AsyncCallsQueue,
    *,
    stage_in_background: bool = False,
    finalize_fns: Optional[List[Callable[[], None]]] = None,
    process_group: Optional[dist.ProcessGroup] = None,
    description: str = "asynchronous checkpoint save",
) -> int:
    """Stage `value` into `queue`'s reusable CPU buffers, then `write(staged)` on the writer
    thread; returns the call index.

    Without `stage_in_background` the tensor copies run now, so the caller may modify the
    tensors when this returns. With it they run on the writer thread just before the write:
    the caller must not modify the tensors until `queue.wait_for_staging()` returns (the
    structure and plain values are captured now).
    """
    buffers = queue.borrow_staging_buffers()
    staged, copies = _plan_staging(value, buffers)
    if stage_in_background:
        copies.record_ready()
    else:
        queue.wait_for_staging_preparation()  # its pages are written on the writer thread
        copies.run()
    return queue.schedule_async_request(
        AsyncRequest(
            async_fn=lambda: write(staged),
            stage_fn=copies.run if stage_in_background else None,
            finalize_fns=list(finalize_fns or []),
            cleanup_fns=[queue.return_staging_buffers] if buffers is not None else [],
            process_group=process_group,
            description=description,
        )
    )


def async_save(
    state_dict: Dict[str, Any],
    *,
    checkpoint_id: Union[str, os.PathLike, None] = None,
    storage_writer=None,
    planner=None,
    process_group: Optional[dist.ProcessGroup] = None,
    coordinator_rank: int = 0,
    queue: Optional[AsyncCallsQueue] = None,
    sharded_strategy=None,
    wait_error_handling: bool = True,
    force_check_all_plans: bool = True,
    s3_region: Optional[str] = None,
    s3client_config=None,
    finalize_fns: Optional[List[Callable[[], None]]] = None,
    stage_in_background: bool = False,
    writer_backend: Optional[str] = "gloo",
) -> None:
    """Like `save`, but returns once the tensors are copied to CPU memory; collective.

    The write goes on in the background. `maybe_finalize_async_calls` (on the same `queue`)
    later agrees with all ranks that the write finished and then runs `finalize_fns` (our
    extension to the SMP signature: e.g. publish the checkpoint) in order.

    `stage_in_background` (our extension): return before the copy to CPU memory, which then
    runs on the writer thread. The tensors must not be modified until `wait_for_staging()`
    (same `queue`) returns -- a training loop calls it just before `optimizer.step()`. The
    state dict's structure and plain values are captured before this returns.

    `writer_backend` (our extension): the backend of the writer thread's own process group;
    None: the default group's.
    """
    reject_s3(s3_region, s3client_config)
    _check_strategy(sharded_strategy)
    queue = queue if queue is not None else DEFAULT_ASYNC_QUEUE
    what = f"asynchronous save of checkpoint {checkpoint_id or ''}".rstrip()
    writer = _prepare(
        state_dict, checkpoint_id, storage_writer, process_group, wait_error_handling, what
    )
    writer_group = _checkpoint_group(process_group, writer_backend)
    planner = planner or HookedSavePlanner()

    def write(staged) -> None:
        _run_dcp_save(staged, writer, planner, writer_group, coordinator_rank, what)

    schedule_staged_write(
        state_dict,
        write,
        queue,
        stage_in_background=stage_in_background,
        finalize_fns=finalize_fns,
        process_group=process_group,
        description=what,
    )
