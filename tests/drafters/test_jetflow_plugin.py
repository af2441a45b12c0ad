"""The jetflow drafter: per-depth sessions, checkpoint lookup, and lossless decoding in the engine."""

from __future__ import annotations

import itertools

import pytest
import torch
from jetflow.core import calibration as cal
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.contracts import DraftContext
from jetflow.core.engine import Engine
from jetflow.core.errors import CheckpointMismatchError, JetflowError
from jetflow.core.tree import DraftTree
from jetflow.drafters.jetflow.plugin import BlockHeadParams, JetFlowDrafter, PerDepthSession
from jetflow.drafters.training.evaluation import accepted_lengths
from jetflow.drafters.training.examples import capture_sequences, collate

from tests.core.test_adaptive import calibration_record

from .tiny_heads import LAYERS, jetflow_registered, quick_trainer, save_head, tiny_head


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with jetflow_registered():
        yield


@pytest.fixture(scope="module")
def trainer(tiny_llama, tmp_path_factory):
    """A briefly trained tiny head (its final checkpoint is shippable fp16)."""
    trainer = quick_trainer(tiny_llama, tmp_path_factory.mktemp("jetflow-train"), steps=30)
    trainer.fit()
    return trainer


@pytest.fixture(scope="module")
def trained_head(trainer):
    return trainer.out / "final"


@pytest.fixture(scope="module")
def small_vocab_head(tiny_llama, tmp_path_factory):
    """A tiny head drafting over the 48 most frequent response tokens only."""
    out = tmp_path_factory.mktemp("jetflow-vocab")
    head = tiny_head(tiny_llama, draft_vocab_size=48)
    return quick_trainer(tiny_llama, out, head=head, steps=20).fit().final_checkpoint


def test_session_answers_children_from_the_next_depth() -> None:
    logprobs = torch.log_softmax(torch.randn(3, 20), dim=-1)
    session = PerDepthSession(logprobs)
    tree = DraftTree.root(5).extend(torch.tensor([0, 0]), torch.tensor([7, 8]), torch.tensor([-0.1, -0.2]))
    tree = tree.extend(torch.tensor([1]), torch.tensor([9]), torch.tensor([-0.3]))
    tree = tree.extend(torch.tensor([3]), torch.tensor([9]), torch.tensor([-0.3]))  # depth 3 = max
    tokens, scores = session.children(tree, torch.tensor([0, 2, 3, 4]), k=4)
    top = logprobs.topk(4, dim=1)
    assert torch.equal(tokens[0], top.indices[0]) and torch.equal(scores[0], top.values[0])
    assert torch.equal(tokens[1], top.indices[1])  # node 2 sits at depth 1 -> depth-2 row
    assert torch.equal(tokens[2], top.indices[2])
    assert torch.isinf(scores[3]).all()  # below max_depth nothing is proposed
    assert session.max_depth == 3


def test_session_maps_draft_vocabulary_columns_to_token_ids() -> None:
    logprobs = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0]]), dim=-1)
    session = PerDepthSession(logprobs, vocab=torch.tensor([10, 20, 30]))
    tokens, scores = session.children(DraftTree.root(1), torch.tensor([0]), k=2)
    assert tokens.tolist() == [[20, 30]] and torch.equal(scores, logprobs.topk(2).values)
    per_depth_tokens, per_depth_values = session.depth_proposals(2)  # (tokens, values)
    assert per_depth_tokens.tolist() == [[20, 30]] and torch.equal(per_depth_values, scores)


def test_a_missing_shipped_checkpoint_is_a_clear_error(tiny_llama) -> None:
    with pytest.raises(JetflowError, match="no jetflow head is shipped for target 'tiny-llama'"):
        JetFlowDrafter(BlockHeadParams(), tiny_llama)


def test_a_head_of_another_drafter_is_refused(tiny_llama, tmp_path) -> None:
    folder = save_head(tmp_path / "dflash", tiny_llama, tiny_head(tiny_llama, causal=False), drafter="dflash")
    with pytest.raises(CheckpointMismatchError, match="'dflash' head, not a 'jetflow' head"):
        JetFlowDrafter(BlockHeadParams(checkpoint=str(folder)), tiny_llama)


def test_drafter_reads_its_layers_and_tracks_the_context(tiny_llama, trained_head) -> None:
    drafter = JetFlowDrafter(BlockHeadParams(checkpoint=str(trained_head)), tiny_llama)
    assert drafter.feature_layers == (1, 2, 3)
    tokens = torch.tensor([5, 6, 7, 8])
    _, features = tiny_llama.prefill(tokens[:-1], drafter.feature_layers)
    drafter.reset()
    session = drafter.begin(DraftContext(tokens, features, 3))
    assert session.logprobs.shape == (5, tiny_llama.vocab_size) and session.max_depth == 5
    with pytest.raises(RuntimeError, match="out of step"):
        drafter.begin(DraftContext(tokens, None, 2))


