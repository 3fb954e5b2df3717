"""The configuration's error kind, and the one-line check every section and validator uses."""

from __future__ import annotations

from megatron_gspo.errors import InputError


class ConfigError(ValueError, InputError):
    """An invalid configuration; the message names the field (``section.key``) and the fix."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)
