"""Many sequences at once: every row's output is what its prompt gives alone, for every batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jetflow.core.allocation import Allocation, allocate
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.engine import Engine
from jetflow.core.errors import ConfigError
from jetflow.core.target import Target
from jetflow.core.tree import DraftTree
from jetflow.drafters.jetflow.plugin import JetFlowDrafter

from tests.drafters.tiny_heads import jetflow_registered, save_head, tiny_head

from .test_engine import _oracle_registered, _reference  # noqa: F401 (an autouse fixture)


def _engine(target: Target, **fields) -> Engine:
    return Engine(build_config(GenerateConfig, {"stop_at_eos": False, **fields}), target)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (n,), generator=generator).tolist() for n in lengths]


@settings(settings.get_profile("engine"), max_examples=8)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    batch_size=st.integers(1, 4),
    budget=st.integers(1, 12),
    width=st.integers(1, 3),
    policy=st.sampled_from(["chain", "best-first"]),
    split=st.sampled_from(["best-first", "equal"]),
    new=st.integers(1, 20),
    seed=st.integers(0, 1000),
)
def test_every_row_of_a_batch_is_lossless(
    tiny_target: Target, lengths, batch_size, budget, width, policy, split, new, seed
) -> None:
    """Random batches, prompt lengths, trees and splits: each row equals ``generate`` on its prompt
    alone, and rows refilled from the queue (more prompts than rows) too."""
    prompts = _prompts(seed, lengths)
    expected = [_reference(tiny_target, prompt, new, eos=False) for prompt in prompts]
    references = tuple(tuple([*p, *e]) for p, e in zip(prompts, expected, strict=True))
    engine = _engine(
        tiny_target,
        drafter="test-oracle",
        drafter_params={"references": references, "hit_rate": 0.7, "seed": seed},
        tree={"policy": policy, "budget": budget, "width": width, "split": split},
        max_new_tokens=new,
    )
    results = engine.generate_batch(prompts, batch_size=batch_size)
    assert [result.token_ids for result in results] == expected
    assert [result.prompt_ids for result in results] == prompts
    rows = {step.rows for result in results for step in result.steps}
    assert max(rows) == min(batch_size, len(prompts))
    for result in results:
        for step in result.steps:
            assert step.budget == step.tree_size - 1 or step.rows == 1
            assert step.budget <= step.batch_budget


@pytest.fixture(scope="module")
def head_folder(tiny_llama, tmp_path_factory):
    return save_head(tmp_path_factory.mktemp("batch-head"), tiny_llama, tiny_head(tiny_llama))


@pytest.mark.parametrize("drafter", ["jetflow", "ngram", "jetflow+ngram"])
def test_learned_and_composed_drafters_batch_losslessly(
    tiny_llama: Target, head_folder, drafter: str
) -> None:
    prompts = _prompts(5, [3, 9, 4, 12, 6])
    prompts[1] = prompts[1] + prompts[1][:5]  # something for prompt lookup to find
    params = {"checkpoint": str(head_folder)}
    drafter_params = {"jetflow": params, "ngram": {}, "jetflow+ngram": {"jetflow": params}}[drafter]
    with jetflow_registered():
        engine = _engine(
            tiny_llama, drafter=drafter, drafter_params=drafter_params, tree={"budget": 4}, max_new_tokens=16
        )
        batched = engine.generate_batch(prompts, batch_size=3)
        alone = [engine.generate(prompt).token_ids for prompt in prompts]
    plain = _engine(tiny_llama, drafter="none", max_new_tokens=16)
    assert [result.token_ids for result in batched] == alone
    assert alone == [plain.generate(prompt).token_ids for prompt in prompts]


def test_sampled_rows_draw_what_they_draw_alone(tiny_llama: Target) -> None:
    """With an equal split each row's trees are its own, and each row's generator is seeded as
    when alone: the sampled answers are the ones the prompts get one at a time."""
    prompts = _prompts(11, [4, 7, 2, 9])
    engine = _engine(
        tiny_llama,
        drafter="ngram",
        verifier="sampling",
        verifier_params={"temperature": 1.0},
        tree={"budget": 3, "split": "equal"},
        max_new_tokens=12,
        seed=7,
    )
    batched = [result.token_ids for result in engine.generate_batch(prompts, batch_size=4)]
    assert batched == [engine.generate(prompt).token_ids for prompt in prompts]


def test_bad_batch_arguments_are_clear_errors(tiny_llama: Target) -> None:
    engine = _engine(tiny_llama, drafter="none")
    with pytest.raises(ConfigError, match="batch_size"):
        engine.generate_batch([[5, 6]], batch_size=0)
    with pytest.raises(ConfigError, match="list of prompts"):
        engine.generate_batch("one prompt")  # type: ignore[arg-type]
    assert engine.generate_batch([]) == []


def _tree(scores: list[float], parents: list[int]) -> DraftTree:
    n = len(scores)
    return DraftTree(torch.arange(n) + 2, torch.tensor(parents), torch.tensor(scores))


def test_allocation_spends_the_total_where_acceptance_is_expected() -> None:
    confident = _tree([0.0, -0.1, -0.2, -0.3, -5.0], [-1, 0, 1, 2, 0])
    doubtful = _tree([0.0, -2.0, -2.5, -3.0, -3.5], [-1, 0, 1, 0, 3])
    kept = allocate([confident, doubtful], Allocation.of(2, [1.0, 1.0]))
    assert [tree.size - 1 for tree in kept] == [3, 1]
    assert kept[0].parents.tolist() == [-1, 0, 1, 2]  # every kept node's ancestors kept
    # a row whose steps accepted far less than its drafts promised loses its nodes
    kept = allocate([confident, doubtful], Allocation.of(2, [0.01, 1.0]))
    assert [tree.size - 1 for tree in kept] == [0, 4]
    assert allocate([confident, doubtful], Allocation.of(4, [1.0, 1.0])) == [confident, doubtful]


def test_rows_drafted_past_their_share_reach_one_level_deeper(
    tiny_llama: Target, head_folder, monkeypatch
) -> None:
    """Best-first drafts a batch's rows at up to three times their share, but asks the head for
    only one depth past the share's deepest tree (a chain of ``share`` nodes)."""
    depths: list[tuple[int, int | None]] = []
    begin_rows = JetFlowDrafter.begin_rows

    def spy(self, rows, contexts):
        depths.extend((len(contexts), context.depth) for context in contexts)
        return begin_rows(self, rows, contexts)

    monkeypatch.setattr(JetFlowDrafter, "begin_rows", spy)
    with jetflow_registered():
        engine = _engine(
            tiny_llama,
            drafter="jetflow",
            drafter_params={"checkpoint": str(head_folder)},
            tree={"budget": 2, "adapt": False, "width": 3},
            max_new_tokens=8,
        )
        engine.generate_batch(_prompts(3, [4, 6, 5]), batch_size=3)
    assert {depth for rows, depth in depths if rows > 1} == {3}
    assert {depth for rows, depth in depths if rows == 1} <= {2}


def test_a_refined_batch_keeps_each_row_within_its_share(tiny_llama: Target, tmp_path) -> None:
    """Refreshed trees are rebuilt (not nested), so they cannot be cut back to a share: each row
    drafts exactly its budget, and the answers stay lossless."""
    head = tiny_head(tiny_llama, path_conditioning=0.5)
    folder = save_head(tmp_path / "refresh-head", tiny_llama, head)
    prompts = _prompts(3, [4, 8, 6])
    with jetflow_registered():
        engine = _engine(
            tiny_llama,
            drafter="jetflow",
            drafter_params={"checkpoint": str(folder), "refresh": True},
            tree={"budget": 3},
            max_new_tokens=10,
        )
        results = engine.generate_batch(prompts, batch_size=3)
    plain = _engine(tiny_llama, drafter="none", max_new_tokens=10)
    assert [r.token_ids for r in results] == [plain.generate(p).token_ids for p in prompts]
    assert all(step.tree_size - 1 <= 3 for result in results for step in result.steps)
