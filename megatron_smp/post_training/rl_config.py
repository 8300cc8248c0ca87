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
from megatron_smp.config.post_training import (  # noqa: F401 (the config's home)
    GRPO_LOSS_TYPES, SCALE_REWARDS, RLConfig, validate_rl_config,
)
from megatron_smp.training.arguments.modes import add_rl_args, rl_config  # noqa: F401,E402
