"""Learning-rate and weight-decay schedule, stepped once per successful iteration.

As in Megatron-LM, the schedule counts samples, not iterations: each successful step advances
it by that iteration's global batch size (which grows under --rampup-batch-size), and the
iteration-based flags are converted to samples with the (final) --global-batch-size.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from megatron_smp.config import ConfigError, OptimizerConfig

# The schedule's shape in a checkpoint: (state-dict key, the flags that set it). The keys are
# Megatron-LM's, so its checkpoints' schedules read the same way.
SCHEDULE_FIELDS = (
    ("max_lr", "--lr"),
    ("min_lr", "--min-lr"),
    ("lr_warmup_steps",
     "--lr-warmup-iters/--lr-warmup-samples (or --lr-warmup-fraction), in samples"),
    ("lr_decay_steps",
     "--lr-decay-iters/--lr-decay-samples (default: --train-iters/--train-samples), in samples"),
    ("lr_decay_style", "--lr-decay-style"),
)
# Ours only (Megatron-LM does not save them): checked when the checkpoint has them.
WSD_FIELDS = (
    ("wsd_decay_steps", "--lr-wsd-decay-iters/--lr-wsd-decay-samples, in samples"),
    ("lr_wsd_decay_style", "--lr-wsd-decay-style"),
)
# The weight-decay schedule (Megatron-LM's keys): checked when the checkpoint has them.
WD_FIELDS = (
    ("start_wd", "--start-weight-decay (constant: --weight-decay)"),
    ("end_wd", "--end-weight-decay (constant: --weight-decay)"),
    ("wd_incr_steps", "--train-iters x global batch size or --train-samples, in samples"),
    ("wd_incr_style", "--weight-decay-incr-style"),
)


def schedule_lengths(config: OptimizerConfig, train_iters: Optional[int],
                     train_samples: Optional[int], global_batch_size: int) -> Dict[str, Any]:
    """Warm-up, decay and WSD-annealing lengths in samples, as Megatron's
    `get_optimizer_param_scheduler` derives them: iteration counts times the global batch
    size for --train-iters runs, sample counts for --train-samples runs. --lr-warmup-fraction
    is a fraction of the decay length (a float, not rounded)."""
    if train_samples:
        decay = config.lr_decay_samples or train_samples
        warmup = config.lr_warmup_samples
        wsd = config.lr_wsd_decay_samples
    else:
        decay = (config.lr_decay_iters or train_iters) * global_batch_size
        warmup = config.lr_warmup_iters * global_batch_size
        wsd = (config.lr_wsd_decay_iters * global_batch_size
               if config.lr_wsd_decay_iters is not None else None)
    if config.lr_warmup_fraction is not None:
        warmup = config.lr_warmup_fraction * decay
    return {"lr_warmup_steps": warmup, "lr_decay_steps": decay, "wsd_decay_steps": wsd}


class OptimizerParamScheduler:
    """Linear warm-up from `--lr-warmup-init` to `--lr`, then constant, linear, cosine,
    inverse-square-root or WSD (warm-up, stable, decay) down to `--min-lr`.

    Sets `group["lr"]` and `group["weight_decay"]` (times the group's `wd_mult`, default 1:
    no-decay groups carry 0) on every step. A group with its own `max_lr` / `min_lr`
    (--decoupled-lr / --decoupled-min-lr: the embedding and output layer) follows the same
    shape between its own bounds; other groups are scaled by `lr_mult` (default 1).

    `train_iters` / `train_samples` give the default decay length and `global_batch_size`
    converts iteration counts to samples; with the default of 1 the schedule counts steps.
    """

    def __init__(self, optimizer, config: OptimizerConfig, train_iters: Optional[int] = None,
                 *, train_samples: Optional[int] = None, global_batch_size: int = 1):
        self.optimizer = optimizer
        self.init_lr = config.lr_warmup_init
        self.max_lr = float(config.lr)
        self.min_lr = config.min_lr
        lengths = schedule_lengths(config, train_iters, train_samples, global_batch_size)
        self.lr_warmup_steps = lengths["lr_warmup_steps"]
        self.lr_decay_steps = lengths["lr_decay_steps"]
        self.wsd_decay_steps = lengths["wsd_decay_steps"]
        self.lr_decay_style = config.lr_decay_style
        self.lr_wsd_decay_style = config.lr_wsd_decay_style
        # Megatron's weight-decay schedule (constant: --weight-decay at both ends).
        self.wd_incr_style = config.weight_decay_incr_style
        constant = self.wd_incr_style == "constant"
        self.start_wd = config.weight_decay if constant else config.start_weight_decay
        self.end_wd = config.weight_decay if constant else config.end_weight_decay
        self.wd_incr_steps = train_samples or (train_iters or 0) * global_batch_size
        if self.min_lr > self.max_lr:
            raise ConfigError(f"--min-lr ({self.min_lr}) must not exceed --lr ({self.max_lr})")
        if self.init_lr > self.max_lr:
            raise ConfigError(
                f"--lr-warmup-init ({self.init_lr}) must not exceed --lr ({self.max_lr})")
        if self.lr_decay_steps <= 0:
            raise ConfigError(f"the decay length ({self.lr_decay_steps} samples) must be > 0: "
                              "set --lr-decay-iters / --lr-decay-samples")
        # Megatron asserts warm-up < decay; a warm-up as long as the decay (a short test run
        # with the usual warm-up) is accepted here: it ends at --lr, then --min-lr follows.
        if self.lr_warmup_steps > self.lr_decay_steps:
            raise ConfigError(
                f"the warm-up ({self.lr_warmup_steps} samples, --lr-warmup-iters, "
                "--lr-warmup-samples or --lr-warmup-fraction) must not be longer than the "
                f"decay ({self.lr_decay_steps} samples, --lr-decay-iters or --lr-decay-samples)"
            )
        if self.lr_decay_style == "WSD":
            if self.wsd_decay_steps is None:
                raise ConfigError("--lr-decay-style WSD needs the length of its annealing "
                                  "phase: --lr-wsd-decay-iters N (or --lr-wsd-decay-samples N)")
            if not 0 < self.wsd_decay_steps <= self.lr_decay_steps:
                raise ConfigError(
                    f"--lr-wsd-decay-iters/--lr-wsd-decay-samples ({self.wsd_decay_steps} "
                    f"samples) must be > 0 and at most the decay length "
                    f"({self.lr_decay_steps} samples)"
                )
        self.num_steps = 0
        self.step(0)

    def get_lr(self, param_group: Optional[Dict[str, Any]] = None) -> float:
        """The learning rate of `param_group` (its own `max_lr` / `min_lr` if it has them)
        after `num_steps` samples: Megatron's OptimizerParamScheduler.get_lr."""
        group = param_group or {}
        max_lr = group.get("max_lr", self.max_lr)
        min_lr = group.get("min_lr", self.min_lr)
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * self.num_steps / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup_steps = max(self.lr_warmup_steps, 1)
            num_steps = max(self.num_steps, 1)
            return max(min_lr, max_lr * warmup_steps**0.5 / num_steps**0.5)
        decay_ratio = (self.num_steps - self.lr_warmup_steps) / (
            self.lr_decay_steps - self.lr_warmup_steps
        )
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        else:  # WSD: stable at max_lr until the last wsd_decay_steps samples, then anneal
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if self.num_steps <= anneal_start:
                coeff = 1.0
            else:
                ratio = (self.num_steps - anneal_start) / self.wsd_decay_steps
                style = self.lr_wsd_decay_style
                if style == "linear":
                    coeff = 1.0 - ratio
                elif style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
                elif style == "exponential":
                    coeff = 2.0 * math.pow(0.5, ratio) - 1.0
                else:  # minus_sqrt
                    coeff = 1.0 - math.sqrt(ratio)
        return min_lr + coeff * (max_lr - min_lr)

    def get_wd(self) -> float:
        """The weight decay after `num_steps` samples: Megatron's get_wd (from --start-weight-
        decay to --end-weight-decay, linear or cosine, over the run)."""
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = self.num_steps / self.wd_incr_steps
        coeff = ratio if self.wd_incr_style == "linear" else (
            0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0))
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def step(self, increment: int = 1) -> None:
        """Advance by `increment` samples (the iteration's global batch size)."""
        self.num_steps += increment
        weight_decay = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)

    def state_dict(self) -> Dict[str, Any]:
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "lr_decay_steps": self.lr_decay_steps,
            "lr_decay_style": self.lr_decay_style,
            "wsd_decay_steps": self.wsd_decay_steps,
            "lr_wsd_decay_style": self.lr_wsd_decay_style,
            **{key: getattr(self, key) for key, _ in WD_FIELDS},
            "num_steps": self.num_steps,
        }

    def load_state_dict(
        self,
        state: Dict[str, Any],
        *,
        override_opt_param_scheduler: bool = False,
        use_checkpoint_opt_param_scheduler: bool = False,
    ) -> List[str]:
        """Restore the position (`num_steps`, in samples) and reconcile the schedule's shape
        with the checkpoint's, as Megatron does: with `override_opt_param_scheduler` the
        command line's values stay, with `use_checkpoint_opt_param_scheduler` the
        checkpoint's replace them, and with neither a difference is a ConfigError naming each
        field and both flags.

        Returns one line per value that differed and was resolved by a flag, for the log. The
        saved values are equal on every rank, so every rank takes the same decision.
        """
        missing = [key for key, _ in SCHEDULE_FIELDS + (("num_steps", ""),) if key not in state]
        if missing:
            raise ConfigError(
                f"the checkpoint's learning-rate schedule lacks {missing} (a schedule saved "
                "before it counted samples?); add --no-load-optim to start a fresh optimizer "
                "and schedule from its weights"
            )
        resolved, conflicts = [], []
        fields = SCHEDULE_FIELDS + tuple(f for f in WSD_FIELDS + WD_FIELDS if f[0] in state)
        if self.wd_incr_style == state.get("wd_incr_style") == "constant":
            # The length of a constant schedule changes nothing (Megatron-LM checks it too,
            # so a longer --train-iters there needs --override-opt_param-scheduler).
            fields = tuple(f for f in fields if f[0] != "wd_incr_steps")
        for key, flags in fields:
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
