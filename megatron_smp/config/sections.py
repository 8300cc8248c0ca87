"""Configs: the typed sections of one run, handed around whole."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, Optional

from megatron_smp.config.checkpoint import CheckpointConfig
from megatron_smp.config.data import DataConfig
from megatron_smp.config.inference import InferenceConfig
from megatron_smp.config.model import TransformerConfig
from megatron_smp.config.optimizer import OptimizerConfig
from megatron_smp.config.parallel import ParallelConfig
from megatron_smp.config.post_training import DPOConfig, RLConfig
from megatron_smp.config.resilience import ResilienceConfig
from megatron_smp.config.training import TrainingConfig

if TYPE_CHECKING:
    import argparse


# Each section's name in `Configs` (and in checkpoint metadata) and its dataclass.
SECTIONS = {
    "model": TransformerConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "training": TrainingConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "resilience": ResilienceConfig,
}


@dataclass
class Configs:
    """Everything one run needs, typed. `args` keeps the raw namespace for the flags an entry
    script adds with `extra_args_provider` (Megatron's convention)."""

    model: TransformerConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    training: TrainingConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    args: argparse.Namespace
    # How validation names ParallelConfig fields the user set through --smp-config keys.
    setting_names: Dict[str, str] = dataclasses.field(default_factory=dict)
    # The flags given on the command line, for the checks that depend on whether a flag was
    # given rather than on its value (--split beside per-split data paths; the ignored
    # --use-flash-attn with --deterministic-mode). Empty for configs built by hand.
    given_flags: FrozenSet[str] = frozenset()
    resilience: ResilienceConfig = dataclasses.field(default_factory=ResilienceConfig)
    # The modes' sections, each present when the entry script added its flags
    # (training.arguments.modes): train_dpo.py, train_rl.py, the inference launcher.
    dpo: Optional[DPOConfig] = None
    rl: Optional[RLConfig] = None
    inference: Optional[InferenceConfig] = None

    def to_dict(self) -> Dict[str, Any]:
        """Plain-data view (for checkpoint metadata and logs)."""
        out = {}
        import torch

        for name in SECTIONS:
            section = dataclasses.asdict(getattr(self, name))
            out[name] = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in section.items()}
        return out
