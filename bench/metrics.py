"""From per-prompt generations to one row of results: tau, tokens/s, speedup, shares.

Every figure is a ratio of sums over the run's prompts (turns), not a mean of per-prompt
ratios, so long answers weigh as much as the time they took: tokens/s is total tokens over
total wall time, tau total tokens over total target forwards, and the speedup the ratio of
tokens/s against ``ar`` on the very same prompts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from jetflow.bench.generation import Generation, Method
from jetflow.bench.lossless import Divergence


@dataclass(frozen=True)
class TurnRecord:
    """One method's answer to one user turn, and how it compares with the reference."""

    sample_id: str
    turn: int
    prompt_ids: tuple[int, ...]
    generation: Generation
    divergence: Divergence | None = None


def tokens_per_s(records: Sequence[TurnRecord], leave_out_s: float = 0.0) -> float:
    """New tokens per second of ``records``' wall time, less ``leave_out_s`` seconds of it."""
    wall = sum(record.generation.wall_s for record in records) - leave_out_s
    tokens = sum(len(record.generation.token_ids) for record in records)
    return tokens / wall if wall > 0 else 0.0


def decode_tokens_per_s(records: Sequence[TurnRecord]) -> float | None:
    """Tokens per second of decoding alone (prefill left out), None if a method hides its prefill.

    Speculation cannot speed up the prefill, so the end-to-end speedup of short answers to long
    prompts stays below this one, which it approaches as answers grow.
    """
    prefills = [record.generation.prefill_s for record in records]
    known = [prefill for prefill in prefills if prefill is not None]
    if len(known) < len(prefills):
        return None
    return tokens_per_s(records, leave_out_s=sum(known))


def step_histogram(per_step: Sequence[tuple[int, ...] | None]) -> dict[str, int] | None:
    """Steps per value (JSON keys, ascending) over generations; None if any hides its steps."""
    counts: Counter[int] = Counter()
    for values in per_step:
        if values is None:
            return None
        counts.update(values)
    return {str(value): counts[value] for value in sorted(counts)}


def accept_histogram(records: Sequence[TurnRecord]) -> dict[str, int] | None:
    """Steps per number of accepted drafted tokens, None if a method hides it."""
    return step_histogram([record.generation.accepted for record in records])


def budget_histogram(records: Sequence[TurnRecord]) -> dict[str, int] | None:
    """Steps per tree budget (several under an adaptive budget), None for methods without a tree."""
    return step_histogram([record.generation.budgets for record in records])


def summarise(
    method: Method,
    dataset: str,
    dtype: str,
    records: Sequence[TurnRecord],
    ar_tokens_per_s: float,
    ar_decode_tokens_per_s: float | None = None,
) -> dict[str, object]:
    """One ``runs`` entry of results.json (the issue's keys first, then the detail).

    ``decode_speedup_vs_ar`` compares decoding alone, where both sides time their prefill.
    """
    generations = [record.generation for record in records]
    wall = sum(g.wall_s for g in generations)
    tokens = sum(len(g.token_ids) for g in generations)
    steps = sum(g.steps for g in generations)
    divergences = [r.divergence for r in records if r.divergence is not None]
    speed = tokens_per_s(records)
    decode = decode_tokens_per_s(records)
    budgets = budget_histogram(records)
    return {
        "method": method.name,
        "dataset": dataset,
        # an adaptive budget's run is named by the budget it used most
        "budget": int(max(budgets, key=lambda budget: budgets[budget])) if budgets else method.budget,
        "n_prompts": len({record.sample_id for record in records}),
        "new_tokens": tokens,
        "tau": tokens / steps if steps else 0.0,
        "tokens_per_s": speed,
        "speedup_vs_ar": speed / ar_tokens_per_s if ar_tokens_per_s > 0 else 0.0,
        "draft_share": sum(g.draft_s for g in generations) / wall if wall > 0 else 0.0,
        "lossless": all(d.kind != "bug" for d in divergences),
        "dtype": dtype,
        "policy": method.policy,
        "n_turns": len(records),
        "steps": steps,
        "wall_s": wall,
        "verify_share": sum(g.verify_s for g in generations) / wall if wall > 0 else 0.0,
        "prefill_share": None if decode is None else sum(g.prefill_s or 0.0 for g in generations) / wall,
        "decode_tokens_per_s": decode,
        "decode_speedup_vs_ar": decode / ar_decode_tokens_per_s
        if decode is not None and ar_decode_tokens_per_s
        else None,
        "accept_histogram": accept_histogram(records),
        "budget_histogram": budgets,
        "rounding_ties": sum(d.kind == "tie" for d in divergences),
        "divergences": [d.as_dict() for d in divergences],
    }
