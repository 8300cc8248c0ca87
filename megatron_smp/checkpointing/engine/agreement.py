"""Small collective agreements used so that an error on one rank is raised on every rank."""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def collective_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """The device a tensor collective on `group` needs (the accelerator for NCCL)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_size_and_rank(group: Optional[dist.ProcessGroup]):
    if not is_distributed():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def global_ranks(group: Optional[dist.ProcessGroup]) -> List[int]:
    if not is_distributed():
        return [0]
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def raise_if_any_rank_failed(
    error: Optional[BaseException], group: Optional[dist.ProcessGroup], what: str
) -> None:
    """Collective: if `error` is set on any rank, raise on every rank, naming those ranks.

    Every rank gets the same message (the first failing rank's error), so a problem that only
    one rank can see -- a file it cannot read, a key it lacks -- never leaves peers waiting in
    the next collective.
    """
    from megatron_smp.checkpointing.engine.storage import CheckpointError

    if not is_distributed():
        if error is not None:
            raise error
        return
    size, _ = group_size_and_rank(group)
    flag = torch.tensor([0 if error is None else 1], device=collective_device(group))
    dist.all_reduce(flag, group=group)
    if int(flag.item()) == 0:
        return
    messages: List[Optional[str]] = [None] * size
    local = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(messages, local, group=group)
    ranks = global_ranks(group)
    failed = [ranks[i] for i, m in enumerate(messages) if m is not None]
    if isinstance(error, CheckpointError):
        raise error  # already names the file or key
    first = next(m for m in messages if m is not None)
    raise CheckpointError(f"{what} failed on rank(s) {failed}: {first}") from error
