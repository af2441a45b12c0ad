"""The engine loop over a batch: draft a tree per sequence, verify them all in one target
forward, accept and commit per sequence, refill finished rows from the queue, repeat.

One loop for every batch size: a single prompt is a batch of one row. Each sequence keeps
its own drafter state (:meth:`Drafter.for_row`), tree policy, seeded generator and stop
conditions; the rows share the drafter's one batched forward (:meth:`Drafter.begin_rows`),
the target's one verify forward (:meth:`Target.verify_rows`) and the step's node budget,
which :mod:`jetflow.core.allocation` spends where it accepts.

Memory: the KV cache is one slab of ``rows x capacity`` positions per run. One row's slab is
allocated once at the most its prompt needs (its tokens, its answer and the largest tree); a
batch's is sized to the longest history in flight and follows it, growing and shrinking in whole
granules (:meth:`jetflow.core.kv_cache.SlabLayer.fit`), since its forward attends over all of it.
A finished row's positions are reused by the next prompt, so the run never holds more than
``rows`` sequences' histories.
"""

from __future__ import annotations

import copy
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from jetflow.core.allocation import Allocation, RowCalibration, allocate, row_budget_cap, row_depth_cap
from jetflow.core.contracts import (
    DraftContext,
    Drafter,
    DraftSession,
    TreePolicy,
    forwards_of,
    is_refinable,
)
from jetflow.core.kv_cache import SLAB_GRANULE
from jetflow.core.result import FinishReason, GenerationResult, StepRecord
from jetflow.core.tree import DraftTree
from torch import Tensor

if TYPE_CHECKING:
    from jetflow.core.engine import Engine


@dataclass
class _Sequence:
    """One prompt in flight: its tokens, what it emitted, its own per-sequence state."""

    index: int  # position in the caller's list
    ids: list[int]
    tokens: Tensor  # every committed token; the last is the next tree's root
    drafter: Drafter | None
    policy: TreePolicy
    generator: torch.Generator
    started: float
    prefill_s: float
    new: list[int] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    calibration: RowCalibration = field(default_factory=RowCalibration)


