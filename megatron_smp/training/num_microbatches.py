"""The global batch size of each iteration: constant, or ramped up with --rampup-batch-size.

Megatron-LM's num_microbatches_calculator semantics: with `START INCREMENT SAMPLES` the
global batch starts at START and grows by INCREMENT every SAMPLES / ((GBS - START) /
INCREMENT) consumed samples, reaching --global-batch-size once more than SAMPLES samples
have been consumed. Megatron-LM main's --step-batch-size-schedule "THRESHOLD:BS ..." instead
uses BS from THRESHOLD consumed tokens on (thresholds are divided by --seq-length into samples,
as Megatron does; suffixes K, M, B, T multiply by 1e3 .. 1e12). A larger global batch means
more microbatches per step (the micro-batch size and data-parallel size stay). Pure
arithmetic: no collective, the same on every rank.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from megatron_smp.config import ConfigError, TrainingConfig

RAMPUP_FLAG = "--rampup-batch-size"
SCHEDULE_FLAG = "--step-batch-size-schedule"
_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_step_batch_size_schedule(text: str, seq_length: int) -> List[Tuple[int, int]]:
    """'0:768 250B:1536' -> [(0, 768), (250e9 // seq_length, 1536)]: (first sample, global
    batch) pairs sorted by threshold, which is given in tokens (Megatron-LM main's format)."""
    def number(value: str) -> int:
        value = value.strip().upper()
        scale = _SUFFIXES.get(value[-1:], 1)
        try:
            return int(float(value[:-1] if scale != 1 else value) * scale)
        except ValueError:
            raise ConfigError(f"{SCHEDULE_FLAG}: {value!r} is not a number (suffixes K M B T)")

    schedule = []
    for entry in text.replace(",", " ").split():
        if ":" not in entry:
            raise ConfigError(f"{SCHEDULE_FLAG}: entry {entry!r} is not THRESHOLD:BATCH_SIZE")
        threshold, batch_size = entry.split(":", 1)
        schedule.append((number(threshold) // seq_length, number(batch_size)))
    schedule.sort()
    if not schedule or schedule[0][0] != 0:
        raise ConfigError(f"{SCHEDULE_FLAG} {text!r}: the first threshold must be 0")
    for (before, _), (after, _) in zip(schedule, schedule[1:]):
        if after <= before:
            raise ConfigError(f"{SCHEDULE_FLAG} {text!r}: thresholds must be strictly "
                              f"increasing (in samples of --seq-length {seq_length})")
    if any(batch_size < 1 for _, batch_size in schedule):
        raise ConfigError(f"{SCHEDULE_FLAG} {text!r}: batch sizes must be positive")
    return schedule


class NumMicrobatchesCalculator:
    """Global batch size and number of microbatches as functions of the samples consumed.

    Raises ConfigError (before any collective) for a ramp-up Megatron cannot run either: a
    --train-iters run, increments that do not divide the difference to --global-batch-size,
    or a batch size on the way that --micro-batch-size x data-parallel size does not divide.
    """

    def __init__(self, training: TrainingConfig, data_parallel_size: int):
        self.micro_batch_size = training.micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = training.micro_batch_size * data_parallel_size
        self.schedule = None
        if training.step_batch_size_schedule is not None:
            self._init_schedule(training)
            return
        # Raises for a --global-batch-size the micro-batches cannot fill.
        training.num_microbatches(data_parallel_size)
        self.global_batch_size = (
            training.global_batch_size or self.micro_batch_times_data_parallel_size
        )
        self.rampup = training.rampup_batch_size
        if self.rampup is None:
            return
        if len(self.rampup) != 3:
            raise ConfigError(f"{RAMPUP_FLAG} takes three integers START INCREMENT SAMPLES, "
                              f"got {self.rampup}")
        start, increment, samples = (int(v) for v in self.rampup)
        if training.train_samples is None:
            raise ConfigError(
                f"{RAMPUP_FLAG} counts samples: give the run's length with --train-samples N "
                "instead of --train-iters (as Megatron-LM requires)"
            )
        if start < 1 or increment < 1 or samples < 1:
            raise ConfigError(f"{RAMPUP_FLAG} START INCREMENT SAMPLES must all be >= 1, got "
                              f"{start} {increment} {samples}")
        difference = self.global_batch_size - start
        if difference <= 0 or difference % increment:
            raise ConfigError(
                f"{RAMPUP_FLAG}: --global-batch-size ({self.global_batch_size}) minus START "
                f"({start}) must be a positive multiple of INCREMENT ({increment})"
            )
        self.start, self.increment, self.rampup_samples = start, increment, samples
        self.rampup_samples_per_increment = samples / (difference // increment)
        for batch_size in self._rampup_batch_sizes():
            if batch_size % self.micro_batch_times_data_parallel_size:
                raise ConfigError(
                    f"{RAMPUP_FLAG} reaches a global batch of {batch_size}, which "
                    f"--micro-batch-size ({self.micro_batch_size}) x data-parallel size "
                    f"({data_parallel_size}) = {self.micro_batch_times_data_parallel_size} "
                    "does not divide; choose START and INCREMENT as multiples of it"
                )

    def _init_schedule(self, training: TrainingConfig) -> None:
        for flag, value in (("--global-batch-size", training.global_batch_size),
                            (RAMPUP_FLAG, training.rampup_batch_size)):
            if value is not None:
                raise ConfigError(f"give one of {SCHEDULE_FLAG} and {flag} (the schedule sets "
                                  "every global batch size)")
        if training.train_samples is None:
            raise ConfigError(
                f"{SCHEDULE_FLAG} counts consumed samples: give the run's length with "
                "--train-samples N (and the learning-rate lengths with --lr-*-samples) "
                "instead of --train-iters"
            )
        self.schedule = parse_step_batch_size_schedule(training.step_batch_size_schedule,
                                                       training.seq_length)
        self.rampup = None
        # Megatron's calculator reports the last entry as the global batch size.
        self.global_batch_size = self.schedule[-1][1]
        self._check_divisible(self.schedule[0][1])

    def _scheduled_batch_size(self, consumed_samples: int) -> int:
        return [bs for threshold, bs in self.schedule if consumed_samples >= threshold][-1]

    def _check_divisible(self, batch_size: int) -> None:
        if batch_size % self.micro_batch_times_data_parallel_size:
            raise ConfigError(
                f"{SCHEDULE_FLAG} reaches a global batch of {batch_size}, which "
                f"--micro-batch-size ({self.micro_batch_size}) x data-parallel size "
                f"({self.data_parallel_size}) = {self.micro_batch_times_data_parallel_size} "
                "does not divide"
            )

    def _rampup_batch_sizes(self) -> List[int]:
        """The batch sizes the ramp-up phase actually uses, in order (repeats kept)."""
        sizes, consumed = [], 0
        while consumed <= self.rampup_samples:
            sizes.append(self.global_batch_size_at(consumed))
            consumed += sizes[-1]
        return sizes

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch size of the iteration that starts after `consumed_samples`."""
        if self.schedule is not None:
            # Megatron checks divisibility when an entry is reached, not before: early entries
            # may predate a change of the data-parallel size. Every rank computes the same.
            batch_size = self._scheduled_batch_size(consumed_samples)
            self._check_divisible(batch_size)
            return batch_size
        if self.rampup is None or consumed_samples > self.rampup_samples:
            return self.global_batch_size
        steps = int(consumed_samples / self.rampup_samples_per_increment)
        return self.start + steps * self.increment

    def num_microbatches_at(self, consumed_samples: int) -> int:
        """Microbatches per data-parallel rank in the iteration after `consumed_samples`."""
        return self.global_batch_size_at(consumed_samples) // (
            self.micro_batch_times_data_parallel_size
        )

    def microbatch_counts(self) -> List[int]:
        """Every number of microbatches the run uses (for schedule checks)."""
        if self.schedule is not None:
            sizes = [bs for _, bs in self.schedule]
        else:
            sizes = self._rampup_batch_sizes() if self.rampup is not None else []
        return sorted({s // self.micro_batch_times_data_parallel_size
                       for s in sizes + [self.global_batch_size]})

    def train_iters(self, train_iters: Optional[int], train_samples: Optional[int]) -> int:
        """The number of iterations: --train-iters, or derived from --train-samples as
        Megatron's update_train_iters does (a partial last batch is dropped)."""
        if train_iters:
            return train_iters
        if self.schedule is not None:
            # Megatron-LM main's update_train_iters: whole batches until train_samples is
            # reached, the last one possibly past it.
            iterations = consumed = 0
            while consumed < train_samples:
                consumed += self._scheduled_batch_size(consumed)
                iterations += 1
            return iterations
        if self.rampup is None:
            return train_samples // self.global_batch_size
        iterations = consumed = 0
        while consumed <= self.rampup_samples and consumed <= train_samples:
            consumed += self.global_batch_size_at(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations


__all__ = ["NumMicrobatchesCalculator", "parse_step_batch_size_schedule"]
