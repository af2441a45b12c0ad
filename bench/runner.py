"""Side-by-side comparison: every method on the same prompts, in one process, one target.

Order of work, chosen for fairness on a shared machine: the target loads once; every method
gets one untimed warm-up generation; then for each prompt (and each user turn) the methods
run one after another, ``ar`` first, so drift in machine load spreads over all of them
instead of penalising whichever ran last. Multi-turn samples (MT-Bench) ask the second
turn after the baseline's own first answer, so every method sees the same second prompt;
both turns are measured. At a temperature above 0 every method samples, so outputs are not
compared token by token (the sampling verifier's exactness is a statistical property, tested
by chi-square tests); the runs then report ``lossless`` as None, "not checked".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import torch
from jetflow.bench.config import AR, BenchConfig
from jetflow.bench.generation import Generation, Method
from jetflow.bench.journal import SampleJournal, check_same_prompt, journal_path
from jetflow.bench.lossless import LosslessChecker
from jetflow.bench.machine import describe_machine
from jetflow.bench.methods import build_methods, calibrate_auto_runs
from jetflow.bench.metrics import TurnRecord, decode_tokens_per_s, summarise, tokens_per_s
from jetflow.bench.results import BenchResults, check_compatible
from jetflow.core.precision import dtype_name, resolve_dtype
from jetflow.core.registry import Registry
from jetflow.core.target import Target
from jetflow.data.prompt_sets import Sample, load_dataset_samples
from tqdm.auto import tqdm

log = logging.getLogger(__name__)


def turn_prompt_ids(target: Target, sample: Sample, turn: int, answers: Sequence[str]) -> tuple[int, ...]:
    """The conversation up to user turn ``turn``, with ``answers`` as the assistant's replies."""
    messages: list[dict[str, str]] = []
    for index in range(turn + 1):
        messages.append({"role": "user", "content": sample.turns[index]})
        if index < turn:
            messages.append({"role": "assistant", "content": answers[index]})
    return tuple(target.encode_prompt(messages))


def load_samples(config: BenchConfig) -> dict[str, list[Sample]]:
    """The first ``limit`` samples of each data set (before any model loads: bad data fails fast)."""
    return {name: load_dataset_samples(name, config.limit) for name in config.datasets}


def apply_threads(config: BenchConfig) -> None:
    """Set torch's CPU threads if the config asks (process-wide, as torch only allows)."""
    if config.threads is not None:
        torch.set_num_threads(config.threads)


def against_reference(reference: str, speed: float, speeds: Mapping[str, float]) -> dict[str, object]:
    """A run's reference method and its speedup over that reference (tokens/s ratio)."""
    base = speeds[reference]
    return {"reference": reference, "speedup_vs_reference": speed / base if base > 0 else 0.0}


def count_turns(samples: Mapping[str, Sequence[Sample]]) -> int:
    return sum(len(sample.turns) for group in samples.values() for sample in group)


