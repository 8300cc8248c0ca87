"""Background checkpoint writes and their collective finalisation.

An `AsyncRequest` is a function that writes staged (CPU) data, plus finalisation callbacks
(publish the checkpoint, log); optionally a staging function that first copies the data to CPU
memory on the worker thread, which `wait_for_staging` waits for. `AsyncCallsQueue` runs the
requests one after another on a single worker thread -- so every rank issues the writes'
collectives in the same order -- and `maybe_finalize_async_calls` runs a request's callbacks
only after all ranks agree (one all-reduce on the caller's group, from the caller's thread)
that every rank's write finished.
"""
from __future__ import annotations

import concurrent.futures
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_smp.checkpointing.engine.agreement import (
    collective_device,
    global_ranks,
    group_size_and_rank,
    is_distributed,
)
from megatron_smp.checkpointing.engine.storage import CheckpointError


@dataclass
class AsyncRequest:
    """`stage_fn` (optional) then `async_fn` run on the writer thread; `finalize_fns` run on
    the caller's thread after every rank's `async_fn` has returned; `cleanup_fns` run in
    either case (e.g. release staging buffers). `staged` completes when `stage_fn` has
    returned (at once without one); a failed `stage_fn` fails the request too."""

    async_fn: Callable[[], None]
    finalize_fns: List[Callable[[], None]] = field(default_factory=list)
    cleanup_fns: List[Callable[[], None]] = field(default_factory=list)
    process_group: Optional[dist.ProcessGroup] = None
    description: str = "asynchronous checkpoint save"
    stage_fn: Optional[Callable[[], None]] = None
    call_idx: int = -1
    future: Optional[concurrent.futures.Future] = None
    staged: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    staging_checked: bool = False


def _stage_then_write(request: AsyncRequest) -> None:
    if request.stage_fn is not None:
        try:
            request.stage_fn()
        except BaseException as error:
            request.staged.set_exception(error)
            raise
        request.staged.set_result(None)
    request.async_fn()


