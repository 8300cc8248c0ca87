"""Megatron's Weights & Biases logging (--wandb-project, --wandb-exp-name, --wandb-save-dir,
--wandb-entity): the last rank calls `wandb.init` and the training logger sends it the same
scalars, at the same steps, as TensorBoard.

wandb is optional: it is imported only when --wandb-project is given. As in Megatron-LM,
online or offline is wandb's own choice: `WANDB_MODE=offline` (or `wandb offline`) logs to
the save directory for a later `wandb sync`; an online run needs `wandb login` or
WANDB_API_KEY.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Dict, Optional

from megatron_smp.config import ConfigError, TrainingConfig


def wandb_save_dir(training: TrainingConfig, save: Optional[str]) -> Optional[str]:
    """--wandb-save-dir, else Megatron's default <--save>/wandb."""
    if training.wandb_save_dir:
        return training.wandb_save_dir
    return os.path.join(save, "wandb") if save else None


def validate_wandb(training: TrainingConfig, save: Optional[str]) -> None:
    """ConfigError when wandb logging cannot start (pure; every rank, so no rank is left
    waiting for the last one)."""
    given = [flag for flag, value in (("--wandb-exp-name", training.wandb_exp_name),
                                      ("--wandb-save-dir", training.wandb_save_dir),
                                      ("--wandb-entity", training.wandb_entity)) if value]
    if not training.wandb_project:
        if given:
            raise ConfigError(f"{', '.join(given)} configure wandb logging: add "
                              "--wandb-project NAME")
        return
    if training.wandb_exp_name == "":
        raise ConfigError("--wandb-exp-name is empty: give the experiment a name")
    if wandb_save_dir(training, save) is None:
        raise ConfigError("--wandb-project needs a directory for wandb's files: add "
                          "--wandb-save-dir DIR (or --save DIR, which uses DIR/wandb)")
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb-project needs the wandb package, which is not installed: "
                          "pip install wandb, or drop the --wandb-* flags")


def init_wandb(training: TrainingConfig, save: Optional[str], run_config: Dict[str, Any]):
    """Start the run on this (the last) rank; returns the wandb module, whose `log(dict,
    step)` and `finish()` the logger calls, or None without --wandb-project."""
    if not training.wandb_project:
        return None
    import wandb

    directory = wandb_save_dir(training, save)
    os.makedirs(directory, exist_ok=True)
    kwargs = {"dir": directory, "name": training.wandb_exp_name,
              "project": training.wandb_project, "config": run_config}
    if training.wandb_entity:
        kwargs["entity"] = training.wandb_entity
    wandb.init(**kwargs)
    return wandb


__all__ = ["init_wandb", "validate_wandb", "wandb_save_dir"]
