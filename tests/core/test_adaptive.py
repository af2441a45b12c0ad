"""The adaptive budget: nested observations, the online estimate, probing, and the engine using it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from jetflow.core import calibration as cal
from jetflow.core.adaptive import AdaptiveBudget, accepted_within
from jetflow.core.allocation import Allocation
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.contracts import TreeShape
from jetflow.core.engine import Engine
from jetflow.core.registry import default_registry
from jetflow.core.target import Target
from jetflow.core.tree import DraftTree

PROMPT = [7, 8, 9, 10, 11] * 3 + [7]


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path))


def _chain(scores: list[float]) -> DraftTree:
    """Root plus a chain of ``len(scores)`` drafted nodes with these cumulative scores."""
    n = len(scores)
    return DraftTree(
        tokens=torch.arange(n + 1),
        parents=torch.arange(-1, n),
        scores=torch.tensor([0.0, *scores]),
    )


def test_accepted_within_counts_the_path_up_to_its_first_node_outside_the_budget() -> None:
    # root -> 1 (-0.1) -> 3 (-0.5) -> 4 (-0.9); 2 (-0.2) is a sibling of 1: ranks 1, 3, 4 on the path
    tree = DraftTree(
        tokens=torch.tensor([0, 11, 12, 13, 14]),
        parents=torch.tensor([-1, 0, 0, 1, 3]),
        scores=torch.tensor([0.0, -0.1, -0.2, -0.5, -0.9]),
    )
    path = torch.tensor([0, 1, 3, 4])
    got = accepted_within(tree, path, np.array([0, 1, 2, 3, 4, 8]))
    assert got.tolist() == [0, 1, 1, 2, 3, 3]


class PathSeededSession:
    """Children that depend only on the path to a node, as a real drafter's do."""

    max_depth = None

    def children(self, tree: DraftTree, nodes: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, logprobs = [], []
        for node in nodes.tolist():
            seed = hash(tuple(tree.tokens[tree.path(node)].tolist())) % 2**31
            generator = torch.Generator().manual_seed(seed)
            tokens.append(torch.randperm(64, generator=generator)[:k])
            logprobs.append(-torch.rand(k, generator=generator).sort().values * 3)
        return torch.stack(tokens), torch.stack(logprobs)


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(t for t in row if t >= 0) for row in tree.path_tokens.tolist()}


@pytest.mark.parametrize("policy_name", ["best-first", "chain"])
def test_a_nested_policy_builds_every_smaller_budget_tree_as_the_best_nodes_of_a_larger(
    policy_name: str,
) -> None:
    """What ``nested`` promises, on the real policies: top-b of the budget-B tree == budget-b tree."""
    policy_cls = default_registry().get("tree_policy", policy_name)
    policy = policy_cls(policy_cls.Params())
    assert policy.nested
    for root in range(5):
        large = policy.build(PathSeededSession(), DraftTree.root(root), TreeShape(24, 3, 6))
        order = torch.sort(large.scores[1:], descending=True, stable=True).indices + 1
        for budget in (1, 2, 5, 11):
            keep = torch.zeros(large.size, dtype=torch.bool)
            keep[order[:budget]] = True
            small = policy.build(PathSeededSession(), DraftTree.root(root), TreeShape(budget, 3, 6))
            assert _paths(large.select(keep)) == _paths(small)


def _controller(**options) -> AdaptiveBudget:
    """Budgets 0-4 where the calibration's tau makes no drafting best (a loaded CPU's shape)."""
    return AdaptiveBudget(
        budgets=[0, 1, 2, 4],
        cost_s=[0.078, 0.100, 0.102, 0.141],
        prior_tau=[1.0, 1.20, 1.28, 1.36],
        **options,
    )


def test_it_starts_at_the_calibrated_choice_and_probes_larger_budgets_while_they_may_pay() -> None:
    controller = _controller(probe_every=4)
    assert controller.choice == 0
    used = [controller.next_budget() for _ in range(8)]
    assert used[:3] == used[4:7] == [0, 0, 0] and used[3] > 0 and used[7] > 0
    # once a budget has been seen often enough to be ruled out, probes stop
    for _ in range(400):
        budget = controller.next_budget()
        controller.observe(_chain([-0.1] * budget), torch.tensor([0]), budget, nested=True)
    assert controller.choice == 0
    assert [controller.next_budget() for _ in range(8)] == [0] * 8


