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
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch


@dataclass
class ScheduleHooks:
    """What the training loop plugs into a schedule (Megatron keeps these on the config)."""

    # loss -> loss * loss_scale (fp16); None: no scaling.
    grad_scale_func: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    # Context manager that defers grad reduction (all but the last microbatch).
    no_sync_func: Optional[Callable[[], Any]] = None
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


def get_forward_backward_func(pipeline_model_parallel_size: int = 1, **_unused) -> Callable:
    """The schedule for this layout (pipelined schedules arrive with pipeline parallelism)."""
    if pipeline_model_parallel_size == 1:
        return forward_backward_no_pipelining
    raise NotImplementedError("pipeline-parallel schedules are not available yet")
