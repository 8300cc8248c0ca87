"""Megatron-LM's RL flags (`--grpo-*`, `--rl-*`, `--langrl-env-config`) and their typed config.

`add_rl_args(parser)` adds them to an entry script's parser (they are not part of the pretraining
parser: they only mean something to an RL run); `rl_config(args)` turns the parsed namespace into
an `RLConfig`, validated, raising ConfigError naming the flag. Defaults are Megatron-LM's.

Beyond Megatron's flags, three say which GRPO variant to train (TRL's names):
`--grpo-loss-type` (grpo, dapo, dr_grpo, gspo; dapo's token-level mean over the batch is what
Megatron-LM's `train_rl.py` computes, so it is the default), `--grpo-scale-rewards`
(group, batch, none: "none" is Dr. GRPO's advantage without the std) and
`--rl-max-completion-length` (generation length, and dr_grpo's constant normaliser).
`--rl-use-sequence-packing` is Megatron-LM's flag (off by default, as there): the training
step's rollouts share rows of --seq-length, each attending only to itself.
"""
import argparse
import os
from dataclasses import dataclass
from typing import Optional

from megatron_smp.config import ConfigError
from megatron_smp.post_training.grpo import GRPO_LOSS_TYPES, SCALE_REWARDS


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


def add_rl_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add Megatron-LM's RL flags (and the GRPO-variant flags) to `parser`; returns it."""
    group = parser.add_argument_group(title="rl")
    group.add_argument("--grpo-group-size", type=int, default=2,
                       help="Completions sampled per prompt (a GRPO group).")
    group.add_argument("--grpo-prompts-per-step", type=int, default=32,
                       help="Prompts (groups) per rollout batch.")
    group.add_argument("--grpo-iterations", type=int, default=2,
                       help="Optimizer updates on each rollout batch.")
    group.add_argument("--grpo-kl-beta", type=float, default=0.001,
                       help="Weight of the k3 KL(policy || reference) term per token.")
    group.add_argument("--grpo-clamp-eps-lower", type=float, default=0.01,
                       help="The ratio is clipped below at 1 - this.")
    group.add_argument("--grpo-clamp-eps-upper", type=float, default=0.01,
                       help="The ratio is clipped above at 1 + this (DAPO: larger than lower).")
    group.add_argument("--grpo-entropy-term-weight", type=float, default=0.0,
                       help="Weight of the entropy bonus (mean response-token entropy).")
    group.add_argument("--grpo-filter-groups-with-same-reward", action="store_true",
                       help="Drop groups whose rewards are all equal (DAPO's dynamic sampling).")
    group.add_argument("--grpo-loss-type", choices=GRPO_LOSS_TYPES, default="dapo",
                       help="Aggregation (TRL's loss_type): grpo sequence-mean, dapo token-mean "
                            "over the batch (Megatron-LM's), dr_grpo sum / max length, gspo "
                            "sequence-level ratio.")
    group.add_argument("--grpo-scale-rewards", choices=SCALE_REWARDS, default="group",
                       help="Divide advantages by the group's std, the batch's, or none "
                            "(Dr. GRPO).")
    group.add_argument("--grpo-unbiased-reward-std", action="store_true",
                       help="Bessel-corrected std in the advantages (TRL's; Megatron-LM's is the "
                            "population std).")
    group.add_argument("--rl-default-temperature", type=float, default=1.0,
                       help="Sampling temperature of the rollouts (0: greedy).")
    group.add_argument("--rl-default-top-p", type=float, default=0.0,
                       help="Nucleus sampling of the rollouts (0: off).")
    group.add_argument("--rl-default-top-k", type=int, default=-1,
                       help="Top-k sampling of the rollouts (<= 0: off).")
    group.add_argument("--rl-max-completion-length", type=int, default=256,
                       help="Most tokens generated per completion (dr_grpo's normaliser).")
    group.add_argument("--rl-use-sequence-packing", action=argparse.BooleanOptionalAction,
                       default=False,
                       help="Pack the rollouts of a training step into rows of --seq-length "
                            "(each attending only to itself) instead of one rollout per row: "
                            "fewer rows, the same loss and update.")
    group.add_argument("--langrl-env-config", type=str, default=None,
                       help="YAML file of RL environments (prompts and reward functions).")
    return parser


def rl_config(args: argparse.Namespace) -> RLConfig:
    """The RLConfig of parsed flags (validated; ConfigError names the flag)."""
    return RLConfig(
        group_size=args.grpo_group_size, prompts_per_step=args.grpo_prompts_per_step,
        iterations=args.grpo_iterations, kl_beta=args.grpo_kl_beta,
        clamp_eps_lower=args.grpo_clamp_eps_lower, clamp_eps_upper=args.grpo_clamp_eps_upper,
        entropy_term_weight=args.grpo_entropy_term_weight,
        filter_groups_with_same_reward=args.grpo_filter_groups_with_same_reward,
        loss_type=args.grpo_loss_type, scale_rewards=args.grpo_scale_rewards,
        unbiased_reward_std=args.grpo_unbiased_reward_std,
        temperature=args.rl_default_temperature, top_k=args.rl_default_top_k,
        top_p=args.rl_default_top_p, max_completion_length=args.rl_max_completion_length,
        env_config=args.langrl_env_config, sequence_packing=args.rl_use_sequence_packing)
