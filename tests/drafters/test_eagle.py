"""The eagle drafter: one code path for training and decoding, its KV cache, training, lossless decoding.

The head's two layouts (jetflow's, vLLM's Eagle3) run every test that exercises the code path.
"""

from __future__ import annotations

import pytest
import torch
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.contracts import DraftContext, TreeShape
from jetflow.core.engine import Engine
from jetflow.core.errors import CheckpointMismatchError, ConfigError, JetflowError
from jetflow.core.registry import default_registry
from jetflow.core.tree import DraftTree
from jetflow.drafters.blocks import DraftLMHead, FrozenTargetParts
from jetflow.drafters.checkpoint import load_checkpoint, read_checkpoint
from jetflow.drafters.eagle.head import EagleHead, EagleHeadConfig, low_middle_high
from jetflow.drafters.eagle.plugin import EagleDrafter, EagleParams, EagleSession
from jetflow.drafters.training import TrainConfig
from jetflow.drafters.training.examples import capture_sequences, collate
from jetflow.drafters.training.trainer import Trainer
from jetflow.policies.eagle_dynamic import EagleDynamic

from tests.conftest import make_tiny_target

from .tiny_heads import LAYERS, head_info, quick_config, regenerated_store, save_head, tiny_head

DEPTHS = 4


def tiny_eagle(target, seed: int = 0, **overrides) -> EagleHead:
    torch.manual_seed(seed)
    options = {"feature_layers": LAYERS, "ttt_steps": DEPTHS} | overrides
    return EagleHead(EagleHeadConfig.for_target(target, **options))


def eagle_trainer(target, out, head: EagleHead | None = None, **overrides) -> Trainer:
    """The shared trainer, exactly as for the jetflow head, on the same tiny corpus."""
    head = head or tiny_eagle(target)
    return Trainer(
        quick_config(**overrides),
        head,
        FrozenTargetParts.from_target(target),
        regenerated_store(target),
        head_info(target, head, drafter="eagle"),
        out=out,
        progress=False,
    )


def session_of(head: EagleHead, target, features: torch.Tensor, tokens: torch.Tensor) -> EagleSession:
    """A decoding step's session after the context ``tokens`` (features of all but the last)."""
    shared = FrozenTargetParts.from_target(target)
    with torch.no_grad():
        cache = head.extend(head.empty_cache(), features, shared.embed(tokens[1:]))
    return EagleSession(head, DraftLMHead.build(shared.lm_head, head.draft_tokens), shared, cache, None)


