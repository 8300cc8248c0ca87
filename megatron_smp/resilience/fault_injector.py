"""Fault injection (--fault-injector-*, Megatron-LM main's flags and plan): users rehearse
their cluster's recovery, and the tests use it beside real signals.

The plan is drawn once on rank 0 from --fault-injector-seed and broadcast to every rank (one
collective, at the start of training or after iteration --fault-injector-delay-start-iteration):
which ranks fail (--fault-injector-ranks, or --fault-injector-num-ranks drawn from ranks
1..world-1), which fault (one of --fault-injector-fault-types, weighted by
--fault-injector-fault-probabilities) and when (--fault-injector-fault-delay seconds, or
--fault-injector-offset-seconds plus an exponential delay of mean
--fault-injector-mtti-seconds). On each chosen rank a timer thread then injects it:

    hang   the process stops itself with SIGSTOP (alive, silent: what the watchdog detects)
    crash  the process SIGKILLs itself (what torchrun's restart handles)
    slow   every later step of the rank takes --fault-injector-slow-factor times as long
           (it sleeps the difference after its forward and backward: a straggler)
    exception  the rank's next step raises RuntimeError (what --inprocess-restart recovers
           from; without it the process ends with the error)

Only the first restart attempt injects (TORCHELASTIC_RESTART_COUNT 0 or no torchrun, a SLURM job
not requeued, no in-process restart yet): the restarted job must be able to finish.
"""
from __future__ import annotations

import math
import os
import random
import signal
import sys
import threading
import time
from typing import Callable, List, Optional

from megatron_smp.config.resilience import FAULT_TYPES, ResilienceConfig


def draw_plan(config: ResilienceConfig, world_size: int) -> List[float]:
    """[world_size + 1]: per rank the index of its fault in FAULT_TYPES (NaN: none), then the
    delay in seconds. Rank 0 draws it (Megatron's order: ranks, fault, delay)."""
    rng = random.Random(config.fault_injector_seed)
    if config.fault_injector_ranks is not None:
        ranks = [int(r) for r in config.fault_injector_ranks.split(",")]
    else:
        ranks = rng.sample(range(1, world_size), k=config.fault_injector_num_ranks)
    types = [t.strip() for t in config.fault_injector_fault_types.split(",")]
    if config.fault_injector_fault_probabilities is not None:
        weights = [float(p) for p in config.fault_injector_fault_probabilities.split(",")]
    else:
        weights = [1.0] * len(types)
    fault = rng.choices(types, weights, k=1)[0]
    delay = config.fault_injector_fault_delay
    if delay is None:
        rate = 1.0 / config.fault_injector_mtti_seconds
        delay = (config.fault_injector_offset_seconds or 0.0) - math.log(1.0 - rng.random()) / rate
    plan = [math.nan] * world_size + [delay]
    for rank in ranks:
        plan[rank] = float(FAULT_TYPES.index(fault))
    return plan


class FaultInjector:
    """One rank's part of the plan. `arm(iteration)` is called before each training step on
    every rank (collective once, at the step where the plan is drawn); `after_compute(s)`
    after each step's forward and backward with their duration (the "slow" fault)."""

    def __init__(self, config: ResilienceConfig, rank: int, world_size: int, device,
                 log: Optional[Callable[[str], None]] = None) -> None:
        self.config, self.rank, self.world_size, self.device = config, rank, world_size, device
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        from megatron_smp.parallel_state import inprocess_attempt

        # Not after a restart: torchrun's, SLURM's requeue, or an in-process one.
        self.active = (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")
                       and os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0")
                       and inprocess_attempt() == 0)
        self.raise_pending = False
        self.planned = False
        self.fault: Optional[str] = None
        self.slow_factor = 1.0
        self._timer: Optional[threading.Timer] = None

    def _due(self, iteration: int) -> bool:
        start = self.config.fault_injector_delay_start_iteration
        # Megatron: the delay starts after iteration N completes (before step N + 1).
        return (iteration == 1) if start is None else (iteration == start + 1)

    def arm(self, iteration: int) -> None:
        if self.raise_pending:
            self.raise_pending = False
            raise RuntimeError(f"FAULT INJECTION: rank {self.rank} raises in iteration "
                               f"{iteration}")
        if self.planned or not self._due(iteration):
            return
        import torch
        import torch.distributed as dist

        self.planned = True
        plan = torch.tensor(draw_plan(self.config, self.world_size) if self.rank == 0
                            else [math.nan] * (self.world_size + 1),
                            dtype=torch.float64, device=self.device)
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast(plan, src=0)
        mine, delay = plan[self.rank].item(), plan[-1].item()
        if math.isnan(mine) or not self.active:
            return
        self.fault = FAULT_TYPES[int(mine)]
        self._log(f"FAULT INJECTION: rank {self.rank} will inject fault {self.fault} in "
                  f"{delay:.1f} s (iteration {iteration})")
        self._timer = threading.Timer(delay, self._inject)
        self._timer.daemon = True
        self._timer.start()

    def _inject(self) -> None:
        self._log(f"FAULT INJECTION: rank {self.rank} injects {self.fault} now "
                  f"(pid {os.getpid()})")
        sys.stdout.flush()
        sys.stderr.flush()
        if self.fault == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.fault == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.fault == "exception":
            self.raise_pending = True  # raised by the main thread, before its next step
        else:
            self.slow_factor = self.config.fault_injector_slow_factor

    def after_compute(self, seconds: float) -> None:
        if self.slow_factor > 1.0:
            time.sleep((self.slow_factor - 1.0) * seconds)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


__all__ = ["FaultInjector", "draw_plan"]