def test_probes_that_change_nothing_come_ever_further_apart() -> None:
    """A probe costs a larger step: where no tree pays, probing thins out (gaps 4, 8, 16, ...)."""
    controller = _controller(probe_every=4, optimism=3.0)  # optimistic enough to keep probing
    probes = []
    for step in range(130):
        budget = controller.next_budget()
        if budget:
            probes.append(step)
        controller.observe(_chain([-0.1] * budget), torch.tensor([0]), budget, nested=True)
    gaps = np.diff([-1, *probes]).tolist()
    assert controller.choice == 0 and len(gaps) >= 4
    assert gaps[:4] == [4, 8, 16, 32]


def test_a_probe_runs_only_where_it_could_move_the_choice() -> None:
    """Budget 2 is expected 3% faster than 0, inside the choice's 5% tolerance, so 0 is chosen.
    A probe of 2 could move the choice only if 2 might be faster by more than the tolerance:
    with a wide optimism it might, and is probed; with a narrow one it could not, and is not
    (on a large batch such a probe is a step of twice the cost that teaches nothing)."""
    used = {}
    for optimism in (0.5, 0.02):
        controller = AdaptiveBudget(
            budgets=[0, 2], cost_s=[0.1, 0.1], prior_tau=[1.0, 1.03], probe_every=4, optimism=optimism
        )
        assert controller.choice == 0
        used[optimism] = [controller.next_budget() for _ in range(8)]
    assert used[0.5] == [0, 0, 0, 2, 0, 0, 0, 2]
    assert used[0.02] == [0] * 8


def _run_chains(controller: AdaptiveBudget, steps: int, acceptance: float) -> list[int]:
    """Drive ``controller`` over chain trees whose every drafted depth is accepted with
    probability ``acceptance`` (seeded); the budgets it ran, step by step."""
    rng = np.random.default_rng(0)
    used = []
    for _ in range(steps):
        budget = controller.next_budget()
        used.append(budget)
        accepted = min(budget, int(rng.geometric(1 - acceptance)) - 1)
        tree = _chain([-0.1 * (i + 1) for i in range(budget)])
        controller.observe(tree, torch.arange(accepted + 1), budget, nested=True)
    return used


def test_acceptance_above_the_calibration_moves_the_choice_up_past_a_no_better_neighbour() -> None:
    """Each drafted depth accepted with probability 1/2: tau 1.5, 1.75, 1.94 at budgets 1, 2, 4
    against the calibration's 1.20, 1.28, 1.36, so budget 2 (17.2 tokens/s) beats 0 (12.8)."""
    controller = _controller()
    used = _run_chains(controller, steps=200, acceptance=0.5)
    assert used[0] == 0 and controller.choice == 2
    assert used[-100:].count(2) > 80
    assert controller.tau()[1:3] == pytest.approx([1.5, 1.75], abs=0.2)


def test_acceptance_below_the_calibration_moves_the_choice_down() -> None:
    controller = AdaptiveBudget(budgets=[0, 2, 8], cost_s=[0.08, 0.09, 0.12], prior_tau=[1.0, 1.6, 2.6])
    assert controller.choice == 8
    for _ in range(60):
        budget = controller.next_budget()
        controller.observe(_chain([-0.1] * budget), torch.tensor([0]), budget, nested=True)  # none kept
    assert controller.choice == 0


def test_text_that_saturates_the_chosen_budget_raises_the_larger_ones_until_a_probe_finds_them() -> None:
    """The calibration's prompts made budget 8 no better than 4; this text accepts each drafted
    depth with probability 0.8 (tau 3.36 at 4, 4.33 at 8), so budget 8 is the faster one. Steps
    at budget 4 never observe budget 8, yet they bound it from below: the estimate rises with
    budget 4's until probing it pays, and the probes move the choice."""
    controller = AdaptiveBudget(budgets=[0, 4, 8], cost_s=[0.08, 0.10, 0.11], prior_tau=[1.0, 1.6, 1.6])
    assert controller.choice == 4
    used = _run_chains(controller, steps=300, acceptance=0.8)
    assert controller.choice == 8 and used[-100:].count(8) > 80
    assert controller.tau()[2] > controller.tau()[1] + 0.5  # measured, no longer pooled with 4's