def _engine(target, **fields) -> Engine:
    return Engine(build_config(GenerateConfig, fields), target)


def test_engine_with_jetflow_is_lossless(tiny_llama, trained_head, small_vocab_head) -> None:
    """Same tokens as the autoregressive loop, for several prompts, budgets, policies and heads."""
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 256, (n,), generator=generator).tolist() for n in (1, 5, 9)]
    baseline = _engine(tiny_llama, drafter="none", max_new_tokens=24, stop_at_eos=False)
    expected = [baseline.generate(p).token_ids for p in prompts]
    accepted = 0
    runs = [("best-first", 1), ("best-first", 6), ("best-first", 24), ("chain", 5)]
    for (policy, budget), checkpoint in zip(
        runs, [trained_head, trained_head, trained_head, small_vocab_head], strict=True
    ):
        engine = _engine(
            tiny_llama,
            drafter="jetflow",
            drafter_params={"checkpoint": str(checkpoint)},
            tree={"policy": policy, "budget": budget, "width": 3},
            max_new_tokens=24,
            stop_at_eos=False,
        )
        for prompt, want in zip(prompts, expected, strict=True):
            result = engine.generate(prompt)
            assert result.token_ids == want, (policy, budget, prompt)
            accepted += sum(step.accepted for step in result.steps)
    assert accepted > 0  # the trained head's drafts do get accepted


def test_steps_without_drafting_keep_the_heads_context_in_step(
    tiny_llama, trained_head, tmp_path, monkeypatch
) -> None:
    """An adaptive budget switches between no drafting and trees; the features of the steps the
    drafter skipped reach it at the next drafting step, so it stays in step and lossless."""
    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path))
    fields = {
        "drafter": "jetflow",
        "drafter_params": {"checkpoint": str(trained_head)},
        "tree": {"budget": "auto", "width": 3},
        "max_new_tokens": 40,
        "stop_at_eos": False,
    }
    config = build_config(GenerateConfig, fields)
    # no drafting calibrated best, budget 2 just as good: probes at 2 start at once
    record = calibration_record(cal.key_for(config, tiny_llama), {0: 1.0, 2: 1.2}, {0: 10.0, 2: 12.0})
    engine = Engine(config, tiny_llama, calibration=record)
    assert engine.budget == 0 and engine.drafting
    baseline = _engine(tiny_llama, drafter="none", max_new_tokens=40, stop_at_eos=False)
    prompt = [5, 9, 14, 3, 22]
    result = engine.generate(prompt)
    assert result.token_ids == baseline.generate(prompt).token_ids
    used = [step.budget for step in result.steps]
    assert used[0] == 0 and 2 in used
    assert any(a == 0 and b == 0 for a, b in itertools.pairwise(used))  # features piled up


def test_the_trainers_chain_metric_is_what_the_engine_accepts(tiny_llama, trainer, trained_head) -> None:
    """Greedy chain decoding accepts, at every step's root, exactly the leading agreeing depths
    that the trainer's held-out metric counts: training and decoding see the same head."""
    engine = _engine(
        tiny_llama,
        drafter="jetflow",
        drafter_params={"checkpoint": str(trained_head)},
        tree={"policy": "chain", "budget": 5, "width": 1},
        max_new_tokens=30,
        stop_at_eos=False,
    )
    head = JetFlowDrafter(BlockHeadParams(checkpoint=str(trained_head)), tiny_llama).head.float()
    total = 0
    for index in trainer.train_ids[:3].tolist():  # sequences the head has seen: many acceptances
        prompt = trainer.store.sequence(index)[0][:8].tolist()
        result = engine.generate(prompt)
        accepted = [step.accepted for step in result.steps]
        roots = len(prompt) - 1 + torch.tensor([0, *accepted[:-1]]).cumsum(0) + torch.arange(len(accepted))
        store = capture_sequences(tiny_llama.model, [torch.tensor(prompt + result.token_ids)], [8], LAYERS)
        batch = collate(store.records, [roots], torch.float32)
        with torch.no_grad():
            preds = head.training_predictions(batch, trainer.shared)
        lengths = accepted_lengths(preds, trainer.objective.top1_hits(batch, preds), head.max_depth)
        assert lengths[:-1].tolist() == accepted[:-1]  # the last step is cut by max_new_tokens
        total += sum(accepted)
    assert total > 0
