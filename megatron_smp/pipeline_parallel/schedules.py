"""Forward/backward schedules over microbatches.

Every schedule has the same signature as Megatron's `forward_backward_func`:

    losses = schedule(forward_step_func=..., data_iterator=..., model=[chunk, ...],
                      num_microbatches=m, seq_length=s, micro_batch_size=b,
                      forward_only=False, hooks=ScheduleHooks(...))

`forward_step_func(data_iterator, model_chunk) -> (output_tensor, loss_func)` and
`loss_func(output_tensor) -> (loss, reporting_dict)`: the loss is a scalar mean over the
microbatch's tokens; the schedule divides it by the number of microbatches (so the
accumulated gradient is the mean over the global batch), scales it for fp16 and calls
backward. The returned list holds one reporting dict per microbatch (last stage only).

Schedules are named `gpipe`, `1f1b` and `interleaved_1f1b` (Megatron's virtual-pipeline
schedule); `schedule_name` maps SMP's `--pipeline-schedule simple|interleaved` onto them.
The interleaved schedule's order of (microbatch, chunk) steps is the pure table of
`get_schedule_table`.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_smp.config import ConfigError
from megatron_smp.distributed.unwrap import unwrap_model
from megatron_smp.pipeline_parallel.p2p import (
    PipelineCommunicator,
    backward_output_tensor,
    deallocate_output_tensor,
)


@dataclass
class ScheduleHooks:
    """What the training loop plugs into a schedule (Megatron keeps these on the config)."""

    # loss -> loss * loss_scale (fp16); None: no scaling.
    grad_scale_func: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    # Context manager that defers grad reduction (all but the last microbatch), or a list
    # with one per model chunk (virtual stages: each chunk's reduction then overlaps its own
    # last backward).
    no_sync_func: Optional[Any] = None
    # Called once after the last backward: finish DP reduction, TP/embedding all-reduces.
    finalize_model_grads_func: Optional[Callable[[Sequence[torch.nn.Module]], None]] = None


def _scaled_backward(loss: torch.Tensor, num_microbatches: int, hooks: ScheduleHooks) -> None:
    loss = loss / num_microbatches
    if hooks.grad_scale_func is not None:
        loss = hooks.grad_scale_func(loss)
    loss.backward()


def forward_step(
    forward_step_func: Callable,
    data_iterator: Iterator,
    model: torch.nn.Module,
    reports: List[Dict[str, torch.Tensor]],
    is_last_stage: bool = True,
) -> torch.Tensor:
    """Run one microbatch forward; on the last stage turn the output into the loss."""
    output_tensor, loss_func = forward_step_func(data_iterator, model)
    if not is_last_stage:
        return output_tensor
    loss, report = loss_func(output_tensor)
    reports.append({k: v.detach() for k, v in report.items()})
    return loss


def forward_backward_no_pipelining(
    *,
    forward_step_func: Callable,
    data_iterator: Iterator,
    model,
    num_microbatches: int,
    seq_length: int = 0,
    micro_batch_size: int = 0,
    forward_only: bool = False,
    hooks: Optional[ScheduleHooks] = None,
) -> List[Dict[str, torch.Tensor]]:
    """Gradient accumulation over microbatches; grads reduced only after the last one."""
    hooks = hooks or ScheduleHooks()
    chunks = model if isinstance(model, (list, tuple)) else [model]
    if len(chunks) != 1:
        raise ValueError("forward_backward_no_pipelining takes a single model chunk")
    module = chunks[0]
    no_sync = hooks.no_sync_func or contextlib.nullcontext
    reports: List[Dict[str, torch.Tensor]] = []
    context = torch.no_grad() if forward_only else contextlib.nullcontext()
    with context:
        for index in range(num_microbatches):
            last = index == num_microbatches - 1
            with (contextlib.nullcontext() if last else no_sync()):
                loss = forward_step(forward_step_func, data_iterator, module, reports)
                if not forward_only:
                    _scaled_backward(loss, num_microbatches, hooks)
    if not forward_only and hooks.finalize_model_grads_func is not None:
        hooks.finalize_model_grads_func(chunks)
    return reports



# Pipelined schedules ---------------------------------------------------------------------------
#
# Names follow the paper and Megatron: a *stage* is a rank of the pipeline group; with virtual
# stages each rank holds several *chunks* and chunk c of rank r is virtual stage c * pp + r.
# Stage inputs are received into fresh leaf tensors, so after a stage's backward their
# `.grad` is the grad to send to the previous stage.


def _stage_spec(module: torch.nn.Module):
    while module is not None:
        spec = getattr(module, "pipeline_stage", None)
        if spec is not None:
            return spec
        module = getattr(module, "module", None)
    return None


class _GradSync:
    """Defers DP grad reduction until the last microbatch's backward of each chunk.

    `hooks.no_sync_func` is either one context manager factory for all chunks or a list with
    one per chunk; then each chunk's reduction starts during its own last backward. With a
    single factory the context is released before the final backward of the last chunk
    (the training loop passes one per chunk, as Megatron's does).
    """

    def __init__(self, hooks: ScheduleHooks, chunks: Sequence[torch.nn.Module],
                 forward_only: bool):
        num_chunks = len(chunks)
        func = None if forward_only else hooks.no_sync_func
        self.per_chunk = isinstance(func, (list, tuple))
        factories = list(func) if self.per_chunk else [func] if func is not None else []
        self.contexts = [factory() for factory in factories]
        self.num_chunks = num_chunks
        self.released: set = set()
        for context in self.contexts:
            context.__enter__()

    def release(self, chunk: int) -> None:
        """Called just before the last microbatch's backward of `chunk`."""
        self.released.add(chunk)
        if self.per_chunk:
            self._exit(chunk)
        elif len(self.released) == self.num_chunks and self.contexts:
            self._exit(0)

    def _exit(self, index: int) -> None:
        context = self.contexts[index]
        if context is not None:
            context.__exit__(None, None, None)
            self.contexts[index] = None

    def close(self) -> None:
        for index in range(len(self.contexts)):
            self._exit(index)


class _StageRunner:
    """Forward and backward of one microbatch on one chunk of this rank.

    Keeps what every schedule shares: feeding the received input, turning the last stage's
    output into a loss, scaling it, the custom backward of freed outputs, the per-microbatch
    reports, the timeline spans and the count of microbatches in flight.
    """

    def __init__(self, forward_step_func, data_iterators, model_chunks, num_microbatches,
                 forward_only, hooks, state, timeline):
        self.forward_step_func = forward_step_func
        self.data_iterators = data_iterators
        self.chunks = model_chunks
        self.num_microbatches = num_microbatches
        self.forward_only = forward_only
        self.hooks = hooks
        self.state = state
        self.timeline = timeline
        self.reports: List[Dict[str, torch.Tensor]] = []
        self.in_flight = 0

    def is_first_stage(self, chunk: int) -> bool:
        return self.state.is_pipeline_first_stage and chunk == 0

    def is_last_stage(self, chunk: int) -> bool:
        return self.state.is_pipeline_last_stage and chunk == len(self.chunks) - 1

    def _span(self, name: str, **args):
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(name, "compute", **args)

    def forward(self, chunk: int, microbatch: int,
                input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
        """Output [s, b, h] of a stage (the loss, a scalar, on the last stage)."""
        model = self.chunks[chunk]
        unwrap_model(model).set_input_tensor(input_tensor)
        with self._span(f"F{microbatch}", microbatch=microbatch, chunk=chunk):
            output = forward_step(self.forward_step_func, self.data_iterators[chunk], model,
                                  self.reports, self.is_last_stage(chunk))
        if not self.forward_only:
            self._count(+1)
        return output

    def backward(self, chunk: int, microbatch: int, input_tensor: Optional[torch.Tensor],
                 output_tensor: torch.Tensor,
                 output_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Backward of one stage; returns the grad of its input (None on the first stage)."""
        with self._span(f"B{microbatch}", microbatch=microbatch, chunk=chunk):
            if self.is_last_stage(chunk):
                _scaled_backward(output_tensor, self.num_microbatches, self.hooks)
            else:
                backward_output_tensor(output_tensor, output_grad)
        self._count(-1)
        return None if input_tensor is None else input_tensor.grad

    def _count(self, change: int) -> None:
        self.in_flight += change
        if self.timeline is not None:
            self.timeline.counter("microbatches in flight", self.in_flight)

    def finish(self) -> List[Dict[str, torch.Tensor]]:
        if not self.forward_only and self.hooks.finalize_model_grads_func is not None:
            self.hooks.finalize_model_grads_func(self.chunks)
        if self.timeline is not None:
            self.timeline.end_step()
        return self.reports


def _chunk_data_iterators(data_iterator, num_chunks: int) -> list:
    """One iterator per chunk. Every chunk reads every microbatch (the first for its tokens,
    later ones for positions, masks and labels): a single iterator is replayed per chunk."""
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != num_chunks:
            raise ValueError(f"got {len(data_iterator)} data iterators for {num_chunks} chunks")
        return list(data_iterator)
    if data_iterator is None or num_chunks == 1:
        return [data_iterator] * num_chunks
    return list(itertools.tee(data_iterator, num_chunks))


def _setup(forward_step_func, data_iterator, model, num_microbatches, seq_length,
           micro_batch_size, forward_only, hooks, state, tensor_shape, dtype, timeline):
    """The runner and communicator of one schedule call.

    The parallel state, the exchanged shape [s / tp (sequence parallel) / cp, b, h], dtype
    and timeline come from the chunks' `pipeline_stage` (set by `build_pipeline_model_chunks`)
    unless given explicitly.
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    spec = _stage_spec(chunks[0])
    if state is None:
        state = spec.state if spec is not None else getattr(unwrap_model(chunks[0]), "state", None)
    if state is None:
        raise ValueError("pipelined schedules need state= or chunks built by "
                         "build_pipeline_model_chunks")
    if tensor_shape is None:
        if spec is None:
            raise ValueError("pipelined schedules need tensor_shape= for chunks not built by "
                             "build_pipeline_model_chunks")
        seq = seq_length // state.cp_size
        if spec.sequence_parallel:
            seq //= state.tp_size
        tensor_shape = (seq, micro_batch_size, spec.hidden_size)
    if dtype is None:
        dtype = spec.dtype if spec is not None else next(chunks[0].parameters()).dtype
    if timeline is None and spec is not None:
        timeline = spec.timeline
    hooks = hooks or ScheduleHooks()
    runner = _StageRunner(forward_step_func, _chunk_data_iterators(data_iterator, len(chunks)),
                          chunks, num_microbatches, forward_only, hooks, state, timeline)
    communicator = PipelineCommunicator(state, tuple(tensor_shape), dtype, timeline,
                                        requires_grad=not forward_only)
    return runner, communicator, _GradSync(hooks, chunks, forward_only)


def _single_chunk(model, name: str) -> None:
    if isinstance(model, (list, tuple)) and len(model) != 1:
        raise ValueError(f"{name} takes one model chunk per rank; virtual stages use "
                         "interleaved_1f1b")


def forward_backward_pipelining_gpipe(
    *, forward_step_func: Callable, data_iterator, model, num_microbatches: int,
    seq_length: int = 0, micro_batch_size: int = 0, forward_only: bool = False,
    hooks: Optional[ScheduleHooks] = None, state=None, tensor_shape=None, dtype=None,
    timeline=None,
) -> List[Dict[str, torch.Tensor]]:
    """`gpipe` (SMP's `simple`): every microbatch's forward, then every backward.

    All m microbatches are in flight at the peak; the bubble is (p - 1) / (m + p - 1).
    """
    _single_chunk(model, "the gpipe schedule")
    runner, comm, grad_sync = _setup(
        forward_step_func, data_iterator, model, num_microbatches, seq_length,
        micro_batch_size, forward_only, hooks, state, tensor_shape, dtype, timeline)
    first, last = runner.is_first_stage(0), runner.is_last_stage(0)
    inputs, outputs = [], []
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        for microbatch in range(num_microbatches):
            input_tensor = comm.recv_forward(first)
            output_tensor = runner.forward(0, microbatch, input_tensor)
            comm.send_forward(output_tensor, last)
            if not forward_only:
                inputs.append(input_tensor)
                outputs.append(output_tensor)
                if not last:
                    deallocate_output_tensor(output_tensor)

    if not forward_only:
        for microbatch in range(num_microbatches):
            if microbatch == num_microbatches - 1:
                grad_sync.release(0)
            output_grad = comm.recv_backward(last)
            input_grad = runner.backward(0, microbatch, inputs.pop(0), outputs.pop(0),
                                         output_grad)
            comm.send_backward(input_grad, first)
    grad_sync.close()
    return runner.finish()


def forward_backward_pipelining_without_interleaving(
    *, forward_step_func: Callable, data_iterator, model, num_microbatches: int,
    seq_length: int = 0, micro_batch_size: int = 0, forward_only: bool = False,
    hooks: Optional[ScheduleHooks] = None, state=None, tensor_shape=None, dtype=None,
    timeline=None,
) -> List[Dict[str, torch.Tensor]]:
    """`1f1b` (PipeDream-Flush; SMP's `interleaved`): warm-up forwards, then one forward /
    one backward in the steady state, then the remaining backwards.

    Stage r runs p - r - 1 warm-up forwards, so at most p - r <= p microbatches are in
    flight on it; the bubble is the same as GPipe's, (p - 1) / (m + p - 1).
    """
    _single_chunk(model, "the 1f1b schedule")
    runner, comm, grad_sync = _setup(
        forward_step_func, data_iterator, model, num_microbatches, seq_length,
        micro_batch_size, forward_only, hooks, state, tensor_shape, dtype, timeline)
    state = runner.state
    first, last = runner.is_first_stage(0), runner.is_last_stage(0)
    num_warmup = min(state.pp_size - state.pp_rank - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup
    inputs, outputs = [], []
    forward_id = backward_id = 0

    def remember(input_tensor, output_tensor):
        if not forward_only:
            inputs.append(input_tensor)
            outputs.append(output_tensor)
            if not last:
                deallocate_output_tensor(output_tensor)

    with torch.no_grad() if forward_only else contextlib.nullcontext():
        # Warm-up: forwards only, filling the pipeline.
        for _ in range(num_warmup):
            input_tensor = comm.recv_forward(first)
            output_tensor = runner.forward(0, forward_id, input_tensor)
            forward_id += 1
            comm.send_forward(output_tensor, last)
            remember(input_tensor, output_tensor)

        # Steady state: one forward, one backward.
        input_tensor = comm.recv_forward(first) if num_steady > 0 else None
        for step in range(num_steady):
            last_step = step == num_steady - 1
            output_tensor = runner.forward(0, forward_id, input_tensor)
            forward_id += 1
            if forward_only:
                comm.send_forward(output_tensor, last)
                input_tensor = None if last_step else comm.recv_forward(first)
                continue
            output_grad = comm.send_forward_recv_backward(output_tensor, last)
            remember(input_tensor, output_tensor)
            if last_step and num_warmup == 0:
                grad_sync.release(0)
            input_grad = runner.backward(0, backward_id, inputs.pop(0), outputs.pop(0),
                                         output_grad)
            backward_id += 1
            if last_step:
                input_tensor = None
                comm.send_backward(input_grad, first)
            else:
                input_tensor = comm.send_backward_recv_forward(input_grad, first)

    # Cool-down: the backwards of the warm-up microbatches.
    if not forward_only:
        for step in range(num_warmup):
            if step == num_warmup - 1:
                grad_sync.release(0)
            output_grad = comm.recv_backward(last)
            input_grad = runner.backward(0, backward_id, inputs.pop(0), outputs.pop(0),
                                         output_grad)
            backward_id += 1
            comm.send_backward(input_grad, first)
    grad_sync.close()
    return runner.finish()


# The interleaved order ------------------------------------------------------------------------


def _microbatch_group_size(num_microbatches: int, pp_size: int,
                           group_size: Optional[int]) -> int:
    """The group size in use (default pp_size); ConfigError for one the schedule cannot run."""
    check_virtual_microbatches(num_microbatches, pp_size, group_size)
    return group_size or pp_size


def get_schedule_table(
    num_microbatches: int, pp_size: int, num_model_chunks: int,
    microbatch_group_size_per_vp_stage: Optional[int] = None,
) -> List[Tuple[int, int]]:
    """Megatron's order of the interleaved forwards: entry k is (microbatch, chunk) of step k.

    Microbatches go in groups of `microbatch_group_size_per_vp_stage` (default pp_size):
    chunk 0 runs the group, then chunk 1 the same group, ..., then the next group; the last
    group holds what is left. Every rank walks the same table, v * m entries. E.g. m=4,
    pp=2, v=2: [(0,0), (1,0), (0,1), (1,1), (2,0), (3,0), (2,1), (3,1)]. Raises ConfigError
    for a microbatch count or group size the schedule cannot run.
    """
    group = _microbatch_group_size(num_microbatches, pp_size, microbatch_group_size_per_vp_stage)
    table: List[Tuple[int, int]] = []
    for group_start in range(0, num_microbatches, group):
        members = range(group_start, min(group_start + group, num_microbatches))
        table.extend((microbatch, chunk) for chunk in range(num_model_chunks)
                     for microbatch in members)
    return table


def schedule_step(table: Sequence[Tuple[int, int]], k: int, num_model_chunks: int,
                  forward: bool = True) -> Tuple[int, int]:
    """(microbatch, chunk) of the k-th forward, or of the k-th backward.

    The backwards walk the same table with the chunks reversed: a microbatch's gradient
    starts at the last virtual stage, so the last chunk goes first.
    """
    microbatch, chunk = table[k]
    return (microbatch, chunk) if forward else (microbatch, num_model_chunks - 1 - chunk)


def interleaved_num_warmup(
    num_microbatches: int, pp_size: int, pp_rank: int, num_model_chunks: int,
    microbatch_group_size_per_vp_stage: Optional[int] = None,
) -> int:
    """Forwards rank `pp_rank` runs before its first backward (Megatron's count).

    Every rank first runs v - 1 groups, so that the last chunk has begun; rank r then runs
    2 more per later stage, the round trip its first output grad needs to come back from
    the last rank. At most all v * m forwards (then the schedule has no steady state).
    """
    group = microbatch_group_size_per_vp_stage or pp_size
    total = num_microbatches * num_model_chunks
    return min((pp_size - pp_rank - 1) * 2 + (num_model_chunks - 1) * group, total)


def forward_backward_pipelining_with_interleaving(
    *, forward_step_func: Callable, data_iterator, model, num_microbatches: int,
    seq_length: int = 0, micro_batch_size: int = 0, forward_only: bool = False,
    hooks: Optional[ScheduleHooks] = None, state=None, tensor_shape=None, dtype=None,
    timeline=None, microbatch_group_size_per_vp_stage: Optional[int] = None,
) -> List[Dict[str, torch.Tensor]]:
    """`interleaved_1f1b`: Megatron's interleaved schedule over v model chunks per rank.

    The v * m forwards follow `get_schedule_table` (groups of pp microbatches per chunk by
    default), the backwards the same table with the chunks reversed. Stage r warms up with
    `interleaved_num_warmup` forwards, then alternates one forward and one backward, then
    cools down. The bubble shrinks to (p - 1) / (v m + p - 1).
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    runner, comm, grad_sync = _setup(
        forward_step_func, data_iterator, chunks, num_microbatches, seq_length,
        micro_batch_size, forward_only, hooks, state, tensor_shape, dtype, timeline)
    state = runner.state
    pp, rank, num_chunks = state.pp_size, state.pp_rank, len(chunks)
    table = get_schedule_table(num_microbatches, pp, num_chunks,
                               microbatch_group_size_per_vp_stage)
    total = len(table)
    num_warmup = total if forward_only else interleaved_num_warmup(
        num_microbatches, pp, rank, num_chunks, microbatch_group_size_per_vp_stage)
    all_warmup = num_warmup == total
    num_steady = total - num_warmup

    def chunk_of(k: int, forward: bool) -> int:
        return schedule_step(table, k, num_chunks, forward)[1]

    # Per chunk, indexed by microbatch: received inputs and outputs awaiting backward (a
    # chunk takes its microbatches in order, so the i-th input received is microbatch i; the
    # leading rank may receive a few ahead of use with groups larger than pp). Cleared after
    # the backward. Per chunk, FIFO: received output grads.
    inputs = [[] for _ in chunks]
    outputs = [[] for _ in chunks]
    output_grads = [[] for _ in chunks]

    def forward_k(k: int) -> Optional[torch.Tensor]:
        """Forward number k; returns the output to send on (None on the last virtual stage)."""
        microbatch, chunk = schedule_step(table, k, num_chunks, forward=True)
        if runner.is_first_stage(chunk):
            inputs[chunk].append(None)
        output_tensor = runner.forward(chunk, microbatch, inputs[chunk][microbatch])
        if forward_only:  # nothing kept for a backward
            inputs[chunk][microbatch] = None
        else:
            outputs[chunk].append(output_tensor)
        return None if runner.is_last_stage(chunk) else output_tensor

    def backward_k(k: int) -> Optional[torch.Tensor]:
        """Backward number k; returns the input grad to send (None on virtual stage 0)."""
        microbatch, chunk = schedule_step(table, k, num_chunks, forward=False)
        if runner.is_last_stage(chunk):
            output_grads[chunk].append(None)
        if microbatch == num_microbatches - 1:
            grad_sync.release(chunk)
        input_tensor, output_tensor = inputs[chunk][microbatch], outputs[chunk][microbatch]
        inputs[chunk][microbatch] = outputs[chunk][microbatch] = None
        input_grad = runner.backward(chunk, microbatch, input_tensor, output_tensor,
                                     output_grads[chunk].pop(0))
        return None if runner.is_first_stage(chunk) else input_grad

    # Which chunk's FIFO the tensor received in the exchange after step k belongs to (None:
    # receive nothing). Inner ranks receive for their next step. The leading rank (rank 0 in
    # forward, rank p - 1 in backward) receives what went round the ring from the other end,
    # which runs p - 1 steps behind it: the successor of the chunk the leading rank ran at
    # step k - (p - 1), and nothing before the other end has produced anything.
    def forward_receiver(k: int) -> Optional[int]:
        """Chunk whose input arrives in the exchange after forward k."""
        if k + 1 >= total:
            return None
        if rank == 0:
            if k < pp - 1:
                return None
            chunk = chunk_of(k - (pp - 1), forward=True)
            return None if chunk == num_chunks - 1 else chunk + 1
        return chunk_of(k + 1, forward=True)

    def backward_receiver(k: int) -> Optional[int]:
        """Chunk whose output grad arrives in the exchange after backward k."""
        if k + 1 >= total:
            return None
        if rank == pp - 1:
            if k < pp - 1:
                return None
            chunk = chunk_of(k - (pp - 1), forward=False)
            return None if chunk == 0 else chunk - 1
        return chunk_of(k + 1, forward=False)

    def store(fifos, chunk: Optional[int], tensor: Optional[torch.Tensor]) -> None:
        if chunk is not None:
            fifos[chunk].append(tensor)

    with torch.no_grad() if forward_only else contextlib.nullcontext():
        # Warm-up: forwards only.
        if not state.is_pipeline_first_stage:
            inputs[0].append(comm.recv_forward(False))
        for k in range(num_warmup):
            output_tensor = forward_k(k)
            recv_chunk = forward_receiver(k)
            if k == num_warmup - 1 and not all_warmup:
                # The first backward's output grad arrives with the last warm-up exchange.
                recv_grad_chunk = None if state.is_pipeline_last_stage else num_chunks - 1
                input_tensor, output_grad = comm.send_forward_backward_recv_forward_backward(
                    output_tensor, None, recv_chunk is not None, recv_grad_chunk is not None)
                store(output_grads, recv_grad_chunk, output_grad)
            else:
                input_tensor = comm.send_forward_recv_forward(output_tensor,
                                                              recv_chunk is not None)
            store(inputs, recv_chunk, input_tensor)
            if not forward_only:
                deallocate_output_tensor(output_tensor)

        # Steady state: forward k + num_warmup, then backward k, then one exchange.
        for k in range(num_steady):
            output_tensor = forward_k(k + num_warmup)
            input_grad = backward_k(k)
            recv_chunk = forward_receiver(k + num_warmup)
            recv_grad_chunk = backward_receiver(k)
            input_tensor, output_grad = comm.send_forward_backward_recv_forward_backward(
                output_tensor, input_grad, recv_chunk is not None, recv_grad_chunk is not None)
            store(inputs, recv_chunk, input_tensor)
            store(output_grads, recv_grad_chunk, output_grad)
            deallocate_output_tensor(output_tensor)

    # Cool-down: the remaining backwards.
    if not forward_only:
        if all_warmup and not state.is_pipeline_last_stage:
            output_grads[num_chunks - 1].append(comm.recv_backward(False))
        for k in range(num_steady, total):
            input_grad = backward_k(k)
            recv_grad_chunk = backward_receiver(k)
            output_grad = comm.send_backward_recv_backward(input_grad,
                                                           recv_grad_chunk is not None)
            store(output_grads, recv_grad_chunk, output_grad)
    grad_sync.close()
    return runner.finish()


# Names ------------------------------------------------------------------------------------------

SCHEDULES = {
    "gpipe": forward_backward_pipelining_gpipe,
    "1f1b": forward_backward_pipelining_without_interleaving,
    "interleaved_1f1b": forward_backward_pipelining_with_interleaving,
}
# SMP's --pipeline-schedule values; "interleaved" is SMP's 1F1B, not Megatron's interleaving.
_SMP_SCHEDULES = ("simple", "interleaved")
_VIRTUAL_FLAGS = ("--virtual-pipeline-model-parallel-size / "
                  "--num-layers-per-virtual-pipeline-stage")


def check_virtual_microbatches(num_microbatches: int, pipeline_size: int,
                               group_size: Optional[int] = None) -> None:
    """The virtual schedule walks microbatches in groups of `group_size` (Megatron's
    --microbatch-group-size-per-virtual-pipeline-stage, default pp): ConfigError for a count
    or group size it cannot run."""
    if group_size is None or group_size == pipeline_size:
        if num_microbatches % pipeline_size:
            raise ConfigError(
                f"the interleaved virtual-pipeline schedule needs the number of microbatches "
                f"({num_microbatches} = --global-batch-size / (--micro-batch-size x "
                f"data-parallel size)) to be a multiple of --pipeline-model-parallel-size "
                f"({pipeline_size}); change --global-batch-size or drop the virtual stages"
            )
        return
    # Chunk c + 1 of rank 0 takes microbatch j from rank pp - 1, which runs chunk c on it
    # pp - 1 steps after rank 0 did: a group (the distance between the two) shorter than
    # pp would wait on an input not yet produced, and so would a last group shorter than pp.
    if not pipeline_size <= group_size <= num_microbatches:
        raise ConfigError(
            f"--microbatch-group-size-per-virtual-pipeline-stage ({group_size}) must lie "
            f"between --pipeline-model-parallel-size ({pipeline_size}) and the number of "
            f"microbatches ({num_microbatches}) for the interleaved_1f1b schedule"
        )
    remainder = num_microbatches % group_size
    if 0 < remainder < pipeline_size:
        raise ConfigError(
            f"the interleaved_1f1b schedule's last group holds {remainder} microbatches "
            f"({num_microbatches} % --microbatch-group-size-per-virtual-pipeline-stage "
            f"{group_size}), fewer than --pipeline-model-parallel-size ({pipeline_size}); use "
            f"a group size that divides the {num_microbatches} microbatches or leaves at "
            f"least {pipeline_size}"
        )


def schedule_name(name: str, virtual_size: int) -> str:
    """The internal schedule for a --pipeline-schedule value and v virtual stages per rank.

    SMP's `simple` is `gpipe`; SMP's `interleaved` (the default) is `1f1b`, or
    `interleaved_1f1b` with v > 1. The internal names pass through, checked against v.
    Raises ConfigError for an unknown name or one that contradicts v.
    """
    if name == "simple":
        name = "gpipe"
    elif name == "interleaved":
        name = "interleaved_1f1b" if virtual_size > 1 else "1f1b"
    if name not in SCHEDULES:
        raise ConfigError(
            f"--pipeline-schedule must be one of {', '.join(_SMP_SCHEDULES + tuple(SCHEDULES))}"
            f", got {name!r}"
        )
    if virtual_size > 1 and name != "interleaved_1f1b":
        raise ConfigError(
            f"--pipeline-schedule {name} does not take virtual stages ({virtual_size} per "
            f"rank); use interleaved_1f1b (or SMP's interleaved, the default), or drop "
            f"{_VIRTUAL_FLAGS}"
        )
    if virtual_size <= 1 and name == "interleaved_1f1b":
        raise ConfigError(
            f"--pipeline-schedule interleaved_1f1b needs virtual stages ({_VIRTUAL_FLAGS} "
            "giving more than one per rank); without them use 1f1b or gpipe"
        )
    return name


def get_forward_backward_func(pipeline_model_parallel_size: int = 1,
                              schedule: str = "1f1b") -> Callable:
    """The schedule function for this layout.

    `schedule` is an internal name ("gpipe" | "1f1b" | "interleaved_1f1b"; see
    `schedule_name` for SMP's). One stage: gradient accumulation, whatever the name.
    Raises ConfigError for an unknown name.
    """
    if schedule not in SCHEDULES:
        raise ConfigError(
            f"unknown pipeline schedule {schedule!r}: the schedules are "
            f"{', '.join(SCHEDULES)} (SMP's --pipeline-schedule simple / interleaved map "
            "onto them through schedule_name)"
        )
    if pipeline_model_parallel_size == 1:
        return forward_backward_no_pipelining
    return SCHEDULES[schedule]


__all__ = [
    "ScheduleHooks",
    "forward_step",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_gpipe",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
    "get_schedule_table",
    "schedule_step",
    "interleaved_num_warmup",
    "schedule_name",
    "check_virtual_microbatches",
    "get_forward_backward_func",
]
