"""The checkpoint contract: what a training run hands to `checkpointing.loop` (never the run
itself), and what a load gives back.

    record = CheckpointRecord(configs, state, model, optimizer, scheduler, progress, ...)
    loop.save(record)     # reads the record
    loop.load(record)     # fills model / optimizer / scheduler in place, and replaces
                          # record.progress, record.lora_base and record.rerun
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

if TYPE_CHECKING:  # types only: checkpointing never imports the training layer
    from megatron_smp.parallel_state import ParallelState
    from megatron_smp.config import Configs

# Counters a checkpoint carries (Megatron's names, also the checkpoint's keys).
PROGRESS_KEYS = ("iteration", "consumed_train_samples", "skipped_iterations", "nan_iterations")


@dataclasses.dataclass
class Progress:
    """How far a run has come: iterations done, samples consumed, iterations whose update was
    skipped (fp16 overflow) and iterations with a NaN/Inf loss."""

    iteration: int = 0
    consumed_train_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0

    def as_dict(self) -> Dict[str, int]:
        return {key: int(getattr(self, key)) for key in PROGRESS_KEYS}


# (directory, iteration) of a LoRA run's frozen base model.
LoraBase = Tuple[str, int]
# (iteration, device identity, whether an --error-injection-rate error was injected) that
# --rerun-mode validate_results reruns after a resume.
RerunPosition = Tuple[int, int, int]


@dataclasses.dataclass
class CheckpointRecord:
    """The parts of a run a checkpoint saves and restores, and the facts that shape it."""

    configs: "Configs"
    state: "ParallelState"
    model: List[torch.nn.Module]  # this rank's model chunks
    optimizer: Any  # megatron_smp.optimizer's wrapper (state_dict / reload_model_params)
    scheduler: Any  # OptimizerParamScheduler
    progress: Progress
    # Set: this LoRA run saves small checkpoints (adapters only, the base named); None: whole.
    lora_base: Optional[LoraBase] = None
    # --rerun-mode validate_results: whether saves and loads carry the rerun position, and
    # the position a save writes (None: nothing to rerun).
    validates_results: bool = False
    rerun: Optional[RerunPosition] = None
    # Told (iteration, consumed samples, asynchronous) after each save (--log-progress).
    on_saved: Optional[Callable[[int, int, bool], None]] = None

    @property
    def iteration(self) -> int:
        return self.progress.iteration


__all__ = ["CheckpointRecord", "LoraBase", "PROGRESS_KEYS", "Progress", "RerunPosition"]