class AsyncCallsQueue:
    """FIFO of in-flight asynchronous saves (one writer thread per queue)."""

    def __init__(self) -> None:
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pending: Deque[AsyncRequest] = deque()
        self._counter = itertools.count()
        # CPU staging buffers kept between saves: copying into warm memory is several times
        # faster than into fresh allocations (page faults), and that copy is all the time
        # training is blocked. Lent to one request at a time.
        self._staging_buffers: Dict[Any, Any] = {}
        self._staging_buffers_lent = False
        self._staging_preparation: Optional[concurrent.futures.Future] = None

    def borrow_staging_buffers(self) -> Optional[Dict[Any, Any]]:
        """The reusable staging buffers, or None while an unfinalised request holds them."""
        if self._staging_buffers_lent:
            return None
        self._staging_buffers_lent = True
        return self._staging_buffers

    def return_staging_buffers(self) -> None:
        self._staging_buffers_lent = False

    def drop_staging_buffers(self) -> None:
        """Free the cached CPU copies (e.g. after the last checkpoint)."""
        if not self._staging_buffers_lent:
            self._staging_buffers.clear()

    def _writer(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="megatron_smp_ckpt_writer"
            )
        return self._executor

    def prepare_staging_buffers_in_background(self, fn: Callable[[], None]) -> None:
        """Run `fn` (writing the staging buffers' pages) on the writer thread, before any
        later request's staging; a copy on the caller's thread waits for it first
        (`wait_for_staging_preparation`)."""
        self._staging_preparation = self._writer().submit(fn)

    def wait_for_staging_preparation(self) -> None:
        if self._staging_preparation is not None:
            self._staging_preparation.result()
            self._staging_preparation = None

    def schedule_async_request(self, request: AsyncRequest) -> int:
        """Start `request.async_fn` in the background; returns the call index."""
        self._writer()
        request.call_idx = next(self._counter)
        if request.stage_fn is None:
            request.staged.set_result(None)
            request.staging_checked = True
        request.future = self._executor.submit(_stage_then_write, request)
        self._pending.append(request)
        return request.call_idx

    def has_unchecked_staging(self) -> bool:
        """Whether a pending request's staging has not been waited for yet (then training
        must call `wait_for_staging` before modifying the tensors it saves)."""
        return any(not request.staging_checked for request in self._pending)

    def wait_for_staging(self) -> None:
        """Block until every pending request's copy to CPU memory is complete; after it the
        saved tensors may be modified. Not collective; cheap once nothing is being staged.

        Requests run one after another, so a request scheduled while an earlier one is still
        writing is staged after that write. Raises `CheckpointError` (once per request) if a
        staging copy failed; that request's write does not run, and its finalisation raises
        the same failure on every rank.
        """
        for request in list(self._pending):
            if request.staging_checked:
                continue
            error = request.staged.exception()  # waits
            request.staging_checked = True
            if error is not None:
                raise CheckpointError(
                    f"{request.description}: copying the state to CPU memory failed: "
                    f"{type(error).__name__}: {error} (asynchronous call {request.call_idx}); "
                    "the tensors were not modified and may be updated"
                ) from error

    def get_num_unfinalized_calls(self) -> int:
        return len(self._pending)

    def maybe_finalize_async_calls(
        self, blocking: bool = True, process_group: Optional[dist.ProcessGroup] = None
    ) -> List[int]:
        """Finalise, oldest first, the requests every rank has finished; returns their indices.

        Collective over `process_group` (default: each request's group) whenever a request is
        pending: all ranks must call it the same number of times, as the training loop does
        once per iteration. With `blocking`, waits for every pending request.
        """
        finalized = []
        while self._pending:
            request = self._pending[0]
            if blocking:
                concurrent.futures.wait([request.future])
            group = process_group if process_group is not None else request.process_group
            failed_ranks, all_done = self._agree(request, group)
            if not all_done:
                break
            self._pending.popleft()
            try:
                if failed_ranks:
                    error = request.future.exception()
                    if isinstance(error, CheckpointError):  # already names ranks and cause
                        message = str(error)
                    else:
                        detail = f"{type(error).__name__}: {error}" if error else "see their logs"
                        message = (
                            f"{request.description} failed on rank(s) {failed_ranks}: {detail}"
                        )
                    raise CheckpointError(
                        f"{message} (asynchronous call {request.call_idx}); the previous "
                        "checkpoint stays current"
                    ) from error
                for fn in request.finalize_fns:
                    fn()
            finally:
                for fn in request.cleanup_fns:
                    fn()
            finalized.append(request.call_idx)
        return finalized

    @staticmethod
    def _agree(request: AsyncRequest, group):
        done = request.future.done()
        failed = done and request.future.exception() is not None
        if not is_distributed():
            return ([0] if failed else []), done
        size, rank = group_size_and_rank(group)
        # [number of ranks still writing, failed flag per rank]
        flags = torch.zeros(size + 1, dtype=torch.int64, device=collective_device(group))
        flags[0] = 0 if done else 1
        flags[1 + rank] = 1 if failed else 0
        dist.all_reduce(flags, group=group)
        flags = flags.cpu().tolist()
        ranks = global_ranks(group)
        return [ranks[i] for i in range(size) if flags[1 + i]], flags[0] == 0

    def close(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        """Finalise everything (blocking, collective) and stop the writer thread."""
        self.maybe_finalize_async_calls(blocking=True, process_group=process_group)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


DEFAULT_ASYNC_QUEUE = AsyncCallsQueue()


def wait_for_staging() -> None:
    """Wait until the default queue's background-staged saves have copied their tensors to
    CPU memory (see AsyncCallsQueue.wait_for_staging)."""
    DEFAULT_ASYNC_QUEUE.wait_for_staging()


def maybe_finalize_async_calls(blocking=True, process_group=None) -> List[int]:
    """Finalise the default queue's finished asynchronous saves (see AsyncCallsQueue)."""
    return DEFAULT_ASYNC_QUEUE.maybe_finalize_async_calls(
        blocking=blocking, process_group=process_group
    )
