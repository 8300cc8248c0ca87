"""Resilience at scale: a rank that hangs or slows down is detected, named and recovered
from. One object, `Resilience`, is what a training loop calls around its steps:

    watchdog.py        --enable-ft-package: heartbeats and section timeouts, the hang report,
                       exit with HANG_EXIT_CODE for torchrun / SLURM to restart the job
    fault_injector.py  --fault-injector-*: hang / crash / slow faults at a chosen time
    straggler.py       --log-straggler: per-rank step times, the slowest and fastest named

Each part is off unless its flags are given; `build_resilience` returns None when all are.
"""
from __future__ import annotations

import contextlib
from typing import Optional

from megatron_smp.config import ResilienceConfig
from megatron_smp.resilience.watchdog import (
    HANG_EXIT_CODE, ProgressIterator, ProgressWatchdog, format_thread_stack,
)


def job_store(timeout_s: float):
    """A connection of this process's own to the store of the default process group (under
    torchrun: the current restart attempt's namespace), under the prefix "resilience/". The
    monitor thread uses it alone, so it never waits behind the main thread's store calls."""
    import datetime

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store().clone()
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore("resilience", store)


class Resilience:
    """What a Trainer's loop calls: `before_step(iteration)` / `after_step(iteration)`
    around each training step, `checkpointing()` around each save, `data(iterator)` on the
    training data, `close()` at the end of the run."""

    def __init__(self, config: ResilienceConfig, state, save_dir: Optional[str] = None,
                 log=None) -> None:
        self.config = config
        self.watchdog: Optional[ProgressWatchdog] = None
        if config.enable_ft_package:
            self.watchdog = ProgressWatchdog(
                config, state.rank, state.world_size, job_store(config.ft_rank_heartbeat_timeout),
                save_dir=save_dir, log=log)
            if state.rank == 0:
                (log or print)(f"FT: progress watchdog on, timeouts "
                               f"{self.watchdog.describe_timeouts()}, heartbeat timeout "
                               f"{config.ft_rank_heartbeat_timeout:.1f} s")

    def before_step(self, iteration: int) -> None:
        if self.watchdog is not None:
            self.watchdog.step_started(iteration)

    def after_step(self, iteration: int) -> None:
        if self.watchdog is not None:
            self.watchdog.step_finished()

    @contextlib.contextmanager
    def checkpointing(self):
        if self.watchdog is not None:
            self.watchdog.checkpointing_started()
        try:
            yield
        finally:
            if self.watchdog is not None:
                self.watchdog.checkpointing_finished()

    def data(self, iterator):
        """The training data iterator, its waits marked for the watchdog."""
        if self.watchdog is None or iterator is None:
            return iterator
        return ProgressIterator(iterator, self.watchdog)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()


def build_resilience(config: ResilienceConfig, state, save_dir: Optional[str] = None,
                     log=None) -> Optional[Resilience]:
    """The run's resilience services (collective-free), or None when every flag is off."""
    if config is None or not config.enable_ft_package:
        return None
    return Resilience(config, state, save_dir, log)


__all__ = ["HANG_EXIT_CODE", "Resilience", "ResilienceConfig", "build_resilience",
           "format_thread_stack", "job_store"]