class BenchmarkRunner:
    """Runs a list of methods (``ar`` first) over data sets and summarises each run."""

    def __init__(
        self,
        config: BenchConfig,
        target: Target,
        methods: Sequence[Method] | None = None,
        registry: Registry | None = None,
        progress: bool = False,
    ) -> None:
        self.config = config
        self.target = target
        self.methods = list(methods) if methods is not None else build_methods(config, target, registry)
        if not self.methods or self.methods[0].name != AR:
            raise ValueError("the first method must be 'ar', the reference of every comparison")
        self.checker = LosslessChecker(target, config.tie_tolerance)
        self.progress = progress

    # ------------------------------------------------------------------ phases
    def warm_up(self, prompt_ids: Sequence[int]) -> None:
        """One short untimed generation per method: first-call costs stay out of the timings."""
        if self.config.warmup_tokens == 0:
            return
        for method in tqdm(self.methods, desc="warm-up", disable=not self.progress, leave=False):
            method.generate(prompt_ids, self.config.warmup_tokens)

    def run_sample(
        self, sample: Sample, on_generation: Callable[[], None] | None = None
    ) -> list[list[TurnRecord]]:
        """Records per method (same order as ``methods``) of every turn of one sample."""
        records: list[list[TurnRecord]] = [[] for _ in self.methods]
        answers: list[str] = []
        for index in range(len(sample.turns)):
            prompt_ids = turn_prompt_ids(self.target, sample, index, answers)
            generations: dict[str, Generation] = {}
            for method, method_records in zip(self.methods, records, strict=True):
                generation = method.generate(prompt_ids, self.config.max_new_tokens)
                generations[method.name] = generation
                reference = generations[method.reference]
                record = TurnRecord(sample.id, index, prompt_ids, generation)
                if generation is not reference and self.config.greedy:
                    record = self._compare(method, record, reference)
                method_records.append(record)
                if on_generation:
                    on_generation()
            answers.append(self.target.decode(list(generations[AR].token_ids)))
        return records

    def run_dataset(
        self,
        samples: Sequence[Sample],
        on_generation: Callable[[], None] | None = None,
        journal: SampleJournal | None = None,
    ) -> list[list[TurnRecord]]:
        """Records per method (same order as ``methods``), every method on every turn.

        Samples in ``journal`` (measured by an earlier process) are read back instead of run;
        every sample this process measures is journaled as soon as it ends.
        """
        records: list[list[TurnRecord]] = [[] for _ in self.methods]
        for sample in samples:
            if journal is not None and sample.id in journal.finished:
                sample_records = journal.finished[sample.id]
                check_same_prompt(sample_records, turn_prompt_ids(self.target, sample, 0, []), journal.path)
            else:
                sample_records = self.run_sample(sample, on_generation)
                if journal is not None:
                    journal.append(sample.id, sample_records)
            for method_records, more in zip(records, sample_records, strict=True):
                method_records.extend(more)
        return records

    def _compare(self, method: Method, record: TurnRecord, reference: Generation) -> TurnRecord:
        """``record`` with its divergence from the reference, if any (logged: bugs as errors)."""
        divergence = self.checker.check(
            record.sample_id, record.turn, record.prompt_ids, reference.token_ids, record.generation.token_ids
        )
        if divergence is None:
            return record
        level = logging.ERROR if divergence.kind == "bug" else logging.INFO
        log.log(
            level,
            "%s diverges from %s on %s turn %d: %s",
            method.name,
            method.reference,
            record.sample_id,
            record.turn,
            divergence,
        )
        return replace(record, divergence=divergence)

    def _checked(self) -> dict[str, object]:
        """Sampled outputs are not comparable token by token: their runs say so."""
        return {} if self.config.greedy else {"lossless": None}

    def settings(self, samples: Mapping[str, Sequence[Sample]]) -> dict[str, object]:
        """What decides the run's figures (recorded in results.json, compared on resume)."""
        vllm = {"left_out": {k: v for m in self.methods for k, v in m.left_out.items()}}
        return {
            **self.config.settings_dump(),
            "resolved_dtype": dtype_name(self.target.dtype),
            "methods": [{"method": m.name, "budget": m.budget, "policy": m.policy} for m in self.methods],
            **(vllm if self.config.vllm else {}),
            "n_samples": {name: len(group) for name, group in samples.items()},
        }

    def _rows(
        self, dataset: str, records: Sequence[Sequence[TurnRecord]], dtype: str
    ) -> list[dict[str, object]]:
        """One results row per method of a measured data set."""
        speeds = {m.name: tokens_per_s(r) for m, r in zip(self.methods, records, strict=True)}
        ar_decode = decode_tokens_per_s(records[0])
        rows = []
        for method, method_records in zip(self.methods, records, strict=True):
            row = summarise(method, dataset, dtype, method_records, speeds[AR], ar_decode)
            row |= against_reference(method.reference, tokens_per_s(method_records), speeds)
            rows.append(row | {"temperature": self.config.temperature} | self._checked())
        return rows

    def _open_journal(self, folder: Path, dataset: str, results: BenchResults, resume: bool) -> SampleJournal:
        path = journal_path(folder, dataset)
        return SampleJournal.open(path, results.target, results.settings, results.machine, resume)

    def _start(
        self, samples: Mapping[str, Sequence[Sample]], previous: BenchResults | None
    ) -> tuple[BenchResults, dict[str, Sequence[Sample]]]:
        """The results to fill (``previous``' runs kept, its settings checked) and the data sets
        left to measure."""
        results = BenchResults(describe_machine(), self.target.name, self.settings(samples))
        if previous is not None:
            check_compatible(previous, results, across_datasets=True)
            results.runs = list(previous.runs)
        done = {run["dataset"] for run in results.runs}
        todo = {name: group for name, group in samples.items() if name not in done and group}
        if done:
            log.info("resuming: %s already measured", ", ".join(sorted(done)))
        if not todo:
            log.warning("no samples to run")
        return results, todo

    def run(
        self,
        samples: Mapping[str, Sequence[Sample]],
        previous: BenchResults | None = None,
        on_dataset: Callable[[BenchResults], None] | None = None,
        journal_dir: Path | None = None,
        resume: bool = False,
    ) -> BenchResults:
        """Warm up, run every data set, and summarise one row per method x data set x budget.

        Data sets already in ``previous`` (a resumed run with the same settings) are kept as
        they are; ``on_dataset`` sees the results after each data set (to save them). With a
        ``journal_dir`` every finished sample is journaled there until its data set is saved,
        and ``resume`` goes on from the samples an earlier process journaled.
        """
        dtype = dtype_name(self.target.dtype)
        results, todo = self._start(samples, previous)
        if not todo:
            return results
        with ExitStack() as stack:
            journals = {
                name: stack.enter_context(self._open_journal(journal_dir, name, results, resume))
                for name in todo
                if journal_dir is not None
            }
            first = next(iter(todo.values()))[0]
            self.warm_up(turn_prompt_ids(self.target, first, 0, []))
            turns = sum(
                len(sample.turns)
                for name, group in todo.items()
                for sample in group
                if name not in journals or sample.id not in journals[name].finished
            )
            with tqdm(
                total=turns * len(self.methods), desc="generations", unit="gen", disable=not self.progress
            ) as bar:
                for name, group in todo.items():
                    bar.set_postfix_str(name)
                    records = self.run_dataset(group, on_generation=bar.update, journal=journals.get(name))
                    results.runs += self._rows(name, records, dtype)
                    if on_dataset:
                        on_dataset(results)
                    if name in journals:
                        journals[name].remove()
        return results