def full_logprobs(session: EagleSession, tree: DraftTree, nodes: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[f, vocab]`` through the public ``children`` (top-``vocab`` scattered back by token id)."""
    tokens, logprobs = session.children(tree, nodes, vocab)
    return torch.empty(nodes.shape[0], vocab).scatter_(1, tokens, logprobs)


@pytest.fixture(scope="module")
def records(tiny_llama):
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(2, 256, (length,), generator=generator) for length in (26, 19)]
    return capture_sequences(tiny_llama.model, sequences, [6, 4], LAYERS).records


@pytest.fixture(scope="module", params=["jetflow", "eagle3"])
def layout(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def trained(tiny_llama, tmp_path_factory, layout):
    """A briefly trained tiny eagle head: its trainer (with the before/after evaluation) and checkpoint."""
    head = tiny_eagle(tiny_llama, layout=layout)
    trainer = eagle_trainer(tiny_llama, tmp_path_factory.mktemp(f"eagle-train-{layout}"), head, steps=40)
    before = trainer.evaluate()
    result = trainer.fit()
    return trainer, before, result


# ---------------------------------------------------------------------- head


def test_drafter_and_policy_are_installed_plugins() -> None:
    registry = default_registry()
    assert registry.get("drafter", "eagle") is EagleDrafter
    assert registry.get("tree_policy", "eagle-dynamic") is EagleDynamic


def test_the_recipe_trains_on_the_same_tokens_as_jetflows() -> None:
    from jetflow.drafters.jetflow.plugin import JetFlowDrafter

    eagle = TrainConfig.from_toml(EagleDrafter.default_train_config())
    jetflow = TrainConfig.from_toml(JetFlowDrafter.default_train_config())
    assert EagleDrafter.default_train_config().parent.name == "eagle" and eagle.drafter == "eagle"
    same = ("target", "corpus", "features", "steps", "batch_sequences", "anchors_per_sequence", "seed")
    assert all(getattr(eagle, name) == getattr(jetflow, name) for name in (*same, "holdout_sequences"))
    assert eagle.loss.kind == "forward-kl" and eagle.head["ttt_steps"] >= 1


def test_config_reads_low_middle_and_high_cached_layers(tiny_llama) -> None:
    assert low_middle_high(30) == (1, 14, 27)  # a subset of the block heads' (1, 8, 14, 20, 27)
    assert low_middle_high(36) == (1, 17, 33)
    config = EagleHeadConfig.for_target(tiny_llama)
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (64, 4, 2, 16)
    assert config.feature_layers == (1,) and config.ttt_steps == 7
    with pytest.raises(ConfigError, match="invalid head options for eagle"):
        EagleDrafter.new_head(tiny_llama, {"num_layers": 2})


def test_head_shapes_and_owns_no_target_weights(tiny_llama, records, layout) -> None:
    head = tiny_eagle(tiny_llama, draft_vocab_size=32, layout=layout)
    shared = FrozenTargetParts.from_target(tiny_llama)
    batch = collate(records, [torch.tensor([1, 5, 11]), torch.tensor([3, 9])], torch.float32)
    hidden = head(batch.features, shared.embed(batch.tokens), batch.anchors)
    assert hidden.shape == (2, 3, DEPTHS, 64)
    preds = head.training_predictions(batch, shared)
    assert preds.hidden.shape == (5 * DEPTHS, 64)
    assert sorted(set(preds.depths.tolist())) == list(range(1, DEPTHS + 1))
    state = head.state_dict()
    assert not any("embed_tokens" in name or "lm_head" in name for name in state)
    assert all(256 not in tensor.shape for tensor in state.values())
    assert state["draft_tokens"].shape == (32,)


def test_the_layouts_differ_where_vllms_eagle3_layer_does(tiny_llama) -> None:
    jetflow, eagle3 = (
        tiny_eagle(tiny_llama, layout=layout, qk_norm=True).state_dict() for layout in ("jetflow", "eagle3")
    )
    assert set(jetflow) - set(eagle3) == {"in_proj.weight", "layer.input_norm.weight", "fusion.norm.weight"}
    assert set(eagle3) - set(jetflow) == {"layer.hidden_norm.weight"}  # fc alone; hidden_norm per state
    assert eagle3["layer.attn.q_proj.weight"].shape == (64, 128)  # q/k/v read [embed ; state] directly
    assert eagle3["layer.attn.v_proj.weight"].shape == (32, 128)
    assert jetflow["layer.attn.q_proj.weight"].shape == (64, 64)
    # an eagle3 head's layer is the target family's, as vLLM's Eagle3 classes are
    assert not EagleHeadConfig.for_target(tiny_llama, layout="eagle3").qk_norm
    assert EagleHeadConfig.for_target(make_tiny_target("qwen3"), layout="eagle3").qk_norm
    assert EagleHeadConfig.for_target(tiny_llama, layout="eagle3", qk_norm=True).qk_norm
    assert EagleHeadConfig.for_target(tiny_llama).qk_norm  # the jetflow layout keeps its default


def test_a_record_that_predates_layout_loads_unchanged_in_the_jetflow_layout(tiny_llama) -> None:
    """Heads trained before ``layout`` existed record none; their tensors are the jetflow layout's."""
    head = EagleDrafter.new_head(tiny_llama, {"draft_vocab_size": 40})
    architecture = head.config.model_dump(mode="json")
    assert architecture.pop("layout") == "jetflow"
    rebuilt = EagleDrafter.head_from_architecture(architecture)
    assert rebuilt.config.layout == "jetflow"
    rebuilt.load_state_dict(head.state_dict(), strict=True)


def test_the_shipped_head_loads_strictly() -> None:
    folder = EagleDrafter.package_dir() / "checkpoints" / "SmolLM2-135M-Instruct"
    info, state = read_checkpoint(folder)
    EagleDrafter.head_from_architecture(info.architecture).load_state_dict(state, strict=True)


def test_anchor_zero_has_nothing_to_condition_on_and_is_not_supervised(tiny_llama, records, layout) -> None:
    head = tiny_eagle(tiny_llama, layout=layout)
    batch = collate(records[:1], [torch.tensor([0, 7])], torch.float32)
    preds = head.training_predictions(batch, FrozenTargetParts.from_target(tiny_llama))
    assert set((preds.positions - preds.depths).tolist()) == {7}


@torch.no_grad()
def test_decoding_a_path_equals_the_training_forward(tiny_llama, records, layout) -> None:
    """Every unrolled training step equals the session's forward for that tree node, branches beside it."""
    head = tiny_eagle(tiny_llama, layout=layout).eval()
    shared = FrozenTargetParts.from_target(tiny_llama)
    lm = DraftLMHead.build(shared.lm_head, None)
    anchors = [torch.tensor([1, 5, 11, 17, 21]), torch.tensor([3, 9, 14])]
    batch = collate(records, anchors, torch.float32)
    hidden = head(batch.features, shared.embed(batch.tokens), batch.anchors)  # [b, N, D, H]
    expected = torch.log_softmax(lm.logits(hidden), dim=-1)
    for row, picked in enumerate(anchors):
        tokens, _, features, _ = records[row]
        for n, anchor in enumerate(picked.tolist()):
            session = session_of(head, tiny_llama, features[:anchor].float(), tokens[: anchor + 1])
            # Each level holds the true next token and a wrong sibling before it; both are
            # evaluated, and the wrong branch must stay invisible to the true one's children.
            tree, level = DraftTree.root(int(tokens[anchor])), torch.tensor([0])
            for depth in range(DEPTHS):
                got = full_logprobs(session, tree, level, 256)[-1]
                torch.testing.assert_close(got, expected[row, n, depth], atol=2e-5, rtol=1e-4)
                true = int(tokens[anchor + depth + 1])
                parent = level[-1:].repeat(2)
                tree = tree.extend(parent, torch.tensor([(true + 1) % 256, true]), torch.zeros(2))
                level = torch.arange(tree.size - 2, tree.size)
            assert session.forwards == DEPTHS  # the root's query, then one per deeper level


@torch.no_grad()
def test_session_keeps_the_root_query_and_evaluates_each_level_once(tiny_llama, records, layout) -> None:
    head = tiny_eagle(tiny_llama, layout=layout).eval()
    tokens, _, features, _ = records[0]
    session = session_of(head, tiny_llama, features[:9].float(), tokens[:10])
    assert session.forwards == 1
    tree = DraftTree.root(int(tokens[9]))
    first = full_logprobs(session, tree, torch.tensor([0]), 256)
    tree = tree.extend(torch.zeros(3, dtype=torch.long), torch.tensor([4, 5, 6]), torch.zeros(3))
    level = full_logprobs(session, tree, torch.tensor([1, 2, 3]), 256)
    assert session.forwards == 2
    again = full_logprobs(session, tree, torch.tensor([3, 0, 1]), 256)  # nothing new: no forward
    assert session.forwards == 2
    torch.testing.assert_close(again, torch.cat([level[2:], first, level[:1]]))
    assert not torch.allclose(level[0], level[1])  # each branch conditioned on its own token
    probs = session.distributions(tree, torch.tensor([0, 2]))
    torch.testing.assert_close(probs.log(), torch.stack([first[0], level[1]]))
    moved = DraftTree.root(int(tokens[9])).extend(
        torch.zeros(1, dtype=torch.long), torch.tensor([9]), torch.zeros(1)
    )
    with pytest.raises(RuntimeError, match="only grows"):
        session.children(moved, torch.tensor([1]), 2)


@torch.no_grad()
def test_kv_cache_across_steps_equals_recomputation(tiny_llama, records, layout) -> None:
    head = tiny_eagle(tiny_llama, layout=layout).eval()
    shared = FrozenTargetParts.from_target(tiny_llama)
    tokens, _, features, _ = records[0]
    embeds = shared.embed(tokens[1:])
    cache = head.empty_cache()
    for start, stop in [(0, 5), (5, 6), (6, 6), (6, 13)]:
        cache = head.extend(cache, features[start:stop].float(), embeds[start:stop])
    scratch = head.extend(head.empty_cache(), features[:13].float(), embeds[:13])
    assert cache.length == scratch.length == 13
    for grown, fresh in zip(cache.kv, scratch.kv, strict=True):
        torch.testing.assert_close(grown, fresh, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(head.root_hidden(cache), head.root_hidden(scratch), atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------- training


def test_the_shared_trainer_lowers_the_loss_and_raises_agreement(tiny_llama, trained) -> None:
    _, before, result = trained
    after = result.evaluation
    assert after["eval_loss"] < 0.7 * before["eval_loss"]
    assert len(after["agreement"]) == DEPTHS
    assert after["agreement"][0] > before["agreement"][0] + 0.1
    assert after["chain_accept"] > before["chain_accept"]
    info, state = load_checkpoint(result.final_checkpoint, tiny_llama, drafter="eagle")
    assert info.drafter == "eagle" and info.state["step"] == 40
    assert info.recipe["loss"]["kind"] == "forward-kl" and info.target["feature_layers"] == list(LAYERS)
    assert all(t.dtype == torch.float16 for t in state.values() if t.is_floating_point())


# ---------------------------------------------------------------------- drafter


def _drafter(target, folder, **params) -> EagleDrafter:
    return EagleDrafter(EagleParams(checkpoint=str(folder), **params), target)


def test_drafter_cache_across_steps_equals_a_fresh_one(tiny_llama, trained) -> None:
    folder = trained[2].final_checkpoint
    tokens = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    _, features = tiny_llama.prefill(tokens[:-1], LAYERS)
    stepped = _drafter(tiny_llama, folder)
    assert stepped.feature_layers == LAYERS and stepped.default_tree_policy == "eagle-dynamic"
    stepped.reset()
    stepped.begin(DraftContext(tokens[:5], features[:4], 4))
    session = stepped.begin(DraftContext(tokens, features[4:], 9))
    fresh = _drafter(tiny_llama, folder)
    fresh.reset()
    reference = fresh.begin(DraftContext(tokens, features, 9))
    tree = DraftTree.root(14)
    grown, expected = (
        session.children(tree, torch.tensor([0]), 5),
        reference.children(tree, torch.tensor([0]), 5),
    )
    assert torch.equal(grown[0], expected[0])
    torch.testing.assert_close(grown[1], expected[1], atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="out of step"):
        stepped.begin(DraftContext(tokens, None, 8))


def test_a_one_token_prompt_drafts_nothing_on_its_first_step(tiny_llama, trained) -> None:
    drafter = _drafter(tiny_llama, trained[2].final_checkpoint)
    drafter.reset()
    session = drafter.begin(DraftContext(torch.tensor([5]), None, 0))
    _, logprobs = session.children(DraftTree.root(5), torch.tensor([0]), 3)
    assert torch.isinf(logprobs).all() and session.forwards == 0 and session.max_depth == 0


def test_checkpoints_for_another_target_or_drafter_are_refused(tiny_llama, trained, tmp_path) -> None:
    folder = trained[2].final_checkpoint
    with pytest.raises(
        CheckpointMismatchError, match=r"does not fit target 'tiny-qwen3' \(it was trained for 'tiny-llama'\)"
    ):
        _drafter(make_tiny_target("qwen3"), folder)
    jetflow = save_head(tmp_path / "jetflow", tiny_llama, tiny_head(tiny_llama))
    with pytest.raises(CheckpointMismatchError, match="'jetflow' head, not a 'eagle' head"):
        _drafter(tiny_llama, jetflow)
    with pytest.raises(JetflowError, match="no eagle head is shipped for target 'tiny-llama'"):
        EagleDrafter(EagleParams(), tiny_llama)


def _reference(target, prompt: list[int], new: int) -> list[int]:
    with torch.inference_mode():
        out = target.model.generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


def _engine(target, **fields) -> Engine:
    return Engine(build_config(GenerateConfig, fields), target)


def test_engine_with_eagle_is_lossless_and_counts_one_forward_per_depth(tiny_llama, trained) -> None:
    trainer, _, result = trained
    folder = str(result.final_checkpoint)
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 256, (n,), generator=generator).tolist() for n in (1, 5, 9)]
    prompts.append(trainer.store.sequence(int(trainer.train_ids[0]))[0][:8].tolist())  # a seen one
    expected = [_reference(tiny_llama, prompt, 24) for prompt in prompts]
    accepted = 0
    runs = [
        ("eagle-dynamic", 1, {"top_k": 2}),
        ("eagle-dynamic", 12, {}),
        ("eagle-dynamic", 24, {"top_k": 3}),
    ]
    for policy, budget, params in runs:
        engine = _engine(
            tiny_llama,
            drafter="eagle",
            drafter_params={"checkpoint": folder, "max_depth": 5},
            tree={"policy": policy, "budget": budget, "width": 3, "params": params},
            max_new_tokens=24,
            stop_at_eos=False,
        )
        assert engine.policy.name == "eagle-dynamic"
        for prompt, want in zip(prompts, expected, strict=True):
            out = engine.generate(prompt)
            assert out.token_ids == want, (policy, budget, prompt)
            accepted += sum(step.accepted for step in out.steps)
            assert all(1 <= step.draft_forwards <= 5 for step in out.steps[1:])
    assert accepted > 0

    # A chain of 4: the root's query and one forward per deeper level, every step.
    chain = _engine(
        tiny_llama,
        drafter="eagle",
        drafter_params={"checkpoint": folder},
        tree={"policy": "chain", "budget": 4, "max_depth": 4},
        max_new_tokens=24,
        stop_at_eos=False,
    )
    out = chain.generate(prompts[2])
    assert out.token_ids == expected[2]
    assert [step.draft_forwards for step in out.steps] == [4] * len(out.steps)
    assert out.stats()["draft_forwards_per_step"] == 4.0
    assert _engine(tiny_llama, drafter="eagle", drafter_params={"checkpoint": folder}).policy.name == (
        "eagle-dynamic"
    )


@torch.no_grad()
def test_eagle_dynamic_on_the_head_runs_one_forward_per_level(tiny_llama, trained, records) -> None:
    head = EagleDrafter(EagleParams(checkpoint=str(trained[2].final_checkpoint)), tiny_llama).head.float()
    tokens, _, features, _ = records[0]
    session = session_of(head, tiny_llama, features[:12].float(), tokens[:13])
    shape = TreeShape(budget=60, width=3, max_depth=5)
    tree = EagleDynamic(EagleDynamic.Params(top_k=3)).build(session, DraftTree.root(int(tokens[12])), shape)
    assert tree.max_depth == 5 and session.forwards == 5
    assert tree.draft_size == 3 + 4 * 3  # 3 children of the root, then the top 3 of each level
