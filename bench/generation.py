"""The contract every compared method meets, as Spec-Bench has one ``forward_func``.

A method turns prompt token ids into a :class:`Generation`; the runner never needs to know
whether it is the jetflow engine (with or without a drafter) or ``transformers.generate``.
A :class:`BatchMethod` also decodes a list of prompts several at a time into a
:class:`BatchGeneration` (the batch axis of ``jetflow bench --batch-sizes``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from jetflow.bench.config import AR


@dataclass(frozen=True)
class Generation:
    """What one method produced for one prompt, and what it cost.

    Attributes:
        token_ids: the new tokens (an end-of-sequence token included, as it was emitted).
        wall_s: seconds from the call to the last token, prefill included.
        prefill_s: the part of ``wall_s`` spent prefilling the prompt, or None where the
            method does not separate it (``transformers.generate``, vLLM).
        steps: target forwards that emitted tokens (tau = tokens / steps).
        draft_s: seconds spent drafting.
        verify_s: seconds spent in target forwards (plus acceptance and cache commit).
        accepted: drafted tokens accepted at each step, or None where the method hides it.
        budgets: each step's tree budget (they differ under an adaptive budget), or None for
            methods without a tree.
    """

    token_ids: tuple[int, ...]
    wall_s: float
    steps: int
    draft_s: float
    verify_s: float
    accepted: tuple[int, ...] | None
    budgets: tuple[int, ...] | None = None
    prefill_s: float | None = None


class Method(Protocol):
    """A named way of decoding greedily with the shared target.

    A class that subclasses it explicitly takes the defaults of ``reference`` and ``left_out``.
    """

    #: the run's ``method`` in results: ``ar``, ``hf-generate``, ``ngram``, ``ngram:chain``, ...
    name: str
    #: tree budget, None for methods without one
    budget: int | None
    #: the tree policy actually run, None for methods without a tree
    policy: str | None
    #: the method whose output and speed this one is measured against (vLLM's: plain vLLM)
    reference: str = AR
    #: peers that were to run beside this method but could not, with the reason (in the
    #: results' settings): vLLM's drafters whose heads do not export
    left_out: Mapping[str, str] = MappingProxyType({})

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Generation: ...


@dataclass(frozen=True)
class BatchGeneration:
    """What one method produced for a list of prompts decoded ``batch_size`` at a time.

    Attributes:
        rows: one :class:`Generation` per prompt, in input order; its ``wall_s`` is that
            sequence's latency (from its admission to its last token), its ``steps`` the
            forwards it took part in.
        wall_s: seconds of the whole call (throughput is every row's tokens over this).
        forwards: target forwards of the call, each one over every sequence then in flight.
        row_steps: sequences verified, summed over the forwards (``row_steps / forwards``:
            the mean rows per forward, below the batch size where the queue ran dry).
        draft_s: seconds of the call spent drafting (each forward's once, not once per row).
        verify_s: seconds of the call spent in target forwards, acceptance and commit.
        batch_budgets: forwards per total drafted nodes across their rows (JSON keys,
            ascending); None for methods without a tree.
    """

    rows: tuple[Generation, ...]
    wall_s: float
    forwards: int
    row_steps: int
    draft_s: float
    verify_s: float
    batch_budgets: dict[str, int] | None = None


class BatchMethod(Method, Protocol):
    """A method that can also decode many prompts at once."""

    def generate_batch(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int
    ) -> BatchGeneration: ...


def batchable(method: Method) -> bool:
    """Whether ``method`` decodes batches (``transformers``' prompt lookup, for one, does not)."""
    return bool(getattr(method, "batchable", False)) and hasattr(method, "generate_batch")
