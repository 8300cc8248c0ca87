"""Training: Megatron flags, the loop, logging. The only package that wires everything."""
from megatron_smp.training.arguments import Configs, parse_args
from megatron_smp.training.pretrain import TrainingResult, main, pretrain

__all__ = ["Configs", "parse_args", "pretrain", "main", "TrainingResult"]
