"""Batched drafting: ``begin_rows`` answers every row as that row's own ``begin`` would, in one forward."""

from __future__ import annotations

import pytest
import torch
from jetflow.core.contracts import DraftContext, TreeShape
from jetflow.core.registry import default_registry
from jetflow.core.tree import DraftTree
from jetflow.drafters.block_head import BlockHead
from jetflow.drafters.dflash.plugin import DFlashDrafter
from jetflow.drafters.jetflow.plugin import (
    BlockHeadParams,
    JetFlowDrafter,
    PathConditionedSession,
    PerDepthSession,
    RefreshableSession,
)
from jetflow.policies.best_first import BestFirst

from .tiny_heads import LAYERS, jetflow_registered, save_head, tiny_head

#: (prompt length, length after the second step) per row: every row's context differs in length
LENGTHS = [(9, 12), (4, 10), (14, 15)]
SHAPE = TreeShape(budget=10, width=3, max_depth=5)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with jetflow_registered():
        yield


@pytest.fixture(scope="module")
def sequences(tiny_llama) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per row: tokens (a repeated pattern, so prompt lookup finds matches) and their features."""
    generator = torch.Generator().manual_seed(3)
    rows = []
    for _, total in LENGTHS:
        pattern = torch.randint(2, 256, (5,), generator=generator)
        tokens = pattern.repeat(4)[:total]
        with torch.inference_mode():
            out = tiny_llama.model(input_ids=tokens[None], output_hidden_states=True)
        rows.append((tokens, torch.stack([out.hidden_states[i][0] for i in LAYERS], dim=1)))
    return rows


def _contexts(sequences, step: int) -> list[DraftContext]:
    """Step 0: the prompts (all but their last token processed); step 1: a few tokens more each."""
    contexts = []
    for (tokens, features), (prompt, total) in zip(sequences, LENGTHS, strict=True):
        start, end = (0, prompt) if step == 0 else (prompt, total)
        contexts.append(DraftContext(tokens[:end], features[max(start - 1, 0) : end - 1], end - 1))
    return contexts


def _drafter(cls, target, folder, **head_options) -> JetFlowDrafter:
    head = tiny_head(target, num_layers=2, causal=cls.causal, **head_options)
    checkpoint = save_head(folder, target, head, drafter=cls.name)
    refresh = bool(head_options.get("path_conditioning"))
    return cls(BlockHeadParams(checkpoint=str(checkpoint), refresh=refresh), target)


def _count_forwards(head: BlockHead, monkeypatch) -> list[int]:
    """Record the batch size of every block forward of ``head``."""
    calls: list[int] = []
    forward = head.block_hidden

    def counted(x, *args, **kwargs):
        calls.append(int(x.shape[0]))
        return forward(x, *args, **kwargs)

    monkeypatch.setattr(head, "block_hidden", counted)
    return calls


HEADS = [
    pytest.param(JetFlowDrafter, {}, id="jetflow"),
    pytest.param(DFlashDrafter, {}, id="dflash"),
    pytest.param(
        JetFlowDrafter, {"anchored_slots": True, "context_tokens": True}, id="jetflow-anchored-tokens"
    ),
    pytest.param(
        DFlashDrafter, {"anchored_slots": True, "context_tokens": True}, id="dflash-anchored-tokens"
    ),
    pytest.param(JetFlowDrafter, {"draft_vocab_size": 48}, id="jetflow-draft-vocab"),
]


@pytest.mark.parametrize(("cls", "options"), HEADS)
def test_begin_rows_is_each_rows_own_begin_in_one_forward(
    tiny_llama, sequences, tmp_path, monkeypatch, cls, options
) -> None:
    drafter = _drafter(cls, tiny_llama, tmp_path, **options)
    batched = [drafter.for_row() for _ in LENGTHS]
    alone = [drafter.for_row() for _ in LENGTHS]
    calls = _count_forwards(drafter.head, monkeypatch)
    for step in (0, 1):  # the second step extends caches of different lengths by different counts
        contexts = _contexts(sequences, step)
        calls.clear()
        sessions = drafter.begin_rows(batched, contexts)
        assert calls == [len(LENGTHS)], "one block forward for the whole batch"
        expected = [row.begin(context) for row, context in zip(alone, contexts, strict=True)]
        assert calls[1:] == [1] * len(LENGTHS)
        for session, want, context in zip(sessions, expected, contexts, strict=True):
            assert isinstance(session, PerDepthSession) and isinstance(want, PerDepthSession)
            assert session.logprobs.shape == want.logprobs.shape == (5, want.logprobs.shape[1])
            torch.testing.assert_close(session.logprobs, want.logprobs, atol=1e-5, rtol=0)
            root = DraftTree.root(int(context.tokens[-1]))
            policy = BestFirst(BestFirst.Params())
            got, ref = policy.build(session, root, SHAPE), policy.build(want, root, SHAPE)
            assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.parents, ref.parents)
    for row, ref in zip(batched, alone, strict=True):  # each row keeps its own cache
        assert row._cache.length == ref._cache.length
    assert [row._cache.length for row in batched] == [total - 1 for _, total in LENGTHS]
    assert drafter._cache.length == 0, "the base drafter's own state is untouched"


def test_rows_do_not_see_each_others_context(tiny_llama, sequences, tmp_path) -> None:
    """A row's drafts do not move when another row's context changes (the padding is hidden)."""
    drafter = _drafter(JetFlowDrafter, tiny_llama, tmp_path)
    contexts = _contexts(sequences, 0)
    first = drafter.begin_rows([drafter.for_row() for _ in LENGTHS], contexts)
    other = contexts[1]
    contexts[1] = DraftContext(other.tokens, torch.randn_like(other.features), other.n_processed)
    second = drafter.begin_rows([drafter.for_row() for _ in LENGTHS], contexts)
    torch.testing.assert_close(first[0].logprobs, second[0].logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(first[2].logprobs, second[2].logprobs, atol=1e-5, rtol=0)
    assert not torch.allclose(first[1].logprobs, second[1].logprobs, atol=1e-3)


def test_refreshing_rows_refresh_from_their_own_cache(tiny_llama, sequences, tmp_path) -> None:
    drafter = _drafter(JetFlowDrafter, tiny_llama, tmp_path, path_conditioning=0.5, anchored_slots=True)
    contexts = _contexts(sequences, 0)
    sessions = drafter.begin_rows([drafter.for_row() for _ in LENGTHS], contexts)
    alone = [drafter.for_row().begin(context) for context in contexts]
    policy = BestFirst(BestFirst.Params())
    for session, want, context in zip(sessions, alone, contexts, strict=True):
        assert isinstance(session, RefreshableSession) and isinstance(want, RefreshableSession)
        tree = policy.build(want, DraftTree.root(int(context.tokens[-1])), SHAPE)
        got, ref = session.refine(tree), want.refine(tree)
        assert isinstance(got, PathConditionedSession) and isinstance(ref, PathConditionedSession)
        torch.testing.assert_close(got.per_node.logprobs, ref.per_node.logprobs, atol=1e-5, rtol=0)


def test_begin_rows_refuses_rows_of_another_drafter(tiny_llama, sequences, tmp_path) -> None:
    drafter = _drafter(JetFlowDrafter, tiny_llama, tmp_path / "a")
    stranger = _drafter(JetFlowDrafter, tiny_llama, tmp_path / "b")
    with pytest.raises(TypeError, match="for_row"):
        drafter.begin_rows([drafter.for_row(), stranger.for_row()], _contexts(sequences, 0)[:2])


def test_a_single_row_is_begin(tiny_llama, sequences, tmp_path) -> None:
    """``begin`` is ``begin_rows`` of one row: the same numbers exactly."""
    drafter = _drafter(DFlashDrafter, tiny_llama, tmp_path, anchored_slots=True)
    context = _contexts(sequences, 0)[0]
    (batched,) = drafter.begin_rows([drafter.for_row()], [context])
    assert isinstance(batched, PerDepthSession)
    assert torch.equal(batched.logprobs, drafter.for_row().begin(context).logprobs)


def _children(session, context: DraftContext) -> tuple[DraftTree, tuple[torch.Tensor, torch.Tensor]]:
    """The best-first tree of ``session`` and the children it proposes at every node of it."""
    tree = BestFirst(BestFirst.Params()).build(session, DraftTree.root(int(context.tokens[-1])), SHAPE)
    return tree, session.children(tree, torch.arange(tree.size), 4)


def test_composed_rows_give_the_same_children(tiny_llama, sequences, tmp_path, monkeypatch) -> None:
    """``jetflow+ngram``: one head forward for the batch; per row the same mixture as ``begin``,
    with each row's own hit rate (judged at the second step against that row's tokens)."""
    checkpoint = save_head(tmp_path, tiny_llama, tiny_head(tiny_llama, anchored_slots=True))
    cls = default_registry().get("drafter", "jetflow+ngram")
    params = cls.Params.model_validate({"jetflow": {"checkpoint": str(checkpoint)}, "prior": 0.4})
    drafter = cls(params, tiny_llama)
    batched = [drafter.for_row() for _ in LENGTHS]
    alone = [drafter.for_row() for _ in LENGTHS]
    calls = _count_forwards(drafter.drafters[0].head, monkeypatch)
    for step in (0, 1):
        contexts = _contexts(sequences, step)
        calls.clear()
        sessions = drafter.begin_rows(batched, contexts)
        assert calls == [len(LENGTHS)]
        expected = [row.begin(context) for row, context in zip(alone, contexts, strict=True)]
        for session, want, context in zip(sessions, expected, contexts, strict=True):
            assert session.weight == pytest.approx(want.weight)
            (got_tree, got), (ref_tree, ref) = _children(session, context), _children(want, context)
            assert torch.equal(got_tree.tokens, ref_tree.tokens)
            assert torch.equal(got[0][torch.isfinite(got[1])], ref[0][torch.isfinite(ref[1])])
            torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=0)
    weights = [row.hit_rate.weight for row in batched]
    assert weights == pytest.approx([row.hit_rate.weight for row in alone])
    trials = [row.hit_rate.trials for row in batched]
    assert trials == [row.hit_rate.trials for row in alone]
    assert trials[0] > 0 and trials[2] > 0, "the rows whose prompts repeat had their lookups judged"


@pytest.mark.parametrize(("cls", "options"), HEADS)
def test_a_depth_bound_drafts_the_same_first_depths(tiny_llama, sequences, tmp_path, cls, options) -> None:
    """A causal head given the tree's depth bound drafts only those depths, exactly as it drafts
    them in the full block; a bidirectional head (every slot sees every other) drafts them all."""
    drafter = _drafter(cls, tiny_llama, tmp_path, **options)
    full_rows, bounded_rows = [drafter.for_row() for _ in LENGTHS], [drafter.for_row() for _ in LENGTHS]
    for step in (0, 1):
        contexts = _contexts(sequences, step)
        bounded = [DraftContext(c.tokens, c.features, c.n_processed, depth=2) for c in contexts]
        full = drafter.begin_rows(full_rows, contexts)
        cut = drafter.begin_rows(bounded_rows, bounded)
        for whole, part in zip(full, cut, strict=True):
            assert isinstance(whole, PerDepthSession) and isinstance(part, PerDepthSession)
            depths = 2 if cls.causal else whole.logprobs.shape[0]
            assert part.logprobs.shape[0] == part.max_depth == depths
            torch.testing.assert_close(part.logprobs, whole.logprobs[:depths], atol=1e-5, rtol=0)
