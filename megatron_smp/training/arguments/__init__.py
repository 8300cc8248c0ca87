"""Megatron's command-line flags, mapped onto the typed config dataclasses.

* flags.py: the flag table (each flag once, with the config section and field it fills), the
  ignored and not-yet-supported flags, `build_parser`;
* compat.py: the Megatron-LM / SMP compatibility layer (flags and --smp-config keys whose
  meaning is more than one field);
* parse.py: `parse_args` (flags -> `Configs`);
* validation.py: `validate_configs` (the checks across sections, once, before any process
  group).
"""
from megatron_smp.config.sections import Configs
from megatron_smp.training.arguments.compat import HYBRID_SPECS, hybrid_pattern_given
from megatron_smp.training.arguments.flags import (
    _FLAGS,
    IGNORED_FLAGS,
    IGNORED_WITHOUT,
    NOT_SUPPORTED_YET_FLAGS,
    build_parser,
)
from megatron_smp.training.arguments.parse import parse_args
from megatron_smp.training.arguments.validation import validate_configs

__all__ = [
    "Configs", "HYBRID_SPECS", "IGNORED_FLAGS", "IGNORED_WITHOUT", "NOT_SUPPORTED_YET_FLAGS", "_FLAGS",
    "build_parser", "hybrid_pattern_given", "parse_args", "validate_configs",
]
