"""What a comparison run measures: a frozen pydantic model, loadable from TOML.

It goes through the same machinery as generation configs (``build_config``,
``load_layered_toml``, ``merge``): a config may extend another through its ``base`` key, and
every name in it (drafters, tree policies, data sets) is checked when the config is
validated, so a typo fails in milliseconds instead of after the model has loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from jetflow.bench.lossless import DEFAULT_TIE_TOLERANCE
from jetflow.core.config import AUTO_BUDGET, Budget, TreeConfig, build_config, load_layered_toml, merge
from jetflow.core.errors import ConfigError
from jetflow.core.precision import DtypeName
from jetflow.core.registry import Registry, default_registry
from jetflow.data.prompt_sets import DATASET_NAMES, FILE_PREFIX
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

#: the in-process baselines; ``ar`` (the engine loop without a drafter) always runs
AR = "ar"
HF_GENERATE = "hf-generate"
HF_PROMPT_LOOKUP = "hf-prompt-lookup"
BASELINES: tuple[str, ...] = (HF_GENERATE, HF_PROMPT_LOOKUP)
#: the fields of vLLM's methods (``--vllm``)
VLLM_FIELDS = frozenset({"vllm", "vllm_ngram_tokens"})
#: the batch axis (``--batch-sizes``); left out of a run's settings where it is not asked for
BATCH_FIELDS = frozenset({"batch_sizes"})


def parse_batch_sizes(value: object) -> tuple[int, ...] | None:
    """None, or a non-empty list of distinct integers >= 1 (also as CLI text); else one clear message.

    Each batch size is a run of every method decoding the data set's prompts that many at a
    time (continuous batching); batch size 1 is the engine's per-prompt decoding.
    """
    if value is None:
        return None
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(f"give a list of batch sizes (integers >= 1, e.g. [1, 4, 16]), got {value!r}")
    sizes = []
    for item in value:
        number = item
        if isinstance(item, str) and item.strip().isdigit():
            number = int(item.strip())
        if isinstance(number, bool) or not isinstance(number, int) or number < 1:
            raise ValueError(f"a batch size is an integer >= 1, got {number!r}")
        sizes.append(number)
    twice = sorted({size for size in sizes if sizes.count(size) > 1})
    if twice:
        raise ValueError(f"batch size {twice[0]} is listed twice in {sizes}")
    return tuple(sizes)


@dataclass(frozen=True)
class DrafterSpec:
    """One entry of ``drafters``: a drafter (or a named variant of one) and, optionally, a policy.

    ``method`` is what results call the run: the entry exactly as the user typed it
    (``ngram`` runs the drafter's default policy, ``ngram:chain`` names one, and a variant
    such as ``jetflow-refresh`` is a drafter with its own parameters, see ``variants``).
    """

    drafter: str
    policy: str | None
    variant: str | None = None

    @classmethod
    def parse(cls, text: str, variants: dict[str, str] | None = None) -> DrafterSpec:
        """``variants`` maps variant names to the drafter each one runs."""
        name, _, policy = text.strip().partition(":")
        if not name or (_ and not policy):
            raise ConfigError(f"drafters: {text!r} is not 'name' or 'name:policy'")
        if variants and name in variants:
            return cls(variants[name], policy or None, variant=name)
        return cls(name, policy or None)

    @property
    def label(self) -> str:
        """The drafter or variant name the user typed."""
        return self.variant or self.drafter

    @property
    def method(self) -> str:
        return f"{self.label}:{self.policy}" if self.policy else self.label

    def resolved_policy(self, registry: Registry) -> str:
        """The policy the engine will run: the explicit one, else the drafter's default."""
        return self.policy or registry.get("drafter", self.drafter).default_tree_policy


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BenchTree(_Frozen):
    """Tree shape shared by every drafter run; the budget comes from ``budgets``."""

    width: int = Field(4, ge=1, description="children proposed per expanded node")
    max_depth: int = Field(16, ge=1, description="deepest tree level")


class Variant(_Frozen):
    """A drafter run under its own name with its own parameters (e.g. an ablation arm)."""

    drafter: str = Field(description="the drafter plugin this variant runs")
    params: dict[str, Any] = Field(default_factory=dict, description="its parameters (over drafter_params)")


