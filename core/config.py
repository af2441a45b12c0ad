"""Run configuration: frozen pydantic models, loadable from TOML, overridable by CLI flags.

Plugin names are checked against the registry and plugin parameters by the plugin's own
``Params`` model at validation time, so a bad config fails before any model loads.
"""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from jetflow.core.contracts import Plugin
from jetflow.core.errors import ConfigError, PluginNotFoundError
from jetflow.core.precision import DtypeName
from jetflow.core.registry import Registry, default_registry
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

if TYPE_CHECKING:
    from jetflow.core.target import Target

log = logging.getLogger(__name__)

NO_DRAFTER = "none"
#: the drafter when the config names none: the learned head shipped for the embedded target
DEFAULT_DRAFTER = "jetflow"
#: used instead when no drafter is named and the default has nothing for the target (no head)
FALLBACK_DRAFTER = "ngram"
AUTO_BUDGET = "auto"
#: the budget when none is given and no calibration exists for the setup
DEFAULT_BUDGET = 16


def parse_budget(value: object) -> object:
    """An integer >= 0 or ``"auto"`` (also from CLI text); anything else, one clear message.

    0 drafts nothing: the loop is plain decoding. Calibration picks it where no budget pays
    for its verify cost, so ``auto`` is never slower than decoding without a drafter.
    """
    if isinstance(value, str):
        text = value.strip().lower()
        if text == AUTO_BUDGET:
            return AUTO_BUDGET
        if text.lstrip("-").isdigit():
            value = int(text)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError(f"a budget is an integer >= 0 (0: no drafting) or '{AUTO_BUDGET}', got {value!r}")


#: a tree budget as configs and flags give it: drafted nodes, or the calibrated best
Budget = Annotated[int | Literal["auto"], BeforeValidator(parse_budget)]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TreeConfig(_Frozen):
    """How large a tree the policy may build each step."""

    policy: str | None = Field(None, description="tree policy; the drafter's default if unset")
    budget: Budget | None = Field(
        None,
        description="drafted nodes per step (root excluded); 'auto': the calibrated best; "
        f"unset: the calibrated best if `jetflow calibrate` ran for this setup, else {DEFAULT_BUDGET}",
    )
    adapt: bool = Field(
        True,
        description="with a calibrated budget, re-choose it every step from the acceptance the "
        "running generations show (the calibration's step costs, tau learned online)",
    )
    width: int = Field(4, ge=1, description="children proposed per expanded node")
    max_depth: int = Field(16, ge=1, description="deepest tree level")
    split: Literal["best-first", "equal"] = Field(
        "best-first",
        description="how a batch shares its nodes (budget x rows): the best expected acceptance over "
        "every row's tree (nested policies), or the budget for each row",
    )
    params: dict[str, Any] = Field(default_factory=dict)


