"""Megatron's --calculate-per-token-loss: the loss of a step is the sum of the per-token
losses of the whole global batch over its number of unmasked tokens (across microbatches and
data/context-parallel ranks), not the mean of per-microbatch means.

Each microbatch back-propagates its masked *sum* and reports `[sum, count]` (Megatron's
reporting convention, which `pretrain` also reduces as sum / count). The schedule still
divides each backward by the number of microbatches and DDP still averages over dp x cp, so
once the grads are reduced they are multiplied by dp x cp x microbatches / (tokens of the
global batch), which makes them the grad of the per-token mean (MoE auxiliary losses,
entering backward at 1 / microbatches, end up divided by the token count as in Megatron).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from megatron_smp.config import ConfigError


def masked_sum_and_count(losses: torch.Tensor,
                         loss_mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(loss to back-propagate: the masked sum, report `[sum, count]` (2,) fp32) from
    per-token `losses` and `loss_mask` of any one shape (e.g. [b, s], or [b, s/cp] with
    context parallelism: each rank its own tokens)."""
    losses = losses.float().reshape(-1)
    loss_mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses * loss_mask)
    return loss_sum, torch.stack([loss_sum.detach(), loss_mask.sum()])


def _count_key(reports: Sequence[Dict[str, torch.Tensor]]) -> str:
    keys = [k for k in sorted(reports[0]) if reports[0][k].numel() == 2]
    return keys[0] if keys else ""


def local_token_count(reports: Sequence[Dict[str, torch.Tensor]],
                      device: torch.device) -> torch.Tensor:
    """(1,) float64 on `device`: the unmasked tokens of this rank's microbatches (the counts
    of their first `[sum, count]` report), -1 when the loss reports no two-element value, 0
    without reports (a pipeline stage before the last). No host sync: the ranks sum it in the
    step's agreement (`training.step_agreement`, over data x context-parallel ranks)."""
    if not reports:
        return torch.zeros(1, dtype=torch.float64, device=device)
    key = _count_key(reports)
    if not key:
        return torch.full((1,), -1.0, dtype=torch.float64, device=device)
    counts = torch.stack([r[key].reshape(-1)[1] for r in reports]).double()
    return counts.sum().reshape(1).to(device)


def scale_grads_to_per_token_mean(model_chunks: List[torch.nn.Module], tokens: float, state,
                                  num_microbatches: int) -> None:
    """Turn the reduced grads of per-microbatch sums into the grad of the global batch's
    per-token mean; `tokens`: the unmasked tokens of the global batch (the ranks' sum of
    `local_token_count`). Raises ConfigError (on every rank: they all see the same sum) when
    the loss reports no `[sum, count]`. Call after the schedule's grad sync."""
    if tokens < 0:
        raise ConfigError(
            "--calculate-per-token-loss needs the loss function to report [sum, count] (see "
            "megatron_smp.training.per_token_loss.masked_sum_and_count); the forward step's "
            "loss function reports no two-element value"
        )
    if tokens == 0:  # every token masked: the grads are zero already
        return
    factor = state.dp_cp_size * num_microbatches / tokens
    for chunk in model_chunks:
        buffers = getattr(chunk, "param_and_grad_buffers", None)
        if buffers is None:  # FSDP2: each param's reduced grad shard (averaged over dp too)
            for param in chunk.parameters():
                if param.grad is not None:
                    param.grad.mul_(factor)
            continue
        for buffer in buffers:
            buffer.grad_data.mul_(factor)


__all__ = ["local_token_count", "masked_sum_and_count", "scale_grads_to_per_token_mean"]