class BenchConfig(_Frozen):
    """Everything that decides one side-by-side comparison."""

    target: str = Field("default", description="as in `jetflow generate --target`")
    dtype: DtypeName = Field("auto", description="'auto' picks bf16 only where the hardware has it")
    drafters: tuple[str, ...] = Field(("ngram",), description="'name' or 'name:policy' each")
    datasets: tuple[str, ...] = Field(("champ", "humaneval", "mtbench"), min_length=1)
    limit: int | None = Field(20, ge=1, description="first N samples of each data set (None: all)")
    budgets: tuple[Budget, ...] = Field(
        (8, 16, 32),
        min_length=1,
        description=f"tree budgets, each a run per drafter; '{AUTO_BUDGET}': the calibrated one",
    )
    max_new_tokens: int = Field(128, ge=1, description="per turn (MT-Bench has two turns)")
    baselines: tuple[str, ...] = Field(BASELINES, description="transformers peers to run beside 'ar'")
    prompt_lookup_tokens: int = Field(10, ge=1, description="hf-prompt-lookup's prompt_lookup_num_tokens")
    warmup_tokens: int = Field(16, ge=0, description="one untimed generation per method first; 0: none")
    tie_tolerance: float = Field(
        DEFAULT_TIE_TOLERANCE,
        ge=0.0,
        description="bf16/fp16: max logit gap at a divergence that counts as a rounding tie",
    )
    tree: BenchTree = Field(default_factory=BenchTree)
    drafter_params: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per drafter name: its plugin parameters"
    )
    variants: dict[str, Variant] = Field(
        default_factory=dict, description="named drafter variants usable in `drafters`"
    )
    threads: int | None = Field(
        None, ge=1, description="torch CPU threads (None: torch's default); fewer can win on a busy machine"
    )
    temperature: float = Field(
        0.0,
        ge=0.0,
        description="0: greedy, checked token by token against ar; > 0: every method samples at this "
        "temperature (the `sampling` verifier, seeded by `seed`)",
    )
    seed: int = 0
    compile: bool | None = Field(
        None,
        description="jetflow's methods verify through the compiled target (None: where a "
        "calibration with --compile shows it pays; every method then shares that path)",
    )
    vllm: bool = Field(
        False, description="also run vllm, vllm-ngram and vllm-<drafter> (exported heads) in .venv-vllm"
    )
    vllm_ngram_tokens: int = Field(4, ge=1, description="vllm-ngram's num_speculative_tokens")
    batch_sizes: Annotated[tuple[int, ...] | None, BeforeValidator(parse_batch_sizes)] = Field(
        None,
        description="None: each prompt decoded alone (the per-prompt comparison); else each method "
        "decodes all of a data set's prompts this many at a time, once per batch size, against "
        "batched ar at the same size",
    )
    out: str = Field("results", description="folder for results.json, report.md and the plots")

    @model_validator(mode="after")
    def _check_names(self) -> BenchConfig:
        specs = self.drafter_specs
        methods = [spec.method for spec in specs]
        twice = sorted({method for method in methods if methods.count(method) > 1})
        if twice:
            raise ConfigError(f"drafters: {', '.join(twice)} listed more than once")
        if len(set(self.budgets)) != len(self.budgets):
            raise ConfigError(f"budgets: a budget is listed twice in {list(self.budgets)}")
        unknown = [name for name in self.baselines if name not in BASELINES]
        if unknown:
            raise ConfigError(f"unknown baseline {unknown[0]!r}; known baselines: {', '.join(BASELINES)}")
        for name in self.datasets:
            if name not in DATASET_NAMES and not name.startswith(FILE_PREFIX):
                known = ", ".join(DATASET_NAMES)
                raise ConfigError(f"unknown dataset {name!r}; known datasets: {known}, or file:PATH.jsonl")
        registry = default_registry()
        for spec in specs:
            drafter_cls = registry.get("drafter", spec.drafter)  # PluginNotFoundError lists the names
            registry.get("tree_policy", spec.resolved_policy(registry))
            try:
                drafter_cls.Params.model_validate(self.params_of(spec))
            except ValidationError as error:
                problem = error.errors()[0]
                where = ".".join(str(part) for part in problem["loc"])
                section = (
                    f"variants.{spec.variant}.params" if spec.variant else f"drafter_params.{spec.drafter}"
                )
                raise ConfigError(f"{section}.{where}: {problem['msg']}") from None
        stray = set(self.drafter_params) - {spec.drafter for spec in specs}
        if stray:
            raise ConfigError(f"drafter_params for drafters not in the run: {', '.join(sorted(stray))}")
        if self.batch_sizes is not None and self.vllm:
            raise ConfigError("batch_sizes: vLLM's methods are not run with a batch axis; leave out vllm")
        return self

    @property
    def batched(self) -> bool:
        """Whether the run has a batch axis (``batch_sizes``)."""
        return self.batch_sizes is not None

    def settings_dump(self) -> dict[str, Any]:
        """The config as a run's settings record it: the vLLM fields only where vLLM runs and the
        batch axis only where it is asked for, so results written before either existed still
        resume and a per-prompt run's settings are what they always were."""
        left_out = (set() if self.vllm else set(VLLM_FIELDS)) | (set() if self.batched else set(BATCH_FIELDS))
        return self.model_dump(mode="json", exclude=left_out or None)

    @property
    def drafter_specs(self) -> tuple[DrafterSpec, ...]:
        variants = {name: variant.drafter for name, variant in self.variants.items()}
        return tuple(DrafterSpec.parse(text, variants) for text in self.drafters)

    def params_of(self, spec: DrafterSpec) -> dict[str, Any]:
        """The drafter's parameters for a run: ``drafter_params`` with the variant's laid over."""
        params = dict(self.drafter_params.get(spec.drafter, {}))
        return params | (self.variants[spec.variant].params if spec.variant else {})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def verifier_fields(self) -> dict[str, Any]:
        """The GenerateConfig fields that choose the verifier for this run's temperature."""
        if self.greedy:
            return {"verifier": "greedy"}
        return {"verifier": "sampling", "verifier_params": {"temperature": self.temperature}}

    def tree_config(self, spec: DrafterSpec, budget: int | str) -> TreeConfig:
        return TreeConfig(
            policy=spec.policy, budget=budget, width=self.tree.width, max_depth=self.tree.max_depth
        )


def load_bench_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> BenchConfig:
    """A validated :class:`BenchConfig` from an optional TOML file (on top of its ``base``) plus
    overrides (CLI flags)."""
    base = load_layered_toml(path) if path else {}
    return build_config(BenchConfig, merge(base, overrides or {}))
