"""The one exception hierarchy of jetflow.

Everything a user can cause (bad config, unknown plugin, wrong checkpoint, broken data,
missing package) raises a subclass of :class:`JetflowError`; the CLI turns those into a
one-line message and exit code 2. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations


class JetflowError(Exception):
    """Base class of every error a user can cause and fix."""


class ConfigError(JetflowError):
    """An invalid configuration value (field named in the message)."""


class PluginNotFoundError(ConfigError):
    """A plugin name that no installed package registers."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        self.kind, self.name, self.known = kind, name, known
        listing = ", ".join(known) if known else "none installed"
        super().__init__(f"unknown {kind} {name!r}; known {_plural(kind)}: {listing}")


def _plural(noun: str) -> str:
    """The plural of a kind's label (``tree policy`` -> ``tree policies``), for messages."""
    if noun.endswith("y") and noun[-2:-1] not in ("", *"aeiou"):
        return noun[:-1] + "ies"
    return noun + "s"


class CheckpointMismatchError(JetflowError):
    """A drafter checkpoint that was trained for another target."""


class DataError(JetflowError):
    """A missing, truncated or malformed data file."""


class TargetError(JetflowError):
    """The target model cannot be loaded or cannot take the given input."""
