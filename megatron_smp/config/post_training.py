"""The post-training modes' config sections: DPO (`train_dpo.py`, the --dpo-* flags) and RL
(`train_rl.py`, Megatron-LM's --grpo-* / --rl-* flags), each validated on its own here and
against the rest of the run in `training.arguments.validation`."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megatron_smp.config.errors import ConfigError

# DPO's losses (TRL's loss_type names) and how its reference log-probs are obtained.
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")
DPO_REFERENCE_MODES = ("precomputed", "frozen", "adapters-off")
# GRPO's aggregations (TRL's loss_type names) and advantage scalings.
GRPO_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "gspo")
SCALE_REWARDS = ("group", "batch", "none")


@dataclass
class DPOConfig:
    """--dpo-* flags. `reference`: how the reference log-probs are obtained: `precomputed`
    (one forward pass over the data before training, kept beside the checkpoints), `frozen`
    (a frozen copy of the starting model, run live), `adapters-off` (LoRA only: the trained
    model with its adapters switched off; no second copy)."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    rpo_alpha: Optional[float] = None
    reference: str = "frozen"

    def validate(self, lora: bool) -> None:
        """ConfigError naming the flag (on every rank, before any collective)."""
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ConfigError(f"--dpo-loss-type {self.loss_type!r}: choose from "
                              f"{', '.join(DPO_LOSS_TYPES)}")
        if not self.beta > 0.0:
            raise ConfigError(f"--dpo-beta must be positive, got {self.beta}")
        if self.loss_type == "robust" and not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"--dpo-label-smoothing {self.label_smoothing}: the robust loss "
                              "needs a value in [0, 0.5)")
        if self.label_smoothing != 0.0 and self.loss_type != "robust":
            raise ConfigError(f"--dpo-label-smoothing {self.label_smoothing} only shapes "
                              "--dpo-loss-type robust; drop it or use the robust loss")
        if self.rpo_alpha is not None and not self.rpo_alpha >= 0.0:
            raise ConfigError(f"--dpo-rpo-alpha must be >= 0, got {self.rpo_alpha}")
        if self.reference not in DPO_REFERENCE_MODES:
            raise ConfigError(f"--dpo-reference {self.reference!r}: choose from "
                              f"{', '.join(DPO_REFERENCE_MODES)}")
        if self.reference == "adapters-off" and not lora:
            raise ConfigError("--dpo-reference adapters-off needs LoRA (--lora-rank): without "
                              "adapters use --dpo-reference frozen or precomputed")


@dataclass
class RLConfig:
    group_size: int = 2                     # --grpo-group-size: completions per prompt
    prompts_per_step: int = 32              # --grpo-prompts-per-step: groups per rollout batch
    iterations: int = 2                     # --grpo-iterations: updates per rollout batch
    kl_beta: float = 0.001                  # --grpo-kl-beta
    clamp_eps_lower: float = 0.01           # --grpo-clamp-eps-lower
    clamp_eps_upper: float = 0.01           # --grpo-clamp-eps-upper
    entropy_term_weight: float = 0.0        # --grpo-entropy-term-weight
    filter_groups_with_same_reward: bool = False
    loss_type: str = "dapo"                 # --grpo-loss-type
    scale_rewards: str = "group"            # --grpo-scale-rewards
    unbiased_reward_std: bool = False       # --grpo-unbiased-reward-std (TRL's Bessel correction)
    temperature: float = 1.0                # --rl-default-temperature (0: greedy)
    top_k: int = -1                         # --rl-default-top-k (<= 0: off)
    top_p: float = 0.0                      # --rl-default-top-p (0 or 1: off)
    max_completion_length: int = 256        # --rl-max-completion-length
    env_config: Optional[str] = None        # --langrl-env-config
    sequence_packing: bool = False          # --rl-use-sequence-packing

    def __post_init__(self):
        validate_rl_config(self)

    @property
    def rollouts_per_step(self) -> int:
        return self.group_size * self.prompts_per_step


def validate_rl_config(config: RLConfig) -> None:
    """Raise ConfigError naming the flag for a setting that cannot work."""
    def require(condition, message):
        if not condition:
            raise ConfigError(message)

    require(config.group_size >= 2, f"--grpo-group-size must be at least 2 (advantages compare "
            f"completions within a group), got {config.group_size}")
    require(config.prompts_per_step >= 1,
            f"--grpo-prompts-per-step must be positive, got {config.prompts_per_step}")
    require(config.iterations >= 1, f"--grpo-iterations must be positive, got {config.iterations}")
    require(config.kl_beta >= 0, f"--grpo-kl-beta must be >= 0, got {config.kl_beta}")
    require(0 <= config.clamp_eps_lower < 1, f"--grpo-clamp-eps-lower must be in [0, 1) (the "
            f"ratio is clipped below at 1 - eps), got {config.clamp_eps_lower}")
    require(config.clamp_eps_upper >= 0,
            f"--grpo-clamp-eps-upper must be >= 0, got {config.clamp_eps_upper}")
    require(config.entropy_term_weight >= 0,
            f"--grpo-entropy-term-weight must be >= 0, got {config.entropy_term_weight}")
    require(config.loss_type in GRPO_LOSS_TYPES, f"--grpo-loss-type {config.loss_type!r} is not "
            f"one of {', '.join(GRPO_LOSS_TYPES)}")
    require(config.scale_rewards in SCALE_REWARDS, f"--grpo-scale-rewards "
            f"{config.scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}")
    require(config.temperature >= 0,
            f"--rl-default-temperature must be >= 0 (0 is greedy), got {config.temperature}")
    require(0 <= config.top_p <= 1,
            f"--rl-default-top-p must be in [0, 1] (0 or 1 turn it off), got {config.top_p}")
    require(not (config.temperature == 0 and (config.top_k > 1 or 0 < config.top_p < 1)),
            "--rl-default-temperature 0 is greedy decoding; --rl-default-top-k / "
            "--rl-default-top-p would be ignored: leave them off or set a temperature > 0")
    require(config.max_completion_length >= 1, f"--rl-max-completion-length must be positive, "
            f"got {config.max_completion_length}")
    require(config.env_config is None or os.path.isfile(config.env_config),
            f"--langrl-env-config: file {config.env_config!r} not found")
