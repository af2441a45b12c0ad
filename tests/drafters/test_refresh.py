"""Path-conditioned refresh: training with revealed slots, the tree pass, the rebuilt session."""

from __future__ import annotations

import pytest
import torch
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.engine import Engine
from jetflow.core.errors import ConfigError
from jetflow.core.tree import DraftTree
from jetflow.drafters.blocks import FrozenTargetParts
from jetflow.drafters.jetflow.plugin import (
    BlockHeadParams,
    JetFlowDrafter,
    PathConditionedSession,
    PerDepthSession,
)
from jetflow.drafters.training.examples import capture_sequences, collate

from .tiny_heads import LAYERS, jetflow_registered, quick_trainer, save_head, tiny_head


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with jetflow_registered():
        yield


@pytest.fixture(scope="module")
def record(tiny_llama):
    tokens = torch.randint(2, 256, (30,), generator=torch.Generator().manual_seed(5))
    return capture_sequences(tiny_llama.model, [tokens], [4], LAYERS).records[0]


def _random_tree(root: int, size: int, seed: int) -> DraftTree:
    """A tree of ``size`` drafted nodes with random shape and tokens (depth <= 4)."""
    generator = torch.Generator().manual_seed(seed)
    tree = DraftTree.root(root)
    for _ in range(size):
        shallow = torch.nonzero(tree.depths < 4).flatten()
        parent = shallow[torch.randint(len(shallow), (1,), generator=generator)]
        tree = tree.extend(parent, torch.randint(2, 256, (1,), generator=generator), torch.tensor([-1.0]))
    return tree


@pytest.mark.parametrize("anchored", [False, True])
@torch.no_grad()
def test_refresh_equals_a_training_block_with_the_path_revealed(tiny_llama, record, anchored: bool) -> None:
    """A node's refreshed children are what training taught: its path shown, the next slot asked."""
    head = tiny_head(tiny_llama, num_layers=2, path_conditioning=0.5, anchored_slots=anchored).eval()
    shared = FrozenTargetParts.from_target(tiny_llama)
    tokens, _, features, _ = record
    anchor = 17
    cache = head.extend(head.empty_cache(), features[:anchor].float())
    tree = _random_tree(int(tokens[anchor]), size=9, seed=2)
    refreshed = head.refresh(cache, shared.embed(tree.tokens), tree.depths, tree.ancestor_mask)
    assert refreshed.shape == (tree.size, 64)

    batch = collate([record], [torch.tensor([anchor])], torch.float32)
    anchor_embeds = shared.embed(batch.tokens.gather(1, batch.anchors))
    for node in range(tree.size):
        depth = int(tree.depths[node])
        path = tree.path_tokens[node, :depth] if depth else torch.zeros(0, dtype=torch.long)
        shown = torch.zeros(1, 1, head.max_depth, dtype=torch.long)
        shown[0, 0, :depth] = path
        revealed = (shared.embed(shown), torch.tensor([[depth]]))
        expected = head(batch.features, anchor_embeds, batch.anchors, revealed)[0, 0, depth]
        torch.testing.assert_close(refreshed[node], expected, atol=2e-5, rtol=1e-4)
    # With nothing revealed the root's query is the ordinary depth-1 draft.
    torch.testing.assert_close(
        refreshed[0], head.draft(cache, shared.embed(tokens[anchor]))[0], atol=2e-5, rtol=1e-4
    )


def test_training_hides_revealed_slots_from_the_loss_and_only_while_training(tiny_llama, record) -> None:
    head = tiny_head(tiny_llama, path_conditioning=1.0)
    shared = FrozenTargetParts.from_target(tiny_llama)
    batch = collate([record], [torch.tensor([3, 9, 14])], torch.float32)
    counts = head.reveal_counts(batch.anchors)
    assert torch.equal(counts, head.reveal_counts(batch.anchors))  # reproducible (resume)
    assert bool((counts >= 1).all()) and bool((counts <= head.max_depth - 1).all())
    preds = head.training_predictions(batch, shared)
    anchor_of = preds.positions - preds.depths
    for anchor, count in zip(batch.anchors[0].tolist(), counts[0].tolist(), strict=True):
        assert int(preds.depths[anchor_of == anchor].min()) == count + 1
    full = head.eval().training_predictions(batch, shared)
    assert full.hidden.shape[0] > preds.hidden.shape[0]


def test_bidirectional_heads_cannot_be_path_conditioned(tiny_llama) -> None:
    with pytest.raises(ValueError, match="causal"):
        tiny_head(tiny_llama, causal=False, path_conditioning=0.5)