def test_estimates_of_a_nested_policy_never_fall_as_the_budget_grows() -> None:
    controller = AdaptiveBudget(
        budgets=[0, 2, 4, 8], cost_s=[0.08, 0.09, 0.1, 0.12], prior_tau=[1.0, 1.9, 1.5, 1.7]
    )
    assert np.all(np.diff(controller.tau()) >= 0)
    for _ in range(20):  # budget 2 accepts both drafted tokens every time
        controller.observe(_chain([-0.1, -0.2]), torch.arange(3), 2, nested=True)
    tau = controller.tau()
    assert np.all(np.diff(tau) >= 0) and tau[1] > 2.5 and tau[2] == tau[3] == tau[1]
    controller.observe(_chain([-0.1, -0.2]), torch.arange(3), 2, nested=False)  # a refined tree
    assert controller.tau()[3] < controller.tau()[1]  # its bound no longer holds: plain means


def test_a_policy_that_is_not_nested_teaches_only_the_budget_it_ran() -> None:
    controller = _controller()
    before = controller.tau()
    controller.observe(_chain([-0.1, -0.2, -0.3, -0.4]), torch.arange(5), 4, nested=False)
    after = controller.tau()
    assert np.array_equal(before[:3], after[:3]) and after[3] > before[3]


def test_a_batched_step_counts_every_row_fades_once_and_chooses_once() -> None:
    """`observe_rows` counts each row of a step as `observe` counts a step of its own, fades what
    came before once per step (the memory is in steps at any batch size), and chooses once."""
    rows = [(_chain([-0.1, -0.2]), torch.arange(3), 2), (_chain([-0.1]), torch.arange(1), 1)] * 3
    one_by_one, batched = _controller(forgetting=1.0), _controller(forgetting=1.0)
    for tree, path, budget in rows:
        one_by_one.observe(tree, path, budget, nested=True)
    batched.observe_rows(rows, nested=True)
    assert np.allclose(one_by_one.tau(), batched.tau()) and one_by_one.choice == batched.choice

    fading = _controller(forgetting=0.5)
    fading.observe_rows(rows, nested=True)
    fading.observe_rows(rows[:1], nested=True)  # a step of one row: the six before count half
    assert np.allclose(fading._steps, [1 + 6 / 2, 1 + 6 / 2, 1 + 3 / 2, 0])
    calls = []
    fading._choose = lambda: calls.append(1) or 0  # type: ignore[method-assign]
    fading.observe_rows(rows, nested=True)
    assert len(calls) == 1


def test_an_allocated_step_is_learned_at_the_shares_it_can_answer_for() -> None:
    """Rows sharing one budget best-first: a row's larger tree (it got the nodes because its drafts
    were confident) is no step at that budget; every row counts at each share up to the step's,
    read off the batch's ranking, and no larger budget learns anything."""
    confident = _chain([-0.1, -0.2])  # both nodes accepted: the batch's ranks 1 and 2
    doubtful = DraftTree.root(torch.tensor(7))  # kept none of its nodes
    rows = [(confident, torch.arange(3), 2), (doubtful, torch.arange(1), 0)]
    controller = _controller(forgetting=1.0)
    controller.observe_rows(rows, nested=True, allocation=Allocation(1, [0.0, 0.0]))
    assert controller._steps.tolist() == [2, 2, 0, 0]  # shares 0 and 1 of budgets 0, 1, 2, 4
    assert controller._emitted.tolist() == [2, 1 + 3, 0, 0]  # share 1 keeps 2 nodes: both of the chain
    unallocated = _controller(forgetting=1.0)
    unallocated.observe_rows(rows, nested=True)
    assert unallocated._steps.tolist() == [2, 1, 1, 0]  # the confident row alone speaks for 1 and 2


def test_invalid_candidates_are_refused() -> None:
    with pytest.raises(ValueError):
        AdaptiveBudget(budgets=[0, 0], cost_s=[0.1, 0.1], prior_tau=[1, 1])
    with pytest.raises(ValueError):
        AdaptiveBudget(budgets=[0, 1], cost_s=[0.1, 0.0], prior_tau=[1, 1])


# ---------------------------------------------------------------------- the engine
def _ngram_config(**tree) -> GenerateConfig:
    return build_config(GenerateConfig, {"drafter": "ngram", "chat_template": False, "tree": tree})


