"""The engine: one target, drafter, tree policy and verifier, and the budget they run at.

Its loop (:mod:`jetflow.core.decoding`) drafts a tree per sequence, verifies them in one target
forward, accepts, commits and repeats, for one prompt or a batch. With no drafter the same loop
verifies a one-node tree each step: the autoregressive baseline every speedup is measured against.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

from jetflow.core.adaptive import AdaptiveBudget
from jetflow.core.calibration_record import Calibration, CalibrationKey
from jetflow.core.calibration_store import BudgetSource, cached_calibration, calibrate_command, compiling_pays
from jetflow.core.compiled import CompiledForward, built_buckets
from jetflow.core.config import DEFAULT_BUDGET, GenerateConfig
from jetflow.core.contracts import (
    Drafter,
    TreePolicy,
    TreeShape,
    Verifier,
)
from jetflow.core.decoding import BatchRun
from jetflow.core.errors import ConfigError, TargetError
from jetflow.core.precision import resolve_dtype
from jetflow.core.prompt import Prompt, check_messages, check_text, check_token_ids, prompt_items
from jetflow.core.registry import Registry, default_registry
from jetflow.core.result import GenerationResult
from jetflow.core.target import Target

log = logging.getLogger(__name__)


class Engine:
    """One target, one drafter, one tree policy and one verifier, ready to generate.

    The engine reads nothing from disk beyond the target and the drafter's weights: where its
    budget is left to jetflow (``auto`` or unset), the calibration it runs from is handed to it
    (``calibration``), and :meth:`from_cache` is the constructor that looks one up in the cache.
    """

    def __init__(
        self,
        config: GenerateConfig,
        target: Target | None = None,
        registry: Registry | None = None,
        calibration: Calibration | None = None,
    ) -> None:
        self._assemble(config, target, registry)
        self._start(calibration)

    @classmethod
    def from_cache(
        cls, config: GenerateConfig, target: Target | None = None, registry: Registry | None = None
    ) -> Engine:
        """An engine whose budget, where left to jetflow, comes from the calibration cached for
        its setup; with ``compile`` unset it compiles where the cached calibrations show that
        compiling pays. ``auto`` with nothing cached is a :class:`ConfigError` naming the command
        that measures it."""
        engine = cls.__new__(cls)
        engine._assemble(config, target, registry)
        calibration = None
        asked_to_compile = engine.config.compile is True
        if engine.drafter is not None:
            key = engine.calibration_key(compiled=False)
            if engine.config.compile is None:  # the calibration's choice, with what was built for it
                pays = compiling_pays(key) and bool(built_buckets(engine.target.model))
                engine.config = engine.config.model_copy(update={"compile": pays})
            compiled = key.model_copy(update={"compiled": bool(engine.config.compile)})
            calibration = cached_calibration(compiled, engine.config.tree.budget, engine.config.target)
        engine._start(calibration, build_packages=asked_to_compile)
        return engine

    def _assemble(self, config: GenerateConfig, target: Target | None, registry: Registry | None) -> None:
        """The target and the plugins ``config`` names, built from the registry."""
        registry = registry or default_registry()
        self.target = target or Target.load(config.target, resolve_dtype(config.dtype))
        config = config.with_available_drafter(self.target, registry)
        self.config = config
        self.drafter: Drafter | None = None
        policy_name = config.tree.policy or "chain"
        if config.uses_drafter:
            drafter_cls = registry.get("drafter", config.drafter)
            self.drafter = drafter_cls(drafter_cls.Params.model_validate(config.drafter_params), self.target)
            policy_name = config.tree.policy or drafter_cls.default_tree_policy
        policy_cls = registry.get("tree_policy", policy_name)
        self.policy: TreePolicy = policy_cls(policy_cls.Params.model_validate(config.tree.params))
        verifier_cls = registry.get("verifier", config.verifier)
        self.verifier: Verifier = verifier_cls(verifier_cls.Params.model_validate(config.verifier_params))

    def _start(self, calibration: Calibration | None, build_packages: bool = True) -> None:
        """Compile as configured and take the budget (from ``calibration`` where it is left to jetflow).

        ``build_packages`` False (compiling chosen by a calibration, not asked for): only the
        tree sizes already compiled on this machine run compiled, so no run waits minutes for one.
        """
        if self.target.compiled is None and self.config.compile:  # shared by every engine on this target
            self.target.use_compiled(CompiledForward(self.target.model, build=build_packages))
        self.budget_source: BudgetSource = "fixed"
        #: re-chooses the budget every step when it comes from a calibration (``tree.adapt``)
        self.adaptive: AdaptiveBudget | None = None
        self.shape = TreeShape(
            self._resolve_budget(calibration), self.config.tree.width, self.config.tree.max_depth
        )
        if self.target.compiled is not None:  # the packages this engine's trees can use, before any timing
            largest = self.adaptive.largest if self.adaptive is not None else self.shape.budget
            self.target.compiled.load(rows=1 + largest if self.drafter is not None else 1)
        if self.drafter is not None:  # ... and what drafting them needs
            budgets = self.adaptive.budgets.tolist() if self.adaptive is not None else [self.shape.budget]
            self.drafter.prepare(
                sorted({min(budget, self.shape.max_depth) for budget in budgets if budget > 0})
            )
        self._serving = threading.Lock()  # held by the generation in progress

    def calibration_key(self, compiled: bool | None = None) -> CalibrationKey:
        """The key this engine's setup is calibrated under (``compiled`` None: as the target runs now)."""
        if self.drafter is None:
            raise ConfigError("calibration needs a drafter (the budget of plain decoding is always 0)")
        return CalibrationKey.of(
            self.target, self.drafter, self.policy, self.verifier, self.config.tree, compiled=compiled
        )

    def _resolve_budget(self, calibration: Calibration | None) -> int:
        """A fixed budget as given; ``auto`` or unset from ``calibration`` (unset and none: the default)."""
        budget = self.config.tree.budget
        if isinstance(budget, int):
            return budget
        if self.drafter is None:  # the baseline verifies the root alone
            self.budget_source = "default"
            return DEFAULT_BUDGET
        key = self.calibration_key()
        if calibration is None:
            if budget == "auto":
                raise ConfigError(
                    f"budget 'auto' needs a calibration of {key.describe()}: pass one, or build the "
                    f"engine with Engine.from_cache to use the one `{calibrate_command(key)}` caches"
                )
            self.budget_source = "default"
            return DEFAULT_BUDGET
        if calibration.key != key:
            raise ConfigError(
                f"the calibration given was measured for {calibration.key.describe()}, "
                f"not for this engine's {key.describe()}"
            )
        log.info("budget %d from calibration: %s", calibration.budget, calibration.reason())
        self.budget_source = "calibrated"
        if self.config.tree.adapt:
            self.adaptive = AdaptiveBudget.from_calibration(calibration)
            self.budget_source = "adaptive"
            return self.adaptive.choice  # the calibration's own choice, by the same rule
        return calibration.budget

    @property
    def budget(self) -> int | None:
        """The fixed budget, or where an adaptive one starts (None for the baseline)."""
        return self.shape.budget if self.drafter else None

    @property
    def largest_budget(self) -> int:
        """The largest tree a step may draft (0 for the baseline)."""
        if self.drafter is None:
            return 0
        return self.adaptive.largest if self.adaptive else self.shape.budget

    @property
    def drafting(self) -> bool:
        """Whether any step may draft: not for the baseline nor at a fixed budget of 0."""
        return self.drafter is not None and self.largest_budget > 0

    @property
    def method(self) -> str:
        """``drafter:policy`` as benchmarks name it, or ``ar`` for the baseline."""
        return f"{self.config.drafter}:{self.policy.name}" if self.drafter else "ar"

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The token ids of ``prompt``: text, chat messages or token ids, each checked first
        (:mod:`jetflow.core.prompt`: ConfigError for a bad value, TypeError for another type)."""
        if isinstance(prompt, str):
            return self.target.encode_prompt(check_text(prompt), chat=self.config.chat_template)
        items = prompt_items(prompt)
        if isinstance(items[0], Mapping):
            return self.target.encode_prompt(check_messages(items))
        return check_token_ids(items, self.target.vocab_size)

    def generate(self, prompt: Prompt, max_new_tokens: int | None = None) -> GenerationResult:
        """Decode ``prompt`` (text, chat messages or token ids) until a stop condition.

        ``max_new_tokens`` (>= 1) overrides the config's for this call. One engine runs one
        generation (or batch) at a time: callers on several threads are served in turn, each
        exactly as if it were alone.
        """
        return self.generate_batch([prompt], max_new_tokens, batch_size=1)[0]

    def generate_batch(
        self, prompts: Sequence[Prompt], max_new_tokens: int | None = None, batch_size: int | None = None
    ) -> list[GenerationResult]:
        """Decode every prompt, ``batch_size`` (default: the config's) at a time; results in input order.

        Every step verifies one tree per sequence in flight, all in one target forward; a
        sequence that finishes hands its row to the next waiting prompt (continuous batching).
        Each sequence's greedy output is what it gives alone.
        """
        limit = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        rows = self.config.batch_size if batch_size is None else batch_size
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if isinstance(prompts, str | Mapping) or not isinstance(prompts, Sequence):
            raise ConfigError("generate_batch takes a list of prompts")
        if not prompts:
            return []
        encoded = [self.prompt_ids(prompt) for prompt in prompts]  # every prompt checked before any work
        needed = [self._positions_needed(ids, limit) for ids in encoded]
        with self._serving:
            return BatchRun(self, encoded, limit, min(rows, len(encoded)), max(needed)).run()

    def _positions_needed(self, ids: list[int], limit: int) -> int:
        """Cache positions a prompt needs (its tokens, its answer, the largest tree), checked
        against the target's context window."""
        needed = len(ids) + limit + self.largest_budget + 1
        if needed > self.target.context_length:
            raise TargetError(
                f"the prompt has {len(ids)} tokens; with max_new_tokens={limit} and a tree of "
                f"{self.largest_budget} it needs {needed} positions, but the target's "
                f"context window is {self.target.context_length}"
            )
        return needed
