"""Plugin discovery: every module registered under the entry-point group ``jetflow``.

The core imports no plugin. Built-ins are found through the very same entry points as a
third party's, so ``jetflow plugins`` shows where each came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Literal, overload

import pluggy
from jetflow.core import composition, hookspecs
from jetflow.core.contracts import Drafter, Plugin, TreePolicy, Verifier
from jetflow.core.errors import JetflowError, PluginNotFoundError

PluginKind = Literal["drafter", "tree_policy", "verifier"]

_HOOKS: dict[PluginKind, tuple[str, type[Plugin]]] = {
    "drafter": ("jetflow_drafters", Drafter),
    "tree_policy": ("jetflow_tree_policies", TreePolicy),
    "verifier": ("jetflow_verifiers", Verifier),
}
KIND_LABELS: dict[PluginKind, str] = {
    "drafter": "drafter",
    "tree_policy": "tree policy",
    "verifier": "verifier",
}


@dataclass(frozen=True)
class PluginInfo:
    """One registered plugin class and where it came from."""

    kind: PluginKind
    name: str
    description: str
    distribution: str
    cls: type[Plugin]

    def as_dict(self) -> dict[str, str]:
        return {
            "name": self.name,
            "description": self.description,
            "distribution": self.distribution,
        }


class Registry:
    """Plugins by kind and name, collected from a pluggy plugin manager."""

    def __init__(self, manager: pluggy.PluginManager) -> None:
        self._manager = manager

    @classmethod
    def from_entry_points(cls) -> Registry:
        manager = pluggy.PluginManager(hookspecs.PROJECT)
        manager.add_hookspecs(hookspecs)
        manager.load_setuptools_entrypoints(hookspecs.PROJECT)
        return cls(manager)

    def register(self, module: ModuleType | object, name: str | None = None) -> None:
        """Register a plugin module by hand (tests, notebooks); entry points are the normal way."""
        self._manager.register(module, name=name)

    def unregister(self, module: ModuleType | object) -> None:
        self._manager.unregister(module)

    def _distributions(self) -> dict[int, str]:
        return {id(plugin): dist.project_name for plugin, dist in self._manager.list_plugin_distinfo()}

    def plugins(self, kind: PluginKind) -> list[PluginInfo]:
        """Every plugin of one kind, sorted by name; a name registered twice is an error."""
        hook_name, base = _HOOKS[kind]
        distributions = self._distributions()
        found: dict[str, PluginInfo] = {}
        for impl in getattr(self._manager.hook, hook_name).get_hookimpls():
            distribution = distributions.get(id(impl.plugin), "local")
            for plugin_cls in impl.function():
                if not (isinstance(plugin_cls, type) and issubclass(plugin_cls, base)):
                    raise JetflowError(
                        f"{distribution} registers {plugin_cls!r} as a {KIND_LABELS[kind]}, "
                        f"but it does not subclass {base.__name__}"
                    )
                info = PluginInfo(kind, plugin_cls.name, plugin_cls.description, distribution, plugin_cls)
                if info.name in found and found[info.name].cls is not plugin_cls:
                    raise JetflowError(
                        f"two plugins register the {KIND_LABELS[kind]} {info.name!r}: "
                        f"{found[info.name].distribution} and {distribution}"
                    )
                found[info.name] = info
        return sorted(found.values(), key=lambda info: info.name)

    def names(self, kind: PluginKind) -> list[str]:
        return [info.name for info in self.plugins(kind)]

    @overload
    def get(self, kind: Literal["drafter"], name: str) -> type[Drafter]: ...
    @overload
    def get(self, kind: Literal["tree_policy"], name: str) -> type[TreePolicy]: ...
    @overload
    def get(self, kind: Literal["verifier"], name: str) -> type[Verifier]: ...
    @overload
    def get(self, kind: PluginKind, name: str) -> type[Plugin]: ...

    def get(self, kind: PluginKind, name: str) -> type[Plugin]:
        """The plugin class registered as ``name``, or an error listing the known names.

        A drafter name ``a+b`` is the composition of two registered drafters (``composition``).
        """
        if kind == "drafter" and composition.SEPARATOR in name:
            return composition.compose(
                tuple(self.get(kind, part) for part in name.split(composition.SEPARATOR))
            )
        for info in self.plugins(kind):
            if info.name == name:
                return info.cls
        raise PluginNotFoundError(KIND_LABELS[kind], name, self.names(kind))

    def describe(self) -> dict[str, list[dict[str, str]]]:
        """The JSON shape of ``jetflow plugins --json``."""
        return {
            "drafters": [info.as_dict() for info in self.plugins("drafter")],
            "tree_policies": [info.as_dict() for info in self.plugins("tree_policy")],
            "verifiers": [info.as_dict() for info in self.plugins("verifier")],
        }


@cache
def default_registry() -> Registry:
    """The process-wide registry, discovered once from installed entry points."""
    return Registry.from_entry_points()
