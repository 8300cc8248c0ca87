"""Gradient norm and clipping across every shard of the model.

The caller passes the grads *this rank is responsible for* (each element of the model counted
by exactly one rank: TP-replicated params only on tp rank 0, tied-embedding copies once,
distributed-optimizer shards once) together with the groups over which the partial sums are
added (tp x pp, and the DP group when grads are sharded over DP).
"""
from __future__ import annotations

import math
from typing import List, Sequence

import torch
import torch.distributed as dist

from megatron_smp.tensor_parallel.utils import param_is_not_tensor_parallel_duplicate


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    """The last stage's copy of a tied embedding is marked `shared=True` and not counted."""
    return not getattr(param, "shared", False)


def _reduce(value: torch.Tensor, groups: Sequence, op) -> torch.Tensor:
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(value, op=op, group=group)
    return value


def grad_norm_power(grads: List[torch.Tensor], norm_type: float, groups: Sequence,
                    device: torch.device) -> torch.Tensor:
    """sum |g|^p over `grads` and `groups` (max |g| for p = inf), as a 1-element fp32 tensor
    on `device`, the process group's device (the state's): grads may live elsewhere (on the
    CPU under FSDP2's cpu_offload) or be absent on this rank, and NCCL reduces CUDA only."""
    value = torch.zeros(1, dtype=torch.float32, device=device)
    grads = [g for g in grads if g.numel()]
    if norm_type == math.inf:
        if grads:
            local = torch.stack([g.abs().max().float().to(device) for g in grads]).max()
            value[0] = local
        return _reduce(value, groups, dist.ReduceOp.MAX)
    if grads:
        norms = torch._foreach_norm(grads, norm_type)
        value += torch.stack(norms).float().pow(norm_type).sum().to(device)
    return _reduce(value, groups, dist.ReduceOp.SUM)


def get_grad_norm_fp32(grads_for_norm: List[torch.Tensor], groups: Sequence,
                       device: torch.device, norm_type: float = 2.0) -> float:
    """Norm of the whole model's gradient. grads_for_norm: this rank's share, any shapes;
    `device`: where the partial sums are reduced (see grad_norm_power)."""
    value = grad_norm_power(grads_for_norm, norm_type, groups, device)
    if norm_type == math.inf:
        return value.item()
    return value.item() ** (1.0 / norm_type)


def clip_grad_by_total_norm_fp32(
    grads: List[torch.Tensor], max_norm: float, total_norm: float
) -> None:
    """Scale `grads` in place so the total norm is at most `max_norm` (as torch does)."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def count_zeros_fp32(grads: List[torch.Tensor], groups: Sequence, device: torch.device) -> int:
    """Number of zero grad elements over this rank's share, summed over `groups` on `device`
    (see grad_norm_power)."""
    value = torch.zeros(1, dtype=torch.float32, device=device)
    for grad in grads:
        value += (grad.numel() - torch.count_nonzero(grad)).to(device)
    return int(_reduce(value, groups, dist.ReduceOp.SUM).item())