class BatchRun:
    """Decodes a list of encoded prompts through ``rows`` slots of one engine."""

    def __init__(
        self, engine: Engine, prompts: list[list[int]], limit: int, rows: int, capacity: int
    ) -> None:
        self.engine = engine
        self.target = engine.target
        self.limit = limit
        self.queue = deque(enumerate(prompts))
        self.results: list[GenerationResult | None] = [None] * len(prompts)
        self.slots: list[_Sequence | None] = [None] * rows
        self.drafter = engine.drafter if engine.drafting else None  # None: each step verifies the root
        self.layers = self.drafter.feature_layers if self.drafter is not None else ()
        # a batch's slab starts at one granule and follows its rows (see the module docstring)
        self.cache = self.target.new_cache(capacity if rows == 1 else SLAB_GRANULE, rows=rows)

    def run(self) -> list[GenerationResult]:
        while self.queue or any(self.slots):
            for slot, sequence in enumerate(self.slots):
                if sequence is None and self.queue:
                    self.slots[slot] = self._admit(slot, *self.queue.popleft())
            self._step()
        return [result for result in self.results if result is not None]

    def _admit(self, slot: int, index: int, ids: list[int]) -> _Sequence:
        """Prefill a prompt into ``slot``; its drafter row and policy start fresh."""
        engine, device = self.engine, self.target.device
        started = time.perf_counter()
        generator = torch.Generator(device).manual_seed(engine.config.seed)
        policy = copy.copy(engine.policy)
        policy.reset(generator)  # one seeded generator per sequence: sampled trees and acceptance
        drafter = self.drafter
        if drafter is not None:  # a run of one row decodes with the engine's drafter itself
            drafter = drafter.for_row() if len(self.slots) > 1 else drafter
            drafter.reset()
        tokens = torch.tensor(ids, dtype=torch.long, device=device)
        features = self.target.prefill_row(self.cache, slot, tokens[:-1], self.layers)
        if drafter is not None:
            drafter.prefill(features)
        prefill_s = time.perf_counter() - started
        return _Sequence(index, ids, tokens, drafter, policy, generator, started, prefill_s)

    def _step(self) -> None:
        """One draft-verify step of every sequence in flight."""
        engine = self.engine
        live = [(slot, sequence) for slot, sequence in enumerate(self.slots) if sequence is not None]
        share = engine.adaptive.next_budget(len(live)) if engine.adaptive else engine.largest_budget
        t0 = time.perf_counter()
        starts = self.target.lengths(self.cache)
        trees, forwards, nested, allocation = self._draft(live, starts, share)
        t1 = time.perf_counter()
        by_slot: list[DraftTree | None] = [None] * len(self.slots)
        for (slot, _), tree in zip(live, trees, strict=True):
            by_slot[slot] = tree
        outputs = self.target.verify_rows(self.cache, by_slot, self.layers)
        decisions = []
        for (slot, sequence), tree in zip(live, trees, strict=True):
            output = outputs[slot]
            assert output is not None  # every live row was verified
            decisions.append(engine.verifier.accept(tree, output.logits, sequence.generator))
        paths: list[Tensor | None] = [None] * len(self.slots)
        for (slot, _), decision in zip(live, decisions, strict=True):
            paths[slot] = decision.path
        self.target.commit_rows(self.cache, starts, paths)
        for (slot, sequence), decision in zip(live, decisions, strict=True):
            if sequence.drafter is not None:  # after a step at budget 0 too: the next context carries both
                output = outputs[slot]
                sequence.drafter.commit(output.features if output is not None else None, decision.path)
        t2 = time.perf_counter()

        total = sum(tree.size - 1 for tree in trees)
        ran = [share if len(live) == 1 else tree.size - 1 for tree in trees]  # a row of a batch: its nodes
        if engine.adaptive:
            accepted = [decision.path for decision in decisions]
            engine.adaptive.observe_rows(list(zip(trees, accepted, ran, strict=True)), nested, allocation)
        for (slot, sequence), tree, decision, nodes in zip(live, trees, decisions, ran, strict=True):
            sequence.calibration.observe(tree, decision.accepted)
            sequence.steps.append(
                StepRecord(decision.accepted, tree.size, t1 - t0, t2 - t1, forwards, nodes, len(live), total)
            )
            emitted = [*tree.tokens[decision.path[1:]].tolist(), decision.next_token]
            emitted, finish = self._truncate(sequence.new, emitted, self.limit)
            sequence.new.extend(emitted)
            sequence.tokens = torch.cat(
                [sequence.tokens, torch.tensor(emitted, dtype=torch.long, device=sequence.tokens.device)]
            )
            if finish is not None:
                self._finish(slot, sequence, finish)

    def _draft(
        self, live: list[tuple[int, _Sequence]], starts: list[int], share: int
    ) -> tuple[list[DraftTree], int, bool, Allocation | None]:
        """Every live row's tree, the drafter forwards of the step, whether all are nested, and how
        the step's nodes were spread across the rows (None: each row drafted its share)."""
        engine = self.engine
        if self.drafter is None or share <= 0:
            return [DraftTree.root(sequence.tokens[-1]) for _, sequence in live], 0, True, None
        rows = [sequence.drafter for _, sequence in live]
        # Only nested trees can be drafted larger and cut back to a share across the rows.
        spread = len(live) > 1 and engine.config.tree.split == "best-first" and engine.policy.nested
        cap = row_budget_cap(share, len(live)) if spread else share
        # a row drafted past its share widens its tree: one level deeper at most (`cap` is the
        # share itself when not spread)
        depth = min(row_depth_cap(share), cap, engine.shape.max_depth)
        contexts = [
            sequence.drafter.context(sequence.tokens, starts[slot], depth)
            for slot, sequence in live
            if sequence.drafter is not None
        ]
        sessions = self.drafter.begin_rows([row for row in rows if row is not None], contexts)
        # ... and not where a refined session rebuilds them
        reallocate = spread and not any(is_refinable(session) for session in sessions)
        budget = cap if reallocate else share
        policies = [sequence.policy for _, sequence in live]
        trees, forwards, nested = self._build_rows(policies, sessions, contexts, budget)
        if not reallocate:
            return trees, forwards, nested, None
        allocation = Allocation.of(share, [sequence.calibration.ratio for _, sequence in live])
        return allocate(trees, allocation), forwards, nested, allocation

    def _finish(self, slot: int, sequence: _Sequence, finish: FinishReason) -> None:
        self.results[sequence.index] = GenerationResult(
            prompt_ids=sequence.ids,
            token_ids=sequence.new,
            text=self.target.decode(sequence.new),
            finish_reason=finish,
            wall_s=time.perf_counter() - sequence.started,
            prefill_s=sequence.prefill_s,
            budget=self._budget_run(sequence.steps),
            steps=sequence.steps,
            attention=self.target.attention,
            linear_weights=self.target.linear_weights,
        )
        self.slots[slot] = None

    def _budget_run(self, steps: Sequence[StepRecord]) -> int | None:
        """The budget of a run: the fixed one, or the one an adaptive run used most."""
        if self.engine.adaptive is None or not steps:
            return self.engine.budget
        return Counter(step.budget for step in steps).most_common(1)[0][0]

    def _build_rows(
        self,
        policies: list[TreePolicy],
        sessions: list[DraftSession],
        contexts: list[DraftContext],
        budget: int,
    ) -> tuple[list[DraftTree], int, bool]:
        """Every row's tree from its session, the drafter forwards they cost, and whether all are
        nested (:attr:`TreePolicy.nested`: its ``b`` best nodes are the tree of budget ``b``).

        The policy grows all rows at once (:meth:`TreePolicy.build_rows`). Where a session offers
        ``refine`` (e.g. JetFlow's path-conditioned refresh) each row's built tree goes back to it
        and the policy builds again from the refined session; that tree is scored by the refined
        session and is not nested.
        """
        sessions = list(sessions)  # a refined row's session replaces its own here
        roots = [DraftTree.root(context.tokens[-1]) for context in contexts]
        shape = replace(self.engine.shape, budget=budget)
        trees = type(policies[0]).build_rows(policies, sessions, roots, shape)
        nested = policies[0].nested
        for row, session in enumerate(sessions):
            if is_refinable(session):
                sessions[row] = session.refine(trees[row])
                trees[row] = policies[row].build(sessions[row], roots[row], shape)
                nested = False
        forwards = max(map(forwards_of, sessions), default=0)
        return trees, forwards, nested

    def _truncate(
        self, done: list[int], emitted: list[int], limit: int
    ) -> tuple[list[int], FinishReason | None]:
        """Cut ``emitted`` exactly at the first stop condition it meets."""
        if self.engine.config.stop_at_eos:
            for index, token in enumerate(emitted):
                if token in self.target.eos_token_ids and len(done) + index < limit:
                    return emitted[: index + 1], "eos"
        if self.engine.config.stop:
            # Every token decodes to at least one character, so a stop string that ends in the
            # new tokens starts within the last len(stop) tokens: decode only that tail.
            tail = done[max(0, len(done) - max(map(len, self.engine.config.stop))) :]
            for index in range(len(emitted)):
                if len(done) + index >= limit:
                    break
                text = self.target.decode(tail + emitted[: index + 1])
                if any(stop in text for stop in self.engine.config.stop):
                    return emitted[: index + 1], "stop"
        if len(done) + len(emitted) >= limit:
            return emitted[: limit - len(done)], "length"
        return emitted, None
