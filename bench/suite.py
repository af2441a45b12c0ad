"""The comparison as separate cases (method x data set x budget), for pytest-benchmark.

pytest-benchmark times one callable per test, so the side-by-side run is cut into cases:
each data set's ``ar`` reference is computed once per session (it fixes the prompts of
later turns, the tokens every method must reproduce and the tokens/s speedups divide by),
then each case times its method on exactly those prompts. Timings come from the same
:class:`~jetflow.bench.generation.Method` objects as ``jetflow bench``.

With ``batch_sizes`` in the suite's config the cases gain the batch axis (data set x batch
size x method x budget, as ``jetflow bench --batch-sizes``): a case times its method decoding
every prompt of the data set that many at a time, one call per user turn, against batched
``ar`` at that size (once per session, untimed, then with the ``ar`` case's rounds).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import cast

from jetflow.bench.batched import BatchBenchmarkRunner, BatchRun, Turn, summarise_batch
from jetflow.bench.config import AR, HF_GENERATE, BenchConfig
from jetflow.bench.generation import BatchGeneration, BatchMethod, Generation, Method, batchable
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
    #: None: each prompt alone; else every prompt of the data set, this many at a time
    batch_size: int | None = None

    @property
    def id(self) -> str:
        """The pytest id, hence the benchmark name ``--benchmark-compare`` matches on."""
        budget = "" if self.budget is None else f"-B{self.budget}"
        batch = "" if self.batch_size is None else f"-batch{self.batch_size}"
        dataset = self.dataset
        if dataset.startswith(FILE_PREFIX):  # the file name, not its whole path
            dataset = FILE_PREFIX + Path(dataset[len(FILE_PREFIX) :]).stem
        return f"{dataset}-{self.method}{budget}{batch}"


def bench_cases(config: BenchConfig) -> list[BenchCase]:
    """Every case of a config, data set by data set (then batch size by batch size, ascending),
    baselines before drafters."""
    baselines = [name for name in config.baselines if not config.batched or name == HF_GENERATE]
    methods: list[tuple[str, Budget | None]] = [(AR, None), *((name, None) for name in baselines)]
    methods += [(spec.method, budget) for spec in config.drafter_specs for budget in config.budgets]
    if config.batch_sizes is None:
        return [BenchCase(dataset, name, budget) for dataset in config.datasets for name, budget in methods]
    return [
        BenchCase(dataset, name, budget, size)
        for dataset in config.datasets
        for size in sorted(config.batch_sizes)
        for name, budget in methods
    ]


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


@dataclass
class BatchCaseRun:
    """One batched case's rounds: :meth:`once` per round, then :meth:`BenchSuite.finish`."""

    run: BatchRun
    dataset: str
    waves: Sequence[Sequence[Turn]]
    reference: Sequence[BatchGeneration]  # batched ar at the same size, one call per wave
    solo: Mapping[tuple[str, int], Generation]  # ar alone, per (sample, turn)
    runner: BatchBenchmarkRunner
    max_new_tokens: int

    @property
    def method(self) -> Method:
        return self.run.method

    def once(self) -> None:
        """Decode every wave once at the case's batch size (one pytest-benchmark round)."""
        for turns, reference in zip(self.waves, self.reference, strict=True):
            prompts = [turn.prompt_ids for turn in turns]
            call = self.run.method.generate_batch(prompts, self.max_new_tokens, self.run.batch_size)
            self.run.calls.append(call)
            self.runner.check_rows(self.run, turns, call, reference, self.solo)