def run_benchmark(
    config: BenchConfig,
    target: Target | None = None,
    registry: Registry | None = None,
    progress: bool = False,
    previous: BenchResults | None = None,
    on_dataset: Callable[[BenchResults], None] | None = None,
    journal_dir: Path | None = None,
    resume: bool = False,
    kept_calibrations: Path | None = None,
) -> BenchResults:
    """Load the data, then the target (once), and run the whole comparison (or what
    ``previous``, a run with the same settings, has not measured yet; ``journal_dir`` and
    ``resume``: see :meth:`BenchmarkRunner.run`; ``kept_calibrations``: see
    :func:`~jetflow.bench.methods.calibrate_auto_runs`). With ``batch_sizes`` the comparison is
    :class:`~jetflow.bench.batched.BatchBenchmarkRunner`'s (a data set is its unit of resume:
    no sample journal)."""
    samples = load_samples(config)
    apply_threads(config)
    if target is None:
        target = Target.load(config.target, resolve_dtype(config.dtype))
    log.info("target %s (%s), %d generations", target.name, dtype_name(target.dtype), count_turns(samples))
    calibrate_auto_runs(config, target, registry, progress, kept=kept_calibrations, resume=resume)
    if config.batched:
        from jetflow.bench.batched import BatchBenchmarkRunner

        batched = BatchBenchmarkRunner(config, target, registry=registry, progress=progress)
        return batched.run(samples, previous, on_dataset)
    runner = BenchmarkRunner(config, target, registry=registry, progress=progress)
    return runner.run(samples, previous, on_dataset, journal_dir, resume)
