"""Resilience at scale: a rank that hangs or slows down is detected, named and recovered
from. One object, `Resilience`, is what a training loop calls around its steps:

    watchdog.py        --enable-ft-package: heartbeats and section timeouts, the hang report,
                       exit with HANG_EXIT_CODE for torchrun / SLURM to restart the job
    inprocess.py       --inprocess-restart: a failed run restarts inside the same processes
    fault_injector.py  --fault-injector-*: hang / crash / slow faults at a chosen time
    straggler.py       --log-straggler: per-rank step times, the slowest and fastest named
    replicas.py        --fault-tolerance: replica groups over torchft that leave and rejoin
                       the job (built by the Trainer, not by `Resilience`)
The typed flags are megatron_smp.config.ResilienceConfig.

Each part is off unless its flags are given; `build_resilience` returns None when all are.
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Optional

from megatron_smp.config import ResilienceConfig
from megatron_smp.resilience.fault_injector import FaultInjector
from megatron_smp.resilience.inprocess import InProcessRestart, RunController, active_controller
from megatron_smp.resilience.straggler import STRAGGLER_THRESHOLD, StragglerDetector
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
    around each training step, `compute_finished()` when its forward and backward are done
    (the gradient reduction starts), `checkpointing()` around each save, `phase(name)`
    around a phase outside the step (RL's rollouts), `data(iterator)` on the training data,
    `log_interval(iteration, print, add_scalar)` at each log line (collective with
    --log-straggler), `close()` at the end of the run."""

    def __init__(self, config: ResilienceConfig, state, save_dir: Optional[str] = None,
                 log=None) -> None:
        self.config = config
        self.watchdog: Optional[ProgressWatchdog] = None
        if config.enable_ft_package:
            controller = active_controller() if config.inprocess_restart else None
            interrupt = (None if controller is None else
                         functools.partial(controller.interrupt, attempt=controller.attempt))
            self.watchdog = ProgressWatchdog(
                config, state.rank, state.world_size, job_store(config.ft_rank_heartbeat_timeout),
                save_dir=save_dir, log=log, interrupt=interrupt)
            if state.rank == 0:
                (log or print)(f"FT: progress watchdog on, timeouts "
                               f"{self.watchdog.describe_timeouts()}, heartbeat timeout "
                               f"{config.ft_rank_heartbeat_timeout:.1f} s")
        self.faults = (FaultInjector(config, state.rank, state.world_size, state.device, log)
                       if config.fault_injection else None)
        self.stragglers = (StragglerDetector(config, state.rank, state.world_size,
                                             state.device, log)
                           if config.log_straggler else None)

    def before_step(self, iteration: int) -> None:
        if self.watchdog is not None:
            self.watchdog.step_started(iteration)
        if self.faults is not None:
            self.faults.arm(iteration)  # collective once: the plan is broadcast
        if self.stragglers is not None:
            self.stragglers.step_started(iteration)
        self._step_start = time.perf_counter()
        self._computed = False

    def compute_finished(self) -> None:
        if self._computed:  # a rerun of the step (--rerun-mode) is not timed again
            return
        self._computed = True
        if self.faults is not None:
            self.faults.after_compute(time.perf_counter() - self._step_start)
        if self.stragglers is not None:
            self.stragglers.compute_finished()

    def after_step(self, iteration: int) -> None:
        if self.watchdog is not None:
            self.watchdog.step_finished()
        if self.stragglers is not None:
            self.stragglers.step_finished()

    def log_interval(self, iteration: int, print_line, add_scalar=None) -> None:
        """At a log line: the straggler report (collective over the world)."""
        if self.stragglers is not None:
            for line in self.stragglers.report(iteration, add_scalar):
                print_line(line)

    @contextlib.contextmanager
    def phase(self, name: str):
        """A phase of the loop outside the training step (one of straggler.PHASES, e.g.
        train_rl.py's "rollout"): timed for the straggler report, marked for the watchdog,
        and stretched by an injected "slow" fault like the step's forward and backward."""
        if self.watchdog is not None:
            self.watchdog.mark(name)
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        if self.faults is not None:
            self.faults.after_compute(seconds)
        if self.stragglers is not None:
            self.stragglers.phase_finished(name, time.perf_counter() - start)
        if self.watchdog is not None:
            self.watchdog.mark(f"{name} done")

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

    def close(self, failed: bool = False) -> None:
        """The run ended (`failed`: with an exception; the watchdog learns no timeouts)."""
        if self.watchdog is not None:
            self.watchdog.close(failed=failed)
        if self.faults is not None:
            self.faults.close()
        if self.stragglers is not None:
            self.stragglers.close()


def build_resilience(config: ResilienceConfig, state, save_dir: Optional[str] = None,
                     log=None) -> Optional[Resilience]:
    """The run's resilience services (collective-free), or None when every flag is off."""
    if config is None or not (config.enable_ft_package or config.fault_injection
                              or config.log_straggler):
        return None
    return Resilience(config, state, save_dir, log)


__all__ = ["HANG_EXIT_CODE", "STRAGGLER_THRESHOLD", "InProcessRestart", "Resilience",
           "RunController", "ResilienceConfig", "build_resilience",
           "format_thread_stack", "job_store"]
