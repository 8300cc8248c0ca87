"""The language-model loss when each rank of the context-parallel group holds 1/cp of the
tokens (Megatron's loss under CP)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron_smp.tensor_parallel.mappings import group_size


def masked_mean_over_context_parallel(
    losses: torch.Tensor, loss_mask: torch.Tensor, cp_group
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(loss to back-propagate, loss to report) from this rank's per-token `losses` and
    `loss_mask` [b, s/cp] (any shape, same numel); `cp_group` None: no context parallelism.

    The reported loss is the masked mean over the whole sequences: sums of masked losses and
    of token counts are all-reduced over `cp_group`. The one to back-propagate is this rank's
    masked sum over the whole count, times cp: `DistributedDataParallel` averages grads over
    dp x cp, so the cp ranks' grads then add up to the grad of the whole-sequence mean, the
    one a run without context parallelism computes.
    """
    losses = losses.float().reshape(-1)
    loss_mask = loss_mask.reshape(-1).float()
    local_sum = torch.sum(losses * loss_mask)
    cp_size = 1 if cp_group is None else group_size(cp_group)
    if cp_size == 1:
        loss = local_sum / loss_mask.sum().clamp(min=1.0)
        return loss, loss.detach()
    totals = torch.stack([local_sum.detach(), loss_mask.sum()])
    dist.all_reduce(totals, group=cp_group)
    count = totals[1].clamp(min=1.0)
    return local_sum / count * cp_size, totals[0] / count


__all__ = ["masked_mean_over_context_parallel"]
