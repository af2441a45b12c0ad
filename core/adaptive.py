"""The adaptive budget: calibrated step costs, acceptance learned from the running generations.

A calibration measures what a step costs at each budget on this machine and how many tokens it
accepts on the calibration's own prompts. The cost is a property of the machine; acceptance is
a property of the text, and the two can part far enough (the calibration's prompts against a
benchmark's) that one static choice loses to the best fixed budget on some data set. Here the
costs stay calibrated and tau is re-estimated online:

* **Nested observations.** For a policy whose budget-``b`` tree is the ``b`` best-scored nodes
  of any larger tree (:attr:`TreePolicy.nested`: best-first, chain), one verified step at
  budget ``B`` tells how many tokens every budget ``b <= B`` would have accepted: the accepted
  path up to its first node ranked below ``b``. Exact under greedy verification (the target's
  choice at a node does not depend on its siblings); an estimate under sampling. Other
  policies are observed at the budget they ran.
* **Estimates** are discounted means (old steps fade, so a new workload takes over) shrunk
  toward the calibrated tau, which counts as ``prior_weight`` steps.
* **Monotone in the budget.** A nested tree of budget ``b`` is part of every larger one, so a
  step accepts at least as much at any larger budget: what a step at ``B`` saw is a lower bound
  for every budget above ``B``. While every step observed was nested, the estimates are the
  weighted non-decreasing fit of the means (weights: their observation counts). Without it a
  text that accepts far more than the calibration's prompts leaves the budgets above the choice
  at their calibrated tau, lower than the choice's own, and no probe ever finds them.
* **Exploration.** Every ``probe_every``-th step may run a larger budget than the choice:
  the one with the best optimistic speed (tau plus one standard deviation of a step's emitted
  tokens over the square root of its observation count), if that beats the choice's estimate by
  more than the choice's tolerance (less could not move the choice; on a large batch, where
  every budget is within a few percent of plain decoding and a probe step costs about two plain
  ones, probes are most of what a choice of 0 pays for the drafter). The spread is measured
  online (a budget seen too little borrows the widest spread of the smaller ones, never less
  than ``optimism``): accepted lengths spread with tau, so a fixed bonus that suits tau 1.5 is
  too timid to ever try a larger budget at tau 3.5. So a budget the calibration under-rated is
  found, even past a neighbour that is no better; once a budget has been seen often enough to be
  ruled out it is no longer probed. With a nested policy a probe also refreshes every smaller
  budget. At budget 0 the steps observe nothing and each probe costs a tree's verify, so there a
  probe that leaves the choice at 0 doubles the interval to the next (up to
  ``max_probe_every``) and a change of choice resets it: on a machine where no tree pays,
  probing thins out and the run costs what plain decoding costs. At a drafting choice every step
  is observed and probes keep their pace.
* **Choice**: the calibration's own rule (:func:`choose_budget`): the smallest budget whose
  expected tokens per second is within the tolerance of the best.

The controller never reads the clock: the budget sequence depends only on the tokens, so a
seeded sampled generation on a fresh engine is reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from jetflow.core.allocation import Allocation, best_first_ranks
from jetflow.core.calibration_record import Calibration
from jetflow.core.cost_model import CHOICE_TOLERANCE, batch_step_cost, choose_budget, extrapolate_latency
from jetflow.core.tree import DraftTree
from scipy.optimize import isotonic_regression

#: the calibrated tau counts as this many observed steps
PRIOR_WEIGHT = 2.0
#: per-step forgetting factor of the observed means (an effective memory of ~100 steps, of all rows)
FORGETTING = 0.99
#: every this many steps, a larger budget may be probed ...
PROBE_EVERY = 4
#: ... and at most this many apart after probes that changed nothing
MAX_PROBE_EVERY = 128
#: the least optimism of a probe in tokens per step (divided by sqrt(observations)): the spread of
#: a step's emitted tokens where it is measured wider (0.5-0.9 at tau 1.3-1.8, ~1.5 at tau 3.5),
#: so a budget is no longer probed once a dozen observations place it clearly below the choice
OPTIMISM = 0.5


class AdaptiveBudget:
    """Chooses each step's budget from calibrated costs and acceptance seen so far."""

    def __init__(
        self,
        budgets: Sequence[int],
        cost_s: Sequence[float],
        prior_tau: Sequence[float],
        *,
        prior_weight: float = PRIOR_WEIGHT,
        forgetting: float = FORGETTING,
        probe_every: int = PROBE_EVERY,
        max_probe_every: int = MAX_PROBE_EVERY,
        optimism: float = OPTIMISM,
        tolerance: float = CHOICE_TOLERANCE,
        batch_cost: Callable[[int], np.ndarray] | None = None,
    ) -> None:
        order = np.argsort(np.asarray(budgets), kind="stable")
        self.budgets = np.asarray(budgets, dtype=np.int64)[order]
        self.cost_s = np.asarray(cost_s, dtype=float)[order]
        self._single_cost_s = self.cost_s
        #: a step's cost per candidate budget (in ``budgets`` order) at a number of rows > 1
        self._batch_cost = (lambda rows: batch_cost(rows)[order]) if batch_cost is not None else None
        self.rows = 1
        self.prior_tau = np.asarray(prior_tau, dtype=float)[order]
        if len(self.budgets) == 0 or np.any(self.cost_s <= 0) or len(set(self.budgets.tolist())) < len(order):
            raise ValueError("an adaptive budget needs distinct budgets with positive costs")
        self.prior_weight = prior_weight
        self.forgetting = forgetting
        self.probe_every = probe_every
        self.max_probe_every = max(max_probe_every, probe_every)
        self._interval = probe_every  # steps from one probe to the next, doubled by idle probes
        self._since_probe = 0
        self._probed = False  # the last step asked for was a probe
        self.optimism = optimism
        self.tolerance = tolerance
        self._emitted = np.zeros(len(self.budgets))  # discounted sums of tokens per step
        self._emitted_sq = np.zeros(len(self.budgets))  # ... and of their squares
        self._steps = np.zeros(len(self.budgets))  # discounted step counts
        self._nested_so_far = True  # every observed step's tree was nested (none observed yet)
        self.choice = self._choose()

    @classmethod
    def from_calibration(cls, calibration: Calibration, **options: Any) -> AdaptiveBudget:
        """Candidates are the calibration's measured budgets (budget 0, no drafting, among them)."""
        points = calibration.points
        single = np.array([(p.draft_ms + p.verify_ms) / 1e3 for p in points])
        measured = [
            batch for batch in calibration.batches if {p.budget for p in points} <= set(batch.budgets)
        ]

        counts = [1, *(batch.rows for batch in measured)]
        # a step of more rows verifies more tokens: where the measured costs (load drifting under
        # them) say otherwise, each budget's costs are fitted non-decreasing in the rows
        by_rows = np.array(
            [single]
            + [[batch.step_ms[batch.budgets.index(p.budget)] / 1e3 for p in points] for batch in measured]
        )
        by_rows = np.stack([isotonic_regression(column, increasing=True).x for column in by_rows.T], axis=1)

        def batch_cost(rows: int) -> np.ndarray:
            """Measured step costs interpolated over the rows (linear past the most measured);
            without any measured, the model of :func:`batch_step_cost`."""
            if not measured:
                return batch_step_cost(
                    calibration.tree_sizes,
                    [ms / 1e3 for ms in calibration.verify_latency_ms],
                    [p.mean_tree_size for p in points],
                    [p.draft_ms / 1e3 for p in points],
                    rows,
                )
            return np.array([extrapolate_latency(counts, column, [rows])[0] for column in by_rows.T])

        return cls(
            [p.budget for p in points],
            [(p.draft_ms + p.verify_ms) / 1e3 for p in points],
            [p.tau for p in points],
            batch_cost=batch_cost,
            **options,
        )

    @property
    def largest(self) -> int:
        return int(self.budgets[-1])

    def tau(self) -> np.ndarray:
        """Estimated tokens per step at each candidate budget (non-decreasing while nested)."""
        weights = self.prior_weight + self._steps
        means = (self.prior_weight * self.prior_tau + self._emitted) / weights
        if not self._nested_so_far:
            return means
        return isotonic_regression(means, weights=weights, increasing=True).x

    def spread(self) -> np.ndarray:
        """Standard deviation of a step's emitted tokens per budget, for the probes' optimism.

        Measured where a budget has two or more (discounted) observations; a budget seen less
        takes the widest spread measured at a smaller one; never below ``optimism``.
        """
        seen = self._steps >= 2.0
        steps = np.where(seen, self._steps, 1.0)
        variance = self._emitted_sq / steps - (self._emitted / steps) ** 2
        measured = np.where(seen, np.sqrt(np.clip(variance, 0.0, None)), 0.0)
        return np.maximum(np.maximum.accumulate(measured), self.optimism)

    def speeds(self) -> np.ndarray:
        """Expected tokens per second at each candidate budget."""
        return self.tau() / self.cost_s

    def expected_tokens_per_s(self) -> dict[int, float]:
        return dict(zip(self.budgets.tolist(), self.speeds().tolist(), strict=True))

    def next_budget(self, rows: int = 1) -> int:
        """The budget per sequence of the next step of ``rows`` sequences: the choice, or on a
        probe step a promising larger one. More rows make a step's verify cost more (the forward
        holds every row's tree), so the choice shrinks toward 0 as the batch grows."""
        if rows != self.rows:
            self._use_rows(rows)
        self._since_probe += 1
        self._probed = False
        if self._since_probe < self._interval:
            return self.choice
        self._since_probe = 0
        tau = self.tau()  # one isotonic fit serves the choice's speed and the optimistic ones
        chosen = int(np.searchsorted(self.budgets, self.choice))
        current = tau[chosen] / self.cost_s[chosen]
        bonus = self.spread() / np.sqrt(self.prior_weight + self._steps)
        optimistic = (tau + bonus) / self.cost_s
        optimistic[self.budgets <= self.choice] = -np.inf
        probe = int(np.argmax(optimistic))
        # the choice is the smallest budget within the tolerance of the best: a budget above it
        # takes over only if it is faster by more than that, so a probe that could not do so
        # even at its optimistic speed is a larger step that teaches nothing the choice uses
        if optimistic[probe] * (1.0 - self.tolerance) <= current:
            return self.choice
        self._probed = True
        return int(self.budgets[probe])

    def observe(self, tree: DraftTree, path: torch.Tensor, budget: int, nested: bool) -> None:
        """Learn from one verified step that ran at ``budget`` and accepted ``path`` (root first)."""
        self.observe_rows([(tree, path, budget)], nested)

    def observe_rows(
        self,
        rows: Sequence[tuple[DraftTree, torch.Tensor, int]],
        nested: bool,
        allocation: Allocation | None = None,
    ) -> None:
        """Learn from one batched step: each row's tree, accepted path and the budget it ran at;
        the choice is made again once, for the next step.

        Old observations fade once per step, not once per row: the memory is ~100 steps at any
        batch size, each step adding a row's worth per sequence. Fading per row would leave a
        batch of 16 a memory of six steps, whose noise flips the choice between budgets that
        are within the tolerance of each other (and every flip restarts the probes).

        ``allocation``: the step spread ``allocation.share`` nodes a row across its rows
        best-first (:func:`~jetflow.core.allocation.allocate`), so a row's own budget says how
        confident its drafts were this step, and counting its tree as a step at that budget would
        over-rate every budget above the share. A smaller share would have kept a prefix of the
        same ranking, so what every row accepts at each share up to the one run is known
        exactly, and that is what is counted.
        """
        self._emitted *= self.forgetting
        self._emitted_sq *= self.forgetting
        self._steps *= self.forgetting
        if allocation is not None and nested:
            self._record_allocated(rows, allocation)
        else:
            for tree, path, budget in rows:
                self._record(tree, path, budget, nested)
        choice, self.choice = self.choice, self._choose()
        if self.choice != choice:
            self._interval = self.probe_every
        elif self._probed and self.choice == 0:  # see the module docstring: only at budget 0
            self._interval = min(2 * self._interval, self.max_probe_every)

    def _record(self, tree: DraftTree, path: torch.Tensor, budget: int, nested: bool) -> None:
        """Add one row's step to the discounted counts."""
        self._nested_so_far &= nested
        emitted: np.ndarray | float  # per candidate budget seen, or one count for the budget run
        if nested:
            seen = self.budgets <= budget
            # a root-only tree (budget 0, or nothing proposed) emits its one token at every budget
            emitted = 1 + accepted_within(tree, path, self.budgets[seen]) if tree.size > 1 else 1.0
        else:
            seen = self.budgets == budget
            emitted = float(len(path))  # the root plus the accepted drafted tokens
        self._add(seen, emitted)

    def _record_allocated(
        self, rows: Sequence[tuple[DraftTree, torch.Tensor, int]], allocation: Allocation
    ) -> None:
        """Every row's tokens at each candidate share up to the step's, from the batch's ranking."""
        seen = self.budgets <= allocation.share
        totals = self.budgets[seen] * len(rows)  # the nodes a step of that share keeps
        ranks = allocation.ranks([tree for tree, _, _ in rows])  # the kept nodes: the ranking's prefix
        for (_, path, _), row_ranks in zip(rows, ranks, strict=True):
            self._add(seen, 1 + accepted_in_ranks(row_ranks, path, totals))

    def _add(self, seen: np.ndarray, emitted: np.ndarray | float) -> None:
        """One observation of ``emitted`` tokens at each candidate budget in ``seen``."""
        self._emitted[seen] += emitted
        self._emitted_sq[seen] += np.square(emitted)
        self._steps[seen] += 1.0

    def _use_rows(self, rows: int) -> None:
        """Price the candidates for steps of ``rows`` sequences (tau per sequence is unchanged)."""
        self.rows = rows
        if rows == 1 or self._batch_cost is None:
            self.cost_s = self._single_cost_s
        else:
            self.cost_s = np.maximum(self._batch_cost(rows), 1e-9)
        choice, self.choice = self.choice, self._choose()
        if self.choice != choice:
            self._interval = self.probe_every

    def _choose(self) -> int:
        return choose_budget(self.budgets.tolist(), self.speeds().tolist(), self.tolerance)


def accepted_within(tree: DraftTree, path: torch.Tensor, budgets: np.ndarray) -> np.ndarray:
    """Drafted tokens the accepted ``path`` keeps inside the ``b`` best-scored nodes, per ``b``.

    Ranks follow the policies' own order (a stable sort of the drafted nodes by descending
    score, so a parent ranks before an equally scored child): the budget-``b`` tree of a
    nested policy is exactly the nodes of rank ``<= b``.
    """
    return accepted_in_ranks(best_first_ranks([tree.scores[1:]])[0], path, budgets)


def accepted_in_ranks(ranks: torch.Tensor, path: torch.Tensor, limits: np.ndarray) -> np.ndarray:
    """Drafted tokens of the accepted ``path`` before its first node ranked past each limit:
    ``ranks [drafted]`` of the tree's drafted nodes (node ``i`` at ``i - 1``) -> ``[limits]``."""
    path_ranks = ranks[path[1:] - 1].cpu().numpy()  # one host read per row and step
    inside = path_ranks[None, :] <= limits[:, None]  # [limits, accepted]
    return np.cumprod(inside, axis=1).sum(axis=1).astype(float)