class GenerateConfig(_Frozen):
    """Everything that decides one generation run."""

    target: str = Field("default", description="'default', a local folder, a .gguf file or a cached hub id")
    dtype: DtypeName = "auto"
    drafter: str = Field(DEFAULT_DRAFTER, description=f"drafter plugin name, or '{NO_DRAFTER}'")
    drafter_params: dict[str, Any] = Field(default_factory=dict)
    tree: TreeConfig = Field(default_factory=TreeConfig)
    verifier: str = "greedy"
    verifier_params: dict[str, Any] = Field(default_factory=dict)
    max_new_tokens: int = Field(128, ge=1)
    batch_size: int = Field(
        8, ge=1, description="sequences decoded at once when several prompts are given (continuous batching)"
    )
    stop: tuple[str, ...] = Field((), description="stop strings; generation ends right after one")
    stop_at_eos: bool = True
    chat_template: bool = True
    seed: int = 0
    compile: bool | None = Field(
        None,
        description="verify through the target compiled ahead of time (one package per tree-size "
        "bucket, built on first use in minutes and loaded from disk by later runs); off: the eager "
        "forward, exactly equal to transformers.generate in fp32; None (auto): compiled where a "
        "calibration made with `jetflow calibrate --compile` predicts more tokens/s than the eager "
        "one, with the buckets that calibration built",
    )

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: tuple[str, ...]) -> tuple[str, ...]:
        """An empty stop string occurs in every text, so it would end each answer at its first token."""
        if "" in stop:
            raise ValueError("a stop string cannot be empty (it would end every answer at once)")
        return stop

    @model_validator(mode="after")
    def _check_plugins(self) -> GenerateConfig:
        registry = default_registry()
        if self.tree.policy is not None:
            policy_cls = registry.get("tree_policy", self.tree.policy)
            _validate_params(policy_cls, self.tree.params, "tree.params")
        if self.drafter != NO_DRAFTER:
            try:
                drafter_cls = registry.get("drafter", self.drafter)
            except PluginNotFoundError as error:
                raise PluginNotFoundError("drafter", self.drafter, [*error.known, NO_DRAFTER]) from None
            _validate_params(drafter_cls, self.drafter_params, "drafter_params")
            if self.tree.policy is None:
                policy_cls = registry.get("tree_policy", drafter_cls.default_tree_policy)
                _validate_params(policy_cls, self.tree.params, "tree.params")
        _validate_params(registry.get("verifier", self.verifier), self.verifier_params, "verifier_params")
        return self

    @property
    def uses_drafter(self) -> bool:
        return self.drafter != NO_DRAFTER

    def with_available_drafter(self, target: Target, registry: Registry | None = None) -> GenerateConfig:
        """This config, with the fallback drafter if none was named and the default has nothing
        for ``target`` (no head shipped for it); a drafter named explicitly is never swapped."""
        if {"drafter", "drafter_params"} & self.model_fields_set or not self.uses_drafter:
            return self
        if (registry or default_registry()).get("drafter", self.drafter).available_for(target):
            return self
        log.info(
            "no %s head for target %r: drafting with %s instead", self.drafter, target.name, FALLBACK_DRAFTER
        )
        return self.model_copy(update={"drafter": FALLBACK_DRAFTER})


def _validate_params(plugin_cls: type[Plugin], params: dict[str, Any], field: str) -> BaseModel:
    try:
        return plugin_cls.Params.model_validate(params)
    except ValidationError as error:
        raise ValueError(f"{field} for {plugin_cls.name!r}: {_first_problem(error)}") from None


def _first_problem(error: ValidationError) -> str:
    """``field: message`` of the first problem, without pydantic's "Value error, " prefix."""
    problem = error.errors()[0]
    where = ".".join(str(part) for part in problem["loc"])
    message = problem["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


ConfigT = TypeVar("ConfigT", bound=BaseModel)


def build_config(model: type[ConfigT], data: dict[str, Any]) -> ConfigT:
    """Validate ``data`` into ``model``; any problem becomes a one-line :class:`ConfigError`."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        # Errors from plugin lookups arrive wrapped; surface them unchanged.
        cause = error.errors()[0].get("ctx", {}).get("error")
        if isinstance(cause, ConfigError):
            raise cause from None
        raise ConfigError(f"invalid config: {_first_problem(error)}") from None


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file into a plain dict, with a clear error if it is unreadable."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from None


def load_layered_toml(path: str | Path, extending: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A TOML file merged key by key over the file its ``base`` key names (relative to it).

    Configs that must hold on equal terms (the shipped block heads' recipes, a bench line-up and
    its subset) state only how they differ from the one they extend, so that the equality holds
    by construction, not by copying.
    """
    path = Path(path).resolve()
    if path in extending:
        chain = " -> ".join(str(p) for p in (*extending, path))
        raise ConfigError(f"config files extend each other in a circle: {chain}")
    data = load_toml(path)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base must be the path of another config file, got {base!r}")
    return merge(load_layered_toml(path.parent / base, (*extending, path)), data)


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``overrides`` (CLI flags that were given) into ``base`` (the TOML file)."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged
