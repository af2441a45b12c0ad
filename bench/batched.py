"""The batch axis of a comparison: every method at every batch size, on the same prompts.

``jetflow bench --batch-sizes 1,4,16``: for each data set and each batch size B, every method
decodes all of the data set's prompts in one batched call (``Engine.generate_batch``, continuous
batching; left-padded batches of ``transformers.generate`` for ``hf-generate``), ``ar`` first, and
its throughput is every row's new tokens over the call's wall time. Speedups divide by batched
``ar`` at the same B, and by batched ``hf-generate``, the outside reference. Multi-turn samples
(MT-Bench) go in waves: every sample's first turn in one call, then every second turn, asked after
``ar``'s own first answer at batch size 1, so every method at every batch size sees the same
prompts.

Lossless, per sequence: each row's tokens against batched ``ar``'s at the same B and against
``ar`` at batch size 1 (the per-prompt output; an extra pass, not reported as a row, where 1 is
not among the batch sizes), each first divergence classified by
:class:`~jetflow.bench.lossless.LosslessChecker`: batching changes the target's GEMM shapes as
trees do, so where rounding can differ a tie is rounding and anything else is a bug.

Batch sizes run in ascending order, the methods one after another within each, so each ratio
compares calls seconds apart. A data set is the unit of resume: its rows are saved when its last
batch size ends (no sample journal: one call holds every sample).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from jetflow.bench.config import AR, HF_GENERATE, BenchConfig
from jetflow.bench.generation import BatchGeneration, BatchMethod, Generation, Method, batchable
from jetflow.bench.lossless import Divergence
from jetflow.bench.methods import build_methods
from jetflow.bench.metrics import TurnRecord, accept_histogram, budget_histogram
from jetflow.bench.results import BenchResults
from jetflow.bench.runner import BenchmarkRunner, turn_prompt_ids
from jetflow.core.precision import dtype_name
from jetflow.core.registry import Registry
from jetflow.core.target import Target
from jetflow.data.prompt_sets import Sample
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

#: why a method of the per-prompt comparison has no batched run
NOT_BATCHED = "transformers' prompt lookup decodes one sequence at a time"


@dataclass(frozen=True)
class Turn:
    """One prompt of a wave: a sample's user turn, asked after ar's answers to the earlier ones."""

    sample_id: str
    turn: int
    prompt_ids: tuple[int, ...]


@dataclass
class BatchRun:
    """One method at one batch size over a data set: its calls (one per wave) and its rows.

    ``records`` hold each row and its first divergence from batched ``ar`` at the same size;
    ``solo_divergences`` those from ``ar`` at batch size 1.
    """

    method: BatchMethod
    batch_size: int
    calls: list[BatchGeneration] = field(default_factory=list)
    records: list[TurnRecord] = field(default_factory=list)
    solo_divergences: list[Divergence] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return sum(call.wall_s for call in self.calls)

    @property
    def new_tokens(self) -> int:
        return sum(len(record.generation.token_ids) for record in self.records)

    @property
    def tokens_per_s(self) -> float:
        """Every row's new tokens over the wall time of the calls that decoded them."""
        wall = self.wall_s
        return self.new_tokens / wall if wall > 0 else 0.0


def wave(
    target: Target, samples: Sequence[Sample], turn: int, answers: Mapping[str, Sequence[str]]
) -> list[Turn]:
    """User turn ``turn`` of every sample that has one, after ``answers`` to the earlier turns."""
    return [
        Turn(sample.id, turn, turn_prompt_ids(target, sample, turn, answers.get(sample.id, ())))
        for sample in samples
        if len(sample.turns) > turn
    ]


def merged_histogram(histograms: Sequence[dict[str, int] | None]) -> dict[str, int] | None:
    """The sum of per-call histograms (JSON keys, ascending); None if any call has none."""
    counts: Counter[int] = Counter()
    for histogram in histograms:
        if histogram is None:
            return None
        counts.update({int(key): value for key, value in histogram.items()})
    return {str(key): counts[key] for key in sorted(counts)}


def mean_of(histogram: dict[str, int] | None) -> float | None:
    """The mean value of a histogram (value -> count), None if there is none."""
    if not histogram:
        return None
    return sum(int(value) * count for value, count in histogram.items()) / sum(histogram.values())


def against(batch_size: int) -> str:
    """How a divergence names the ``ar`` run it left."""
    return f"ar at batch {batch_size}"


def summarise_batch(
    run: BatchRun,
    dataset: str,
    dtype: str,
    ar: BatchRun,
    hf: BatchRun | None = None,
) -> dict[str, object]:
    """One ``runs`` entry of a batched comparison (results.json's common keys first).

    ``tokens_per_s`` is the batch's throughput (every row's tokens over the calls' wall time);
    ``tau`` each sequence's tokens per forward it took part in; ``mean_latency_s`` a sequence's
    time from its admission to its last token; ``mean_batch_budget`` the nodes drafted across all
    rows per forward; ``budget`` the per-sequence budget asked for (an ``auto`` run: where its
    adaptive budget started). ``divergences`` hold the first divergence of each row from batched
    ``ar`` at the same size and from ``ar`` at batch size 1, each naming its reference (``against``).
    """
    generations: list[Generation] = [record.generation for record in run.records]
    wall, tokens, speed = run.wall_s, run.new_tokens, run.tokens_per_s
    row_steps = sum(call.row_steps for call in run.calls)
    forwards = sum(call.forwards for call in run.calls)
    same = [(d, against(run.batch_size)) for d in (r.divergence for r in run.records) if d is not None]
    divergences = [*same, *((d, against(1)) for d in run.solo_divergences)]
    prefills = [g.prefill_s for g in generations]
    totals = merged_histogram([call.batch_budgets for call in run.calls])
    latencies = [g.wall_s for g in generations]
    ar_speed = ar.tokens_per_s
    hf_speed = hf.tokens_per_s if hf is not None else 0.0
    return {
        "method": run.method.name,
        "dataset": dataset,
        "budget": run.method.budget,
        "n_prompts": len({record.sample_id for record in run.records}),
        "new_tokens": tokens,
        "tau": tokens / row_steps if row_steps else 0.0,
        "tokens_per_s": speed,
        "speedup_vs_ar": speed / ar_speed if ar_speed > 0 else 0.0,
        "draft_share": sum(call.draft_s for call in run.calls) / wall if wall > 0 else 0.0,
        "lossless": all(d.kind != "bug" for d, _ in divergences),
        "dtype": dtype,
        "batch_size": run.batch_size,
        "speedup_vs_hf_generate": speed / hf_speed if hf_speed > 0 else None,
        "mean_latency_s": sum(latencies) / len(latencies) if latencies else 0.0,
        "max_latency_s": max(latencies, default=0.0),
        "mean_batch_budget": mean_of(totals),
        "mean_rows": row_steps / forwards if forwards else 0.0,
        "policy": run.method.policy,
        "n_turns": len(run.records),
        "steps": row_steps,
        "forwards": forwards,
        "wall_s": wall,
        "verify_share": sum(call.verify_s for call in run.calls) / wall if wall > 0 else 0.0,
        "prefill_share": None if None in prefills or wall <= 0 else sum(p or 0.0 for p in prefills) / wall,
        "accept_histogram": accept_histogram(run.records),
        "budget_histogram": budget_histogram(run.records),
        "batch_budget_histogram": totals,
        "rounding_ties": sum(d.kind == "tie" for d, _ in divergences),
        "divergences": [d.as_dict() | {"against": name} for d, name in divergences],
    }


class BatchBenchmarkRunner(BenchmarkRunner):
    """Runs every method that batches (``ar`` first) at every batch size over data sets."""

    def __init__(
        self,
        config: BenchConfig,
        target: Target,
        methods: Sequence[Method] | None = None,
        registry: Registry | None = None,
        progress: bool = False,
    ) -> None:
        if config.batch_sizes is None:
            raise ValueError("a batched comparison needs batch_sizes")
        every = list(methods) if methods is not None else build_methods(config, target, registry)
        #: methods of the per-prompt comparison with no batched run, and why
        self.left_out = {method.name: NOT_BATCHED for method in every if not batchable(method)}
        for name, reason in self.left_out.items():
            log.warning("%s is not in the batched comparison: %s", name, reason)
        super().__init__(config, target, [m for m in every if batchable(m)], registry, progress)
        self.batch_methods = cast(list[BatchMethod], self.methods)  # each one batchable
        self.batch_sizes = sorted(config.batch_sizes)

    def settings(self, samples: Mapping[str, Sequence[Sample]]) -> dict[str, object]:
        settings = super().settings(samples)
        return settings | ({"left_out": dict(self.left_out)} if self.left_out else {})

    # ------------------------------------------------------------------ phases
    def measure(self, samples: Sequence[Sample], on_call: Callable[[], None] | None = None) -> list[BatchRun]:
        """Every method at every batch size over ``samples``: runs in batch-size order, ``ar``
        first within each."""
        ar = self.batch_methods[0]
        solo: dict[tuple[str, int], Generation] = {}
        answers: dict[str, list[str]] = {}
        waves = max(len(sample.turns) for sample in samples)
        if 1 not in self.batch_sizes:  # the per-prompt reference, not a row of the results
            self._warm_up_at(ar, samples, 1)
            for turn in range(waves):
                turns = wave(self.target, samples, turn, answers)
                self._keep_solo(
                    turns,
                    ar.generate_batch(self._prompts(turns), self.config.max_new_tokens, 1),
                    solo,
                    answers,
                )
                if on_call:
                    on_call()
        runs: list[BatchRun] = []
        for size in self.batch_sizes:
            for method in self.batch_methods:
                self._warm_up_at(method, samples, size)
            at_size = [BatchRun(method, size) for method in self.batch_methods]
            for turn in range(waves):
                turns = wave(self.target, samples, turn, answers)
                reference: BatchGeneration | None = None
                for run in at_size:
                    call = run.method.generate_batch(self._prompts(turns), self.config.max_new_tokens, size)
                    run.calls.append(call)
                    if run.method is ar:
                        reference = call
                        if size == 1:
                            self._keep_solo(turns, call, solo, answers)
                    assert reference is not None  # ar comes first
                    self.check_rows(run, turns, call, reference, solo)
                    if on_call:
                        on_call()
            runs += at_size
        return runs

    def calls_per_dataset(self, samples: Sequence[Sample]) -> int:
        """Batched calls :meth:`measure` makes over ``samples`` (for the progress bar)."""
        waves = max(len(sample.turns) for sample in samples)
        solo = 0 if 1 in self.batch_sizes else waves
        return solo + waves * len(self.batch_sizes) * len(self.batch_methods)

    def _prompts(self, turns: Sequence[Turn]) -> list[tuple[int, ...]]:
        return [turn.prompt_ids for turn in turns]

    def _warm_up_at(self, method: BatchMethod, samples: Sequence[Sample], size: int) -> None:
        """One short untimed batch at ``size``: first-call costs of its shapes stay out of the timings."""
        if self.config.warmup_tokens == 0:
            return
        turns = wave(self.target, samples[:size], 0, {})
        method.generate_batch(self._prompts(turns), self.config.warmup_tokens, size)

    def _keep_solo(
        self,
        turns: Sequence[Turn],
        call: BatchGeneration,
        solo: dict[tuple[str, int], Generation],
        answers: dict[str, list[str]],
    ) -> None:
        """ar's rows at batch size 1: the per-prompt reference, and the answers later turns follow."""
        for turn, row in zip(turns, call.rows, strict=True):
            solo[turn.sample_id, turn.turn] = row
            answers.setdefault(turn.sample_id, []).append(self.target.decode(list(row.token_ids)))

    def check_rows(
        self,
        run: BatchRun,
        turns: Sequence[Turn],
        call: BatchGeneration,
        reference: BatchGeneration,
        solo: Mapping[tuple[str, int], Generation],
    ) -> None:
        """Add ``call``'s rows to ``run``, each compared (greedy runs) with ``reference``'s (batched ar
        at the same size) and with ``solo``'s (ar at batch size 1)."""
        greedy = self.config.greedy
        for turn, row, ar_row in zip(turns, call.rows, reference.rows, strict=True):
            same = None
            if greedy and call is not reference:
                same = self._diverges(run, turn, ar_row, row, run.batch_size)
            run.records.append(TurnRecord(turn.sample_id, turn.turn, turn.prompt_ids, row, same))
            if greedy and run.batch_size != 1:
                divergence = self._diverges(run, turn, solo[turn.sample_id, turn.turn], row, 1)
                if divergence is not None:
                    run.solo_divergences.append(divergence)

    def _diverges(
        self, run: BatchRun, turn: Turn, reference: Generation, row: Generation, size: int
    ) -> Divergence | None:
        """``row``'s classified first divergence from ``reference`` (ar at batch ``size``), logged."""
        divergence = self.checker.check(
            turn.sample_id, turn.turn, turn.prompt_ids, reference.token_ids, row.token_ids
        )
        if divergence is not None:
            level = logging.ERROR if divergence.kind == "bug" else logging.INFO
            log.log(
                level,
                "%s at batch %d diverges from %s on %s turn %d: %s",
                run.method.name,
                run.batch_size,
                against(size),
                turn.sample_id,
                turn.turn,
                divergence,
            )
        return divergence

    def batch_rows(self, dataset: str, runs: Sequence[BatchRun], dtype: str) -> list[dict[str, object]]:
        """One results row per batch size x method of a measured data set."""
        rows = []
        for size in self.batch_sizes:
            at_size = [run for run in runs if run.batch_size == size]
            ar = next(run for run in at_size if run.method.name == AR)
            hf = next((run for run in at_size if run.method.name == HF_GENERATE), None)
            for run in at_size:
                row = summarise_batch(run, dataset, dtype, ar, hf)
                row |= {"reference": AR, "speedup_vs_reference": row["speedup_vs_ar"]}
                rows.append(row | {"temperature": self.config.temperature} | self._checked())
        return rows

    def run(
        self,
        samples: Mapping[str, Sequence[Sample]],
        previous: BenchResults | None = None,
        on_dataset: Callable[[BenchResults], None] | None = None,
        journal_dir: Path | None = None,
        resume: bool = False,
    ) -> BenchResults:
        """Every data set at every batch size; one row per data set x batch size x method.

        Data sets already in ``previous`` are kept; ``on_dataset`` sees the results after each
        data set. ``journal_dir`` and ``resume`` are taken for the per-prompt runner's signature:
        a batched data set resumes whole.
        """
        dtype = dtype_name(self.target.dtype)
        results, todo = self._start(samples, previous)
        if not todo:
            return results
        calls = sum(self.calls_per_dataset(group) for group in todo.values())
        with tqdm(total=calls, desc="batched calls", unit="call", disable=not self.progress) as bar:
            for name, group in todo.items():
                bar.set_postfix_str(name)
                runs = self.measure(group, on_call=bar.update)
                results.runs += self.batch_rows(name, runs, dtype)
                if on_dataset:
                    on_dataset(results)
        return results
