"""Megatron's command-line flags, mapped onto the typed config dataclasses (see flags.py)."""
from megatron_smp.training.arguments.flags import *  # noqa: F401,F403
from megatron_smp.training.arguments.flags import (  # noqa: F401
    _FLAGS, HYBRID_SPECS, hybrid_pattern_given,
)
