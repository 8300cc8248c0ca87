"""ConfigError and the helpers every config section's checks use."""
from __future__ import annotations

import dataclasses
from typing import Tuple


class ConfigError(ValueError):
    """A configuration that cannot work. The message names the flag and what would work."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


# What each not-yet-built capability is called in errors, so the user knows it is missing and
# not misconfigured.
NOT_SUPPORTED_YET = "is not supported yet (megatron_smp has no {what} yet); remove it"


def not_supported(setting: str, what: str) -> ConfigError:
    """The error for a setting whose capability does not exist yet (never silently ignored)."""
    return ConfigError(f"{setting} {NOT_SUPPORTED_YET.format(what=what)}")


# -- validated once ---------------------------------------------------------------------------
# Each config is validated where it is built (training.arguments.validate_configs, smp.init);
# the library entry points that take a config (build_parallel_state, GPTModel,
# get_megatron_optimizer) call `validate` too, for callers that build configs by hand. A
# config remembers the contents and layout it was validated with, so those repeated calls
# return at once; a config changed since (or a copy, dataclasses.replace) is checked again.


def _fingerprint(config, skip: Tuple[str, ...] = ()) -> str:
    """A config's contents (every dataclass field but `skip`), as text."""
    return repr([(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)
                 if f.name not in skip])


def _validated(config, key) -> bool:
    return key in config.__dict__.get("_validated_keys", ())


def _remember_validated(config, key) -> None:
    config.__dict__.setdefault("_validated_keys", set()).add(key)
