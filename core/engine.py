"""The engine: one target, drafter, tree policy and verifier, and the budget they run at.

Its loop (:mod:`jetflow.core.decoding`) drafts a tree per sequence, verifies them in one target
forward, accepts, commits and repeats, for one prompt or a batch. With no drafter the same loop
verifies a one-node tree each step: the autoregressive baseline every speedup is measured against.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from jetflow.core.adaptive import AdaptiveBudget
from jetflow.core.calibration_record import CalibrationKey
from jetflow.core.calibration_store import BudgetSource, compiling_pays, resolve_budget
from jetflow.core.compiled import CompiledForward
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


class Engine:
    """One target, one drafter, one tree policy and one verifier, ready to generate."""

    def __init__(
        self,
        config: GenerateConfig,
        target: Target | None = None,
        registry: Registry | None = None,
    ) -> None:
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
        if self.target.compiled is None and self._compiles():  # shared by every engine on this target
            self.target.use_compiled(CompiledForward(self.target.model))
        self.budget_source: BudgetSource = "fixed"
        #: re-chooses the budget every step when it comes from a calibration (``tree.adapt``)
        self.adaptive: AdaptiveBudget | None = None
        self.shape = TreeShape(self._resolve_budget(), config.tree.width, config.tree.max_depth)
        self._serving = threading.Lock()  # held by the generation in progress

    def _compiles(self) -> bool:
        """``compile`` as configured; left unset, where this setup's calibrations show it pays."""
        if self.config.compile is not None:
            return self.config.compile
        if self.drafter is None:  # plain decoding has no calibration; it follows a drafted engine
            return False
        key = CalibrationKey.of(
            self.target, self.drafter, self.policy, self.verifier, self.config.tree, compiled=False
        )
        return compiling_pays(key)

    def _resolve_budget(self) -> int:
        """Once per engine: a fixed budget as given; ``auto`` or unset from the cached calibration."""
        budget = self.config.tree.budget
        if isinstance(budget, int):
            return budget
        if self.drafter is None:  # the baseline verifies the root alone
            self.budget_source = "default"
            return DEFAULT_BUDGET
        key = CalibrationKey.of(self.target, self.drafter, self.policy, self.verifier, self.config.tree)
        budget, self.budget_source, calibration = resolve_budget(budget, key, self.config.target)
        if calibration is not None and self.config.tree.adapt:
            self.adaptive = AdaptiveBudget.from_calibration(calibration)
            self.budget_source = "adaptive"
            return self.adaptive.choice  # the calibration's own choice, by the same rule
        return budget

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
