"""What the ranks agree on after each step's backward: one all-reduce, at most one host read.

Between the backward and the optimizer step of every iteration the ranks must agree on
  * the NaN/Inf checks of --check-for-nan-in-loss-and-grad: how many ranks saw each;
  * the exit conditions of --exit-signal-handler and --exit-duration-in-mins: whether any
    rank received the signal, or ran past the duration;
  * with --calculate-per-token-loss, the unmasked tokens of the global batch;
  * the logged losses: the sum and count of each reported value over the data- and
    context-parallel ranks (the last pipeline stage's), shared with every rank.
Megatron issues one collective for each (and a host read per check); here they travel in one
float64 SUM all-reduce over the world, and the host reads the result once, only when some
value is needed there (the checks, the exits, the token count); the losses stay on the device
until the log line reads them.

Two choices make the losses exact and the same on every layout:
  * One rank per tensor-parallel group of the last pipeline stage (tensor-parallel rank 0)
    contributes the losses; the others add zeros. So one world-wide sum gives each
    data-parallel replica's losses to every rank, pipeline stages included (no broadcast from
    the last stage); the tensor-parallel ranks hold the same losses (the vocab-parallel cross
    entropy reduces its terms over them).
  * float32 values summed in float64 are exact (for values within 2^29 of each other in
    magnitude over at most 2^24 ranks), so the order of the additions -- the collective's
    algorithm, which elements share a chunk, the number of ranks -- cannot change a bit. The
    sum is rounded to float32 once, then divided as before: over two ranks that is float32's
    own a + b, bit for bit, and over more ranks it is the correctly rounded sum.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


def loss_keys(reports: Sequence[Dict[str, torch.Tensor]], pipeline_keys: Sequence[str],
              state) -> List[str]:
    """The reported values that are reduced: every key of the reports without pipeline
    parallelism, else `pipeline_keys` (the stages that compute no loss must know the layout
    of the reduction without seeing a report)."""
    if state.pp_size > 1 or not reports:
        return list(pipeline_keys)
    return sorted(reports[0])


def local_loss_sums(reports: Sequence[Dict[str, torch.Tensor]], keys: Sequence[str],
                    device: torch.device) -> torch.Tensor:
    """[len(keys), 2] float32 on `device`: for each key this rank's (sum, count) over its
    microbatches -- a two-element `[sum, count]` report (Megatron's, e.g. with
    --calculate-per-token-loss) is summed, any other report is averaged over the microbatches
    and counts 1. Zeros on a rank without reports (a pipeline stage before the last). No host
    sync."""
    if not reports:
        return torch.zeros(len(keys), 2, dtype=torch.float32, device=device)
    sums_and_counts = []
    for key in keys:
        per_microbatch = torch.stack([r[key].float().reshape(-1) for r in reports])
        if per_microbatch.shape[1] == 2:
            sums_and_counts.append(per_microbatch.sum(dim=0))
        else:
            mean = per_microbatch.mean()
            sums_and_counts.append(torch.stack([mean, torch.ones_like(mean)]))
    return torch.stack(sums_and_counts).to(device)


def contributes_losses(state) -> bool:
    """Whether this rank's losses enter the sum (see the module docstring)."""
    return state.tp_rank == 0 and state.pp_rank == state.pp_size - 1


def agree_on_step(
    state,
    reports: Sequence[Dict[str, torch.Tensor]],
    keys: Sequence[str],
    rank_counts: Optional[Dict[str, torch.Tensor]] = None,
    replica_sums: Optional[Dict[str, torch.Tensor]] = None,
) -> Tuple[Dict[str, List[float]], Dict[str, torch.Tensor]]:
    """One all-reduce over the world (none on one rank) of
      `rank_counts`   name -> (n,) values every rank adds (how many ranks saw something),
      `replica_sums`  name -> (n,) values summed over the data x context-parallel ranks of
                      the last stage, like the losses (e.g. the unmasked tokens),
      the losses      `keys` of `reports` (see `local_loss_sums`).
    Every rank must pass the same names, sizes and keys. Returns ({name: the summed values
    on the host} -- read with one host sync, none when both dicts are empty -- and {key: the
    loss, sum / count, a 0-dim float32 device tensor})."""
    rank_counts = rank_counts or {}
    replica_sums = replica_sums or {}
    device = state.device
    contributes = contributes_losses(state)
    sums = local_loss_sums(reports, keys, device)
    head = [value.reshape(-1).to(device=device, dtype=torch.float64)
            for value in rank_counts.values()]
    head += [value.reshape(-1).to(device=device, dtype=torch.float64) if contributes
             else torch.zeros(value.numel(), dtype=torch.float64, device=device)
             for value in replica_sums.values()]
    head_size = sum(part.numel() for part in head)
    parts = head + [sums.double().reshape(-1) if contributes else
                    torch.zeros(sums.numel(), dtype=torch.float64, device=device)]
    fused = torch.cat(parts)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(fused)
    host: Dict[str, List[float]] = {}
    if head_size:
        values = fused[:head_size].tolist()  # the step's one host read
        position = 0
        for name, value in list(rank_counts.items()) + list(replica_sums.items()):
            host[name] = values[position:position + value.numel()]
            position += value.numel()
    reduced = fused[head_size:].reshape(len(keys), 2).float()
    losses = reduced[:, 0] / reduced[:, 1].clamp(min=1.0)
    return host, dict(zip(keys, losses.unbind()))


__all__ = ["agree_on_step", "contributes_losses", "local_loss_sums", "loss_keys"]
