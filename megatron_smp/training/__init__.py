"""Training: Megatron flags, the loop, logging. The only package that wires everything."""
from megatron_smp.training.arguments import Configs, parse_args
from megatron_smp.training.pretrain import TrainingResult, build_configs, main, pretrain
from megatron_smp.training.trainer import StepResult, Trainer

__all__ = ["Configs", "parse_args", "build_configs", "pretrain", "main", "TrainingResult",
           "Trainer",
           "StepResult"]
