"""Hook specifications: how a package contributes plugins to jetflow.

A plugin module registered under the entry-point group ``jetflow`` implements any of
these hooks with ``@jetflow.core.hookspecs.hookimpl``; each returns the plugin classes
it contributes. Built-in plugins use exactly the same path as third-party ones.
"""

from __future__ import annotations

import pluggy

PROJECT = "jetflow"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def jetflow_drafters() -> list[type]:
    """Return the :class:`~jetflow.core.contracts.Drafter` classes this module provides."""
    raise NotImplementedError  # a specification: pluggy calls the implementations


@hookspec
def jetflow_tree_policies() -> list[type]:
    """Return the :class:`~jetflow.core.contracts.TreePolicy` classes this module provides."""
    raise NotImplementedError


@hookspec
def jetflow_verifiers() -> list[type]:
    """Return the :class:`~jetflow.core.contracts.Verifier` classes this module provides."""
    raise NotImplementedError
