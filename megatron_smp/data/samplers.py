"""Megatron-LM's pretraining sampler and the DataLoader built on it."""
from __future__ import annotations

from typing import Callable, Iterator, List, Optional

import torch


class MegatronPretrainingSampler:
    """Yields this data-parallel rank's micro-batch of every global micro-step, in order.

    Global micro-step k holds samples [consumed + k*m*d, consumed + (k+1)*m*d) for micro-batch
    m and d ranks; rank r gets its slice [r*m, (r+1)*m) of them. Starting from
    `consumed_samples` makes a resumed run continue with exactly the next batch.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        from megatron_smp.config import ConfigError

        if total_samples <= 0:
            raise ConfigError(f"the dataset has no samples ({total_samples})")
        if consumed_samples >= total_samples:
            raise ConfigError(
                f"consumed samples ({consumed_samples}) reach the dataset size "
                f"({total_samples}); raise --train-iters/--train-samples only with more data"
            )
        if micro_batch_size <= 0:
            raise ConfigError(f"--micro-batch-size must be positive, got {micro_batch_size}")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ConfigError(
                f"data-parallel rank {data_parallel_rank} outside [0, {data_parallel_size})"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // (
            self.micro_batch_times_data_parallel_size
        )

    def _local_slice(self, batch: List[int]) -> List[int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return batch[start : start + self.micro_batch_size]

    def __iter__(self) -> Iterator[List[int]]:
        step = self.micro_batch_times_data_parallel_size
        for start in range(self.consumed_samples, self.total_samples - step + 1, step):
            yield self._local_slice(list(range(start, start + step)))
        remainder = (self.total_samples - self.consumed_samples) % step
        if remainder and not self.drop_last:
            tail = list(range(self.total_samples - remainder, self.total_samples))
            local = self._local_slice(tail)
            if local:
                yield local


def build_pretraining_data_loader(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
    worker_init_fn: Optional[Callable[[int], None]] = None,
) -> Optional[torch.utils.data.DataLoader]:
    """A DataLoader yielding dicts of `[micro_batch_size, ...]` tensors for this DP rank.

    Returns None for a missing split (dataset None). `worker_init_fn(worker_id)` runs in each
    worker process (with num_workers > 0).
    """
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size,
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        worker_init_fn=worker_init_fn,
        # Each iter() draws the workers' base seed from this generator; from the default one
        # it would shift the dropout stream (the CPU generator on a CPU-only machine), and a
        # run resumed from a checkpoint, which restores that stream before building the
        # loaders, would no longer follow the uninterrupted run.
        generator=torch.Generator().manual_seed(0),
    )