class BenchSuite:
    """Session state: the config, the target (loaded on first use), methods, references."""

    def __init__(self, config: BenchConfig, target: Target | None = None) -> None:
        self.config = config
        self._target = target
        self._references: dict[str, list[TurnRecord]] = {}
        self._ar_records: dict[str, list[TurnRecord]] = {}
        self._warm: set[int | tuple[int, int]] = set()
        #: per (data set, batch size): ar's batched passes (the untimed one, then the ar case's)
        self._batch_ar: dict[tuple[str, int], BatchRun] = {}
        #: per (data set, batch size): the hf-generate case, once it has run
        self._batch_hf: dict[tuple[str, int], BatchRun] = {}

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

    @cached_property
    def batch_runner(self) -> BatchBenchmarkRunner:
        """The batched comparison over the suite's methods (those that batch)."""
        return BatchBenchmarkRunner(self.config, self.target, methods=self.runner.methods)

    def waves(self, dataset: str) -> list[list[Turn]]:
        """The data set's prompts by user turn, as the ``ar`` reference asked them."""
        waves: list[list[Turn]] = []
        for record in self.reference(dataset):
            while len(waves) <= record.turn:
                waves.append([])
            waves[record.turn].append(Turn(record.sample_id, record.turn, record.prompt_ids))
        return waves

    def batch_reference(self, dataset: str, size: int) -> BatchRun:
        """Batched ``ar`` over every wave of the data set at ``size``, once per session (untimed)."""
        key = (dataset, size)
        if key not in self._batch_ar:
            ar = self.batch_runner.batch_methods[0]
            waves = self.waves(dataset)
            if waves:
                self._warm_up_batch(ar, waves[0], size)
            run = BatchRun(ar, size)
            for turns in waves:
                prompts = [turn.prompt_ids for turn in turns]
                run.calls.append(ar.generate_batch(prompts, self.config.max_new_tokens, size))
                self.batch_runner.check_rows(run, turns, run.calls[-1], run.calls[-1], self._solo(dataset))
            self._batch_ar[key] = run
        return self._batch_ar[key]

    def _solo(self, dataset: str) -> dict[tuple[str, int], Generation]:
        return {(r.sample_id, r.turn): r.generation for r in self.reference(dataset)}

    def prepare(self, case: BenchCase) -> CaseRun | BatchCaseRun:
        """Reference and warm-up outside the timed rounds; returns the case to time."""
        if case.batch_size is not None:
            return self._prepare_batch(case, case.batch_size)
        reference = self.reference(case.dataset)
        method = self.method(case)
        if reference:
            self._warm_up(method, reference[0].prompt_ids)
        return CaseRun(method, case.dataset, reference, self.runner.checker, self.config.max_new_tokens)

    def _prepare_batch(self, case: BenchCase, size: int) -> BatchCaseRun:
        reference = self.batch_reference(case.dataset, size)
        method = self.method(case)
        if not batchable(method):
            raise KeyError(f"{case.method!r} does not decode batches")
        waves = self.waves(case.dataset)
        if waves:
            self._warm_up_batch(cast(BatchMethod, method), waves[0], size)
        return BatchCaseRun(
            BatchRun(cast(BatchMethod, method), size),
            case.dataset,
            waves,
            reference.calls[: len(waves)],
            self._solo(case.dataset),
            self.batch_runner,
            self.config.max_new_tokens,
        )

    def finish(self, run: CaseRun | BatchCaseRun) -> dict[str, object]:
        """The case's results row over all its rounds.

        The speedup divides by ``ar``'s tokens/s over every ``ar`` pass of the session on
        this data set (the reference pass, plus the ``ar`` case's rounds once it has run),
        so one unlucky pass on a busy machine does not skew every ratio; a batched case's by
        batched ``ar``'s at its size, and by ``hf-generate``'s where that case has run.
        """
        if isinstance(run, BatchCaseRun):
            return self._finish_batch(run)
        ar_records = self._ar_records[run.dataset]
        if run.method is self.runner.methods[0]:
            ar_records.extend(run.records)
        dtype = dtype_name(self.target.dtype)
        speeds = tokens_per_s(ar_records), decode_tokens_per_s(ar_records)
        return summarise(run.method, run.dataset, dtype, run.records, *speeds)

    def _finish_batch(self, case: BatchCaseRun) -> dict[str, object]:
        run, key = case.run, (case.dataset, case.run.batch_size)
        ar = self._batch_ar[key]
        if run.method is ar.method:
            ar.calls += run.calls
            ar.records += run.records
        elif run.method.name == HF_GENERATE:
            self._batch_hf[key] = run
        dtype = dtype_name(self.target.dtype)
        return summarise_batch(run, case.dataset, dtype, ar, self._batch_hf.get(key))

    def _warm_up_batch(self, method: BatchMethod, turns: Sequence[Turn], size: int) -> None:
        """One short untimed batch the first time a method runs at a batch size."""
        if (id(method), size) not in self._warm and self.config.warmup_tokens:
            prompts = [turn.prompt_ids for turn in turns[:size]]
            method.generate_batch(prompts, self.config.warmup_tokens, size)
            self._warm.add((id(method), size))

    def _warm_up(self, method: Method, prompt_ids: Sequence[int]) -> None:
        """One short untimed generation the first time a method is used."""
        if id(method) not in self._warm and self.config.warmup_tokens:
            method.generate(prompt_ids, self.config.warmup_tokens)
            self._warm.add(id(method))
