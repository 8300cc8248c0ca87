"""Learning-rate and weight-decay schedule, stepped once per successful iteration."""
from __future__ import annotations

import math
from typing import Any, Dict, List

from megatron_smp.config import ConfigError, OptimizerConfig

# The schedule's shape in a checkpoint: (state-dict key, the flags that set it).
SCHEDULE_FIELDS = (
    ("max_lr", "--lr"),
    ("min_lr", "--min-lr"),
    ("warmup_steps", "--lr-warmup-iters (or --lr-warmup-fraction)"),
    ("decay_steps", "--lr-decay-iters (default: --train-iters)"),
    ("decay_style", "--lr-decay-style"),
)


class OptimizerParamScheduler:
    """Linear warm-up from 0 to `lr`, then constant, linear or cosine decay to `min_lr`.

    Sets `group["lr"]` (times the group's `lr_mult`, default 1) and `group["weight_decay"]`
    (times `wd_mult`, default 1: no-decay groups carry 0) on every step.
    """

    def __init__(self, optimizer, config: OptimizerConfig, train_iters: int):
        self.optimizer = optimizer
        self.max_lr = config.lr
        self.min_lr = config.min_lr
        self.warmup_steps = config.lr_warmup_iters
        self.decay_steps = config.lr_decay_iters or train_iters
        self.decay_style = config.lr_decay_style
        self.weight_decay = config.weight_decay
        if self.min_lr > self.max_lr:
            raise ConfigError(f"--min-lr ({self.min_lr}) must not exceed --lr ({self.max_lr})")
        if self.warmup_steps > self.decay_steps:
            raise ConfigError(
                f"--lr-warmup-iters ({self.warmup_steps}) must not exceed --lr-decay-iters "
                f"({self.decay_steps})"
            )
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        if self.warmup_steps > 0 and self.num_steps <= self.warmup_steps:
            return self.max_lr * self.num_steps / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if self.num_steps > self.decay_steps:
            return self.min_lr
        progress = (self.num_steps - self.warmup_steps) / max(
            1, self.decay_steps - self.warmup_steps
        )
        if self.decay_style == "linear":
            coeff = 1.0 - progress
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * progress) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)

    def state_dict(self) -> Dict[str, Any]:
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "warmup_steps": self.warmup_steps,
            "decay_steps": self.decay_steps,
            "decay_style": self.decay_style,
            "num_steps": self.num_steps,
        }

    def load_state_dict(
        self,
        state: Dict[str, Any],
        *,
        override_opt_param_scheduler: bool = False,
        use_checkpoint_opt_param_scheduler: bool = False,
    ) -> List[str]:
        """Restore the position (`num_steps`) and reconcile the schedule's shape with the
        checkpoint's, as Megatron does: with `override_opt_param_scheduler` the command line's
        values stay, with `use_checkpoint_opt_param_scheduler` the checkpoint's replace them,
        and with neither a difference is a ConfigError naming each field and both flags.

        Returns one line per value that differed and was resolved by a flag, for the log. The
        saved values are equal on every rank, so every rank takes the same decision.
        """
        resolved, conflicts = [], []
        for key, flags in SCHEDULE_FIELDS:
            saved, current = state[key], getattr(self, key)
            if saved == current:
                continue
            difference = f"{flags}: checkpoint {saved!r}, command line {current!r}"
            if override_opt_param_scheduler:
                resolved.append(f"{difference}; using the command line's")
            elif use_checkpoint_opt_param_scheduler:
                setattr(self, key, saved)
                resolved.append(f"{difference}; using the checkpoint's")
            else:
                conflicts.append(difference)
        if conflicts:
            raise ConfigError(
                "the checkpoint's learning-rate schedule differs from the command line ("
                + "; ".join(conflicts)
                + "). Add --override-opt_param-scheduler to train with the command line's "
                "schedule, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's"
            )
        self.num_steps = int(state["num_steps"])
        self.step(0)
        return resolved