def calibration_record(
    key: cal.CalibrationKey, taus: dict[int, float], cost_ms: dict[int, float]
) -> cal.Calibration:
    """A consistent hand-written calibration: these tau and step costs per budget."""
    points = [
        cal.BudgetPoint(
            budget=b,
            tau=taus[b],
            draft_ms=0.0,
            verify_ms=cost_ms[b],
            mean_tree_size=b + 1,
            expected_tokens_per_s=round(taus[b] / cost_ms[b] * 1e3, 3),
        )
        for b in sorted(taus)
    ]
    best = cal.choose_budget([p.budget for p in points], [p.expected_tokens_per_s for p in points])
    return cal.Calibration(
        key=key,
        created="2026-01-01T00:00:00+00:00",
        tree_sizes=sorted({1, *(b + 1 for b in taus)}),
        verify_latency_ms=[cost_ms[b] for b in sorted(taus)],
        points=points,
        budget=best,
        baseline_tokens_per_s=1e3 / cost_ms[0],
        n_prompts=1,
        max_new_tokens=8,
        repeats=1,
    )


def test_the_engine_adapts_a_calibrated_budget_and_stays_lossless(tiny_llama: Target) -> None:
    """Calibrated at 0 with a pessimistic tau; a repetitive prompt makes ngram trees pay."""
    key = cal.key_for(_ngram_config(), tiny_llama)
    cal.save_calibration(calibration_record(key, {0: 1.0, 2: 1.05, 6: 1.1}, {0: 10.0, 2: 11.0, 6: 12.0}))
    engine = Engine.from_cache(_ngram_config(budget="auto"), tiny_llama)
    assert (engine.budget, engine.budget_source) == (0, "adaptive")
    plain = Engine(build_config(GenerateConfig, {"drafter": "none", "chat_template": False}), tiny_llama)
    results = [engine.generate(PROMPT, max_new_tokens=40) for _ in range(3)]  # it learns across them
    expected = plain.generate(PROMPT, max_new_tokens=40).token_ids
    assert all(result.token_ids == expected for result in results)
    used = [step.budget for result in results for step in result.steps]
    assert used[0] == 0 and set(used) <= {0, 2, 6} and max(used) > 0
    last = results[-1].budget_histogram()
    assert results[-1].stats()["budget"] == int(max(last, key=last.get)) > 0  # trees paid here
    assert max(step.tree_size for result in results for step in result.steps) <= 7

    pinned = Engine.from_cache(_ngram_config(budget="auto", adapt=False), tiny_llama)
    assert (pinned.budget_source, pinned.adaptive) == ("calibrated", None)
    assert pinned.generate(PROMPT, max_new_tokens=12).budget_histogram() == {"0": 12}


def test_an_adaptive_sampled_run_is_reproducible_from_its_seed(tiny_llama: Target) -> None:
    """The controller never reads the clock: fresh engines with one seed give one output."""
    fields = {"verifier": "sampling", "verifier_params": {"temperature": 1.0}, "seed": 5}
    config = _ngram_config(budget="auto").model_copy(update=fields)
    taus, cost_ms = {0: 1.0, 2: 1.2, 6: 1.3}, {0: 10.0, 2: 12.0, 6: 13.0}
    cal.save_calibration(calibration_record(cal.key_for(config, tiny_llama), taus, cost_ms))
    runs = [Engine.from_cache(config, tiny_llama).generate(PROMPT, max_new_tokens=40) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids
    assert [s.budget for s in runs[0].steps] == [s.budget for s in runs[1].steps]
    assert len(runs[0].budget_histogram()) > 1


def test_as_the_batch_grows_the_budget_shrinks_to_0_and_stays() -> None:
    """Steps of more rows cost more per drafted node (the forward holds every row's tree): the
    choice falls with the rows, reaches 0 where no tree pays, and holds there without flipping."""

    def batch_cost(rows: int) -> np.ndarray:
        tokens = rows * np.array([1, 3, 5, 9])  # each row's tree of budget 0, 2, 4, 8
        return 0.05 + 0.004 * np.maximum(tokens - 4, 0)  # free until 4 tokens, then linear

    controller = AdaptiveBudget(
        budgets=[0, 2, 4, 8],
        cost_s=[0.05, 0.05, 0.054, 0.07],
        prior_tau=[1.0, 1.6, 1.9, 2.2],
        batch_cost=batch_cost,
        probe_every=4,
    )
    choices = {rows: controller.next_budget(rows) for rows in (1, 2, 4, 16)}
    assert choices[1] >= choices[2] >= choices[4] and choices[16] == 0 and choices[1] > 0
    tree = DraftTree.root(5)
    held = []
    for _ in range(64):
        budget = controller.next_budget(16)
        controller.observe(tree, torch.zeros(1, dtype=torch.long), budget, nested=True)
        held.append(budget)
    assert held.count(0) >= 56  # probes thin out; the choice never leaves 0
    assert controller.choice == 0
