"""The comparison as separate cases (method x data set x budget), for pytest-benchmark.

pytest-benchmark times one callable per test, so the side-by-side run is cut into cases:
each data set's ``ar`` reference is computed once per session (it fixes the prompts of
later turns, the tokens every method must reproduce and the tokens/s speedups divide by),
then each case times its method on exactly those prompts. Timings come from the same
:class:`~jetflow.bench.generation.Method` objects as ``jetflow bench``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from jetflow.bench.config import AR, BenchConfig
from jetflow.bench.generation import Method
from jetflow.bench.lossless import LosslessChecker
from jetflow.bench.metrics import TurnRecord, decode_tokens_per_s, summarise, tokens_per_s
from jetflow.bench.runner import BenchmarkRunner, apply_threads, turn_prompt_ids
from jetflow.core.config import Budget
from jetflow.core.precision import dtype_name, resolve_dtype
from jetflow.core.target import Target
from jetflow.data.prompt_sets import FILE_PREFIX, load_dataset_samples

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchCase:
    """One benchmark: a method (at a budget) on a data set."""

    dataset: str
    method: str
    budget: Budget | None = None

    @property
    def id(self) -> str:
        """The pytest id, hence the benchmark name ``--benchmark-compare`` matches on."""
        budget = "" if self.budget is None else f"-B{self.budget}"
        dataset = self.dataset
        if dataset.startswith(FILE_PREFIX):  # the file name, not its whole path
            dataset = FILE_PREFIX + Path(dataset[len(FILE_PREFIX) :]).stem
        return f"{dataset}-{self.method}{budget}"


def bench_cases(config: BenchConfig) -> list[BenchCase]:
    """Every case of a config, data set by data set, baselines before drafters."""
    methods: list[tuple[str, Budget | None]] = [(AR, None), *((name, None) for name in config.baselines)]
    methods += [(spec.method, budget) for spec in config.drafter_specs for budget in config.budgets]
    return [BenchCase(dataset, name, budget) for dataset in config.datasets for name, budget in methods]


@dataclass
class CaseRun:
    """One case's rounds: call :meth:`once` per round, then hand it to :meth:`BenchSuite.finish`."""

    method: Method
    dataset: str
    reference: Sequence[TurnRecord]
    checker: LosslessChecker
    max_new_tokens: int
    records: list[TurnRecord] = field(default_factory=list)

    def once(self) -> None:
        """Generate every reference turn's prompt once (one pytest-benchmark round)."""
        for ref in self.reference:
            generation = self.method.generate(ref.prompt_ids, self.max_new_tokens)
            divergence = self.checker.check(
                ref.sample_id, ref.turn, ref.prompt_ids, ref.generation.token_ids, generation.token_ids
            )
            self.records.append(TurnRecord(ref.sample_id, ref.turn, ref.prompt_ids, generation, divergence))


class BenchSuite:
    """Session state: the config, the target (loaded on first use), methods, references."""

    def __init__(self, config: BenchConfig, target: Target | None = None) -> None:
        self.config = config
        self._target = target
        self._references: dict[str, list[TurnRecord]] = {}
        self._ar_records: dict[str, list[TurnRecord]] = {}
        self._warm: set[int] = set()

    @cached_property
    def target(self) -> Target:
        apply_threads(self.config)
        return self._target or Target.load(self.config.target, resolve_dtype(self.config.dtype))

    @cached_property
    def runner(self) -> BenchmarkRunner:
        """Holds the suite's methods (``ar`` first) and its lossless checker."""
        return BenchmarkRunner(self.config, self.target)

    def method(self, case: BenchCase) -> Method:
        for method in self.runner.methods:
            if method.name == case.method and method.budget == case.budget:
                return method
        raise KeyError(f"no method {case.method!r} at budget {case.budget} in this suite's config")

    def reference(self, dataset: str) -> list[TurnRecord]:
        """``ar`` on every turn of the data set, computed once per session."""
        if dataset not in self._references:
            samples = load_dataset_samples(dataset, self.config.limit)
            ar = self.runner.methods[0]
            if samples:
                self._warm_up(ar, turn_prompt_ids(self.target, samples[0], 0, []))
            ar_only = BenchmarkRunner(self.config, self.target, methods=[ar])
            self._references[dataset] = ar_only.run_dataset(samples)[0]
            self._ar_records[dataset] = list(self._references[dataset])
            log.info("%s: ar reference over %d turns", dataset, len(self._references[dataset]))
        return self._references[dataset]

    def prepare(self, case: BenchCase) -> CaseRun:
        """Reference and warm-up outside the timed rounds; returns the case to time."""
        reference = self.reference(case.dataset)
        method = self.method(case)
        if reference:
            self._warm_up(method, reference[0].prompt_ids)
        return CaseRun(method, case.dataset, reference, self.runner.checker, self.config.max_new_tokens)

    def finish(self, run: CaseRun) -> dict[str, object]:
        """The case's results row over all its rounds.

        The speedup divides by ``ar``'s tokens/s over every ``ar`` pass of the session on
        this data set (the reference pass, plus the ``ar`` case's rounds once it has run),
        so one unlucky pass on a busy machine does not skew every ratio.
        """
        ar_records = self._ar_records[run.dataset]
        if run.method is self.runner.methods[0]:
            ar_records.extend(run.records)
        dtype = dtype_name(self.target.dtype)
        speeds = tokens_per_s(ar_records), decode_tokens_per_s(ar_records)
        return summarise(run.method, run.dataset, dtype, run.records, *speeds)

    def _warm_up(self, method: Method, prompt_ids: Sequence[int]) -> None:
        """One short untimed generation the first time a method is used."""
        if id(method) not in self._warm and self.config.warmup_tokens:
            method.generate(prompt_ids, self.config.warmup_tokens)
            self._warm.add(id(method))