def test_rebuilt_nodes_answer_from_their_own_path_or_fall_back_to_the_depth() -> None:
    base = PerDepthSession(torch.log_softmax(torch.randn(4, 30), dim=-1))
    first = DraftTree.root(1).extend(torch.tensor([0, 0]), torch.tensor([7, 8]), torch.tensor([-0.1, -0.5]))
    first = first.extend(torch.tensor([1]), torch.tensor([9]), torch.tensor([-0.2]))
    per_node = torch.log_softmax(torch.randn(first.size, 30), dim=-1)
    session = PathConditionedSession(base, first, per_node)
    # The rebuilt tree shares root -> 8 and root -> 7 -> 9 with the first, but 7 -> 3 is new.
    tree = DraftTree.root(1).extend(torch.tensor([0, 0]), torch.tensor([8, 7]), torch.tensor([-0.1, -0.2]))
    tree = tree.extend(torch.tensor([2, 2]), torch.tensor([9, 3]), torch.tensor([-0.3, -0.4]))
    tokens, scores = session.children(tree, torch.arange(tree.size), k=3)
    first_of = [0, 2, 1, 3, -1]  # rebuilt node -> first-tree node
    for node, match in enumerate(first_of):
        source = per_node[match] if match >= 0 else base.logprobs[int(tree.depths[node])]
        assert torch.equal(scores[node], source.topk(3).values), node
        assert torch.equal(tokens[node], source.topk(3).indices), node
    assert session.forwards == 2


@pytest.fixture(scope="module")
def conditioned_head(tiny_llama, tmp_path_factory):
    head = tiny_head(tiny_llama, path_conditioning=0.5)
    return (
        quick_trainer(tiny_llama, tmp_path_factory.mktemp("refresh"), head=head, steps=30)
        .fit()
        .final_checkpoint
    )


def test_engine_with_refresh_is_lossless(tiny_llama, conditioned_head) -> None:
    def engine(**fields) -> Engine:
        return Engine(
            build_config(GenerateConfig, fields | {"max_new_tokens": 24, "stop_at_eos": False}), tiny_llama
        )

    prompts = [
        torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (2, 7)
    ]
    baseline = engine(drafter="none")
    params = {"checkpoint": str(conditioned_head), "refresh": True}
    for budget in (3, 12):
        spec = engine(drafter="jetflow", drafter_params=params, tree={"budget": budget, "width": 3})
        for prompt in prompts:
            result = spec.generate(prompt)
            assert result.token_ids == baseline.generate(prompt).token_ids
            assert {step.draft_forwards for step in result.steps} == {2}


def test_refresh_needs_a_path_conditioned_head(tiny_llama, tmp_path) -> None:
    folder = save_head(tmp_path / "plain", tiny_llama, tiny_head(tiny_llama))
    with pytest.raises(ConfigError, match="path_conditioning"):
        JetFlowDrafter(BlockHeadParams(checkpoint=str(folder), refresh=True), tiny_llama)


def test_full_distributions_put_draft_vocabulary_mass_on_token_ids() -> None:
    logprobs = torch.log_softmax(torch.randn(2, 3), dim=-1)
    session = PerDepthSession(logprobs, vocab=torch.tensor([4, 9, 2]), vocab_size=12)
    tree = DraftTree.root(1).extend(torch.tensor([0]), torch.tensor([9]), torch.tensor([-0.5]))
    tree = tree.extend(torch.tensor([1]), torch.tensor([4]), torch.tensor([-0.5]))
    probs = session.distributions(tree, torch.tensor([0, 1, 2]))
    assert probs.shape == (3, 12)
    torch.testing.assert_close(probs[:2, [4, 9, 2]], logprobs.exp())
    assert float(probs[:2].sum(1).sub(1).abs().max()) < 1e-6 and not probs[2].any()  # past the last depth


def test_sampling_with_refreshed_sampled_trees_is_greedy_at_top_k_1(tiny_llama, conditioned_head) -> None:
    """The sampling verifier over trees sampled from refreshed distributions, at top-k 1, is greedy."""
    fields = {"max_new_tokens": 16, "stop_at_eos": False}
    prompt = torch.randint(2, 256, (6,), generator=torch.Generator().manual_seed(3)).tolist()
    greedy = Engine(build_config(GenerateConfig, fields | {"drafter": "none"}), tiny_llama).generate(prompt)
    config = fields | {
        "drafter": "jetflow",
        "drafter_params": {"checkpoint": str(conditioned_head), "refresh": True},
        "tree": {"policy": "sampled", "budget": 6, "width": 2},
        "verifier": "sampling",
        "verifier_params": {"top_k": 1},
    }
    result = Engine(build_config(GenerateConfig, config), tiny_llama).generate(prompt)
    assert result.token_ids == greedy.token_ids
