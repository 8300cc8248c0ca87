"""Typed configuration for every part of megatron_smp, one concern per module.

These dataclasses are the single source of truth; `training/arguments.py` maps Megatron's
command-line flags onto them and `smp.init` maps the SMP v2 JSON keys onto them. The package
imports nothing else of ours, nor torch: `from megatron_smp.config import X` is cheap.
"""
from megatron_smp.config.attention import SOFTMAX_TYPES
from megatron_smp.config.checkpoint import CheckpointConfig
from megatron_smp.config.data import DataConfig
from megatron_smp.config.errors import NOT_SUPPORTED_YET, ConfigError, not_supported
from megatron_smp.config.hybrid import HYBRID_MTP_SEPARATOR, HYBRID_STAGE_BREAK, HYBRID_SYMBOLS
from megatron_smp.config.model import (
    FUNCTION_FIELDS,
    PACKED_ATTENTION_BACKENDS,
    RECOMPUTE_MODULES,
    TransformerConfig,
    recompute_modules,
)
from megatron_smp.config.moe import parse_moe_layer_freq
from megatron_smp.config.optimizer import (
    LR_DECAY_STYLES,
    LR_WSD_DECAY_STYLES,
    MUON_COEFFICIENT_TYPES,
    MUON_MATMUL_PRECISIONS,
    MUON_SCALE_MODES,
    MUON_TP_MODES,
    OptimizerConfig,
)
from megatron_smp.config.parallel import CP_COMM_TYPES, FLAG_NAMES, ParallelConfig, name_of
from megatron_smp.config.resilience import ResilienceConfig
from megatron_smp.config.training import TrainingConfig

__all__ = [
    "CP_COMM_TYPES", "FLAG_NAMES", "FUNCTION_FIELDS", "HYBRID_MTP_SEPARATOR",
    "HYBRID_STAGE_BREAK", "HYBRID_SYMBOLS", "LR_DECAY_STYLES", "LR_WSD_DECAY_STYLES",
    "MUON_COEFFICIENT_TYPES", "MUON_MATMUL_PRECISIONS", "MUON_SCALE_MODES", "MUON_TP_MODES",
    "NOT_SUPPORTED_YET", "PACKED_ATTENTION_BACKENDS", "RECOMPUTE_MODULES", "SOFTMAX_TYPES",
    "CheckpointConfig", "ConfigError", "DataConfig", "OptimizerConfig", "ParallelConfig",
    "ResilienceConfig", "TrainingConfig", "TransformerConfig", "name_of", "not_supported", "parse_moe_layer_freq",
    "recompute_modules", "Configs", "SECTIONS",
]


def __getattr__(name):
    # Configs and SECTIONS on first use, so `import megatron_smp.config` stays a few modules.
    if name in ("Configs", "SECTIONS"):
        from megatron_smp.config import sections

        return getattr(sections, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
