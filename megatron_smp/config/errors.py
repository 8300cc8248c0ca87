"""ConfigError and the helpers every config section's checks use."""
from __future__ import annotations

from typing import List

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


_MAX_LISTED = 20


def format_listing(items: List[str]) -> str:
    """Comma-separated, at most 20 entries (error messages stay readable)."""
    shown = items[:_MAX_LISTED]
    more = f" ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return ", ".join(shown) + more
