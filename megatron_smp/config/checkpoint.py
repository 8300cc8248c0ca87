"""CheckpointConfig: where and how checkpoints are saved and loaded."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    # Megatron's --pretrained-checkpoint: the base model of a --lora-rank run (its checkpoints
    # hold only the adapters and record their base; this overrides the recorded one).
    pretrained_checkpoint: Optional[str] = None
    ckpt_format: str = "torch_dist"  # "torch_dist" | "torch"
    async_save: bool = False
    # Megatron's --no-save-rng / --no-save-optim: leave those states out of saved checkpoints.
    no_save_rng: bool = False
    no_save_optim: bool = False
    # Megatron: a checkpoint's LR-schedule values that differ from the flags are an error
    # unless one of these says which side wins.
    override_opt_param_scheduler: bool = False  # the command line wins
    use_checkpoint_opt_param_scheduler: bool = False  # the checkpoint wins
    # Megatron's handling of key mismatches on load ("unexpected": the model has it, the
    # checkpoint not; "missing": the reverse): assume_ok_unexpected | log_unexpected | log_all |
    # raise_unexpected | raise_all | return_unexpected | return_all | ignore_all.
    dist_ckpt_strictness: str = "assume_ok_unexpected"
    # Load any format; without it, --ckpt-format torch loads only legacy per-rank files.
    auto_detect_ckpt_format: bool = False
    # Optimizer state reshardable over TP/PP/DP (always so in "torch_dist"; "torch" is not).
    dist_ckpt_optim_fully_reshardable: bool = False
    # Megatron's --no-ckpt-fully-parallel-save clears it: a tensor replicated over ranks (the
    # model weights over data-parallel replicas) is written by the lowest of them instead of
    # spreading those writes evenly.
    ckpt_fully_parallel_save: bool = True
    # Megatron's --save-retain-interval: each new checkpoint deletes the one before it unless
    # that one's iteration is a multiple of this (None: keep every checkpoint).
    save_retain_interval: Optional[int] = None
    # Megatron's --exit-on-missing-checkpoint: a --load directory without a checkpoint is an
    # error instead of a start from scratch.
    exit_on_missing_checkpoint: bool = False
    # Megatron's --ckpt-step: the iteration to load instead of the tracker's latest.
    ckpt_step: Optional[int] = None
