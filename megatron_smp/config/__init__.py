"""Typed configuration for every part of megatron_smp (see model.py)."""
from megatron_smp.config.model import *  # noqa: F401,F403
