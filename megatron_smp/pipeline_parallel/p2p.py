"""Point-to-point communication between neighbouring pipeline stages.

Activations travel forward (to `state.pp_next_rank`), their grads backward (to
`state.pp_prev_rank`). Both neighbours wrap around the pipeline group, which the virtual
(interleaved) schedule uses: the last rank's chunk c feeds the first rank's chunk c + 1.

Every exchange of one schedule step goes out as one `dist.batch_isend_irecv` on
`state.pp_group` (global ranks). Shapes are known in advance (`tensor_shape`, the shape of
the hidden states a stage emits: [s/tp (sequence parallel) / cp, b, h]) so no shape
handshake is needed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

# Tags keep activations and grads apart on backends that honour them (gloo). Backends that
# ignore tags (NCCL) match sends to receives per peer in posting order, so `_communicate`
# also posts in one fixed order: activations first, grads second. With two stages both
# neighbours are the same rank and this order is what keeps the two streams from crossing.
_ACTIVATION_TAG = 0
_GRAD_TAG = 1


@dataclass
class PipelineCommunicator:
    """Sends and receives one microbatch's tensors between neighbouring stages.

    Args:
        state: `ParallelState` (pp_group, pp_prev_rank, pp_next_rank).
        tensor_shape: shape of every activation and grad exchanged, e.g. [s, b, h].
        dtype: their dtype (the params' dtype).
        timeline: optional `PipelineTimeline` recording each exchange as a span.
    """

    state: object
    tensor_shape: Sequence[int]
    dtype: torch.dtype
    timeline: Optional[object] = None
    # Set by forward-only schedules: received activations need no autograd graph.
    requires_grad: bool = True

    def _buffer(self, requires_grad: bool) -> torch.Tensor:
        return torch.empty(
            tuple(self.tensor_shape), dtype=self.dtype, device=self.state.device,
            requires_grad=requires_grad,
        )

    def _communicate(
        self,
        send_next: Optional[torch.Tensor] = None,
        send_prev: Optional[torch.Tensor] = None,
        recv_prev: bool = False,
        recv_next: bool = False,
        name: str = "p2p",
    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """One batched exchange. Returns (tensor from prev stage, tensor from next stage)."""
        state = self.state
        group = state.pp_group
        received_prev = self._buffer(self.requires_grad) if recv_prev else None
        received_next = self._buffer(False) if recv_next else None
        ops: List[dist.P2POp] = []
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, _wire(send_next, self), state.pp_next_rank,
                                  group, _ACTIVATION_TAG))
        if received_prev is not None:
            ops.append(dist.P2POp(dist.irecv, received_prev, state.pp_prev_rank, group,
                                  _ACTIVATION_TAG))
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, _wire(send_prev, self), state.pp_prev_rank,
                                  group, _GRAD_TAG))
        if received_next is not None:
            ops.append(dist.P2POp(dist.irecv, received_next, state.pp_next_rank, group,
                                  _GRAD_TAG))
        if not ops:
            return None, None
        span = self.timeline.span(name, "comm") if self.timeline is not None else _no_span()
        with span:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        return received_prev, received_next

    # Non-virtual schedules -------------------------------------------------------------------
    def recv_forward(self, is_first_stage: bool) -> Optional[torch.Tensor]:
        """Activation from the previous stage ([tensor_shape]); None on the first stage."""
        if is_first_stage:
            return None
        return self._communicate(recv_prev=True, name="recv_forward")[0]

    def send_forward(self, output_tensor: Optional[torch.Tensor], is_last_stage: bool) -> None:
        if not is_last_stage:
            self._communicate(send_next=output_tensor, name="send_forward")

    def recv_backward(self, is_last_stage: bool) -> Optional[torch.Tensor]:
        """Grad of this stage's output from the next stage; None on the last stage."""
        if is_last_stage:
            return None
        return self._communicate(recv_next=True, name="recv_backward")[1]

    def send_backward(self, input_grad: Optional[torch.Tensor], is_first_stage: bool) -> None:
        if not is_first_stage:
            self._communicate(send_prev=input_grad, name="send_backward")

    def send_forward_recv_backward(
        self, output_tensor: Optional[torch.Tensor], is_last_stage: bool
    ) -> Optional[torch.Tensor]:
        if is_last_stage:
            return None
        return self._communicate(
            send_next=output_tensor, recv_next=True, name="send_forward_recv_backward"
        )[1]

    def send_backward_recv_forward(
        self, input_grad: Optional[torch.Tensor], is_first_stage: bool
    ) -> Optional[torch.Tensor]:
        if is_first_stage:
            return None
        return self._communicate(
            send_prev=input_grad, recv_prev=True, name="send_backward_recv_forward"
        )[0]

    # Virtual schedule: the caller decides what to send and receive ---------------------------
    def send_forward_recv_forward(
        self, output_tensor: Optional[torch.Tensor], recv_prev: bool
    ) -> Optional[torch.Tensor]:
        return self._communicate(
            send_next=output_tensor, recv_prev=recv_prev, name="send_forward_recv_forward"
        )[0]

    def send_backward_recv_backward(
        self, input_grad: Optional[torch.Tensor], recv_next: bool
    ) -> Optional[torch.Tensor]:
        return self._communicate(
            send_prev=input_grad, recv_next=recv_next, name="send_backward_recv_backward"
        )[1]

    def send_forward_backward_recv_forward_backward(
        self,
        output_tensor: Optional[torch.Tensor],
        input_grad: Optional[torch.Tensor],
        recv_prev: bool,
        recv_next: bool,
    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        return self._communicate(
            send_next=output_tensor, send_prev=input_grad, recv_prev=recv_prev,
            recv_next=recv_next, name="send_forward_backward_recv_forward_backward",
        )


def _wire(tensor: torch.Tensor, communicator: PipelineCommunicator) -> torch.Tensor:
    """The tensor as it goes on the wire: detached, contiguous, checked against the shape."""
    if tuple(tensor.shape) != tuple(communicator.tensor_shape):
        raise RuntimeError(
            f"pipeline stage produced a tensor of shape {tuple(tensor.shape)} but the "
            f"schedule exchanges {tuple(communicator.tensor_shape)} ([seq/tp if sequence "
            "parallel, / cp, micro batch, hidden]); check --seq-length, --micro-batch-size "
            "and --hidden-size"
        )
    return tensor.detach().to(communicator.dtype).contiguous()


class _no_span:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def deallocate_output_tensor(output_tensor: Optional[torch.Tensor]) -> None:
    """Free the storage of a stage output that has been sent (Megatron's trick).

    The next stage owns a copy; this stage only needs the output's autograd node for the
    backward, not its values. Replacing `.data` by a one-element tensor drops the [s, b, h]
    buffer while keeping `grad_fn`; `backward_output_tensor` then runs the backward without
    the shape check that `torch.autograd.backward` would make. A view is left alone: freeing
    it would not release its base.
    """
    if output_tensor is None or output_tensor._base is not None:
        return
    output_tensor.data = torch.empty((1,), device=output_tensor.device, dtype=output_tensor.dtype)


def backward_output_tensor(
    output_tensor: torch.Tensor, grad_output: Optional[torch.Tensor]
) -> None:
    """`torch.autograd.backward(output_tensor, grad_output)` that tolerates a freed output.

    The autograd engine itself only needs the grad's shape to match the graph's recorded
    output shape; the public wrapper also compares it with `output_tensor.shape`, which
    `deallocate_output_tensor` has shrunk to one element.
    """
    if grad_output is None:
        if output_tensor.numel() != 1:
            raise RuntimeError("backward of a non-scalar stage output needs its grad")
        grad_output = torch.ones_like(output_tensor, memory_format=torch.preserve_format)
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output_tensor,),
        grad_tensors=(grad_output,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


__all__ = ["PipelineCommunicator", "deallocate_output_tensor", "backward_output_tensor"]
