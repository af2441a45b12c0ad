"""The block head's variants for the scaling table: more layers, next tokens in the context, target init."""

from __future__ import annotations

import pytest
import torch
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.engine import Engine
from jetflow.core.errors import ConfigError
from jetflow.drafters.block_head import BlockHead
from jetflow.drafters.blocks import FrozenTargetParts
from jetflow.drafters.dflash.plugin import DFlashDrafter
from jetflow.drafters.jetflow.plugin import JetFlowDrafter
from jetflow.drafters.training.examples import capture_sequences, collate

from tests.conftest import make_tiny_target
from tests.core.test_engine import _reference

from .tiny_heads import LAYERS, jetflow_registered, quick_trainer, tiny_head


@pytest.fixture(scope="module")
def records(tiny_llama):
    generator = torch.Generator().manual_seed(4)
    sequences = [torch.randint(2, 256, (length,), generator=generator) for length in (24, 18)]
    return capture_sequences(tiny_llama.model, sequences, [5, 3], LAYERS).records


def _training_forward(head: BlockHead, shared: FrozenTargetParts, records, anchors) -> torch.Tensor:
    batch = collate(records, anchors, torch.float32)
    following = torch.nn.functional.pad(batch.tokens[:, 1:], (0, 1))[:, : batch.features.shape[1]]
    anchor_embeds = shared.embed(batch.tokens.gather(1, batch.anchors))
    return head(batch.features, anchor_embeds, batch.anchors, next_embeds=shared.embed(following))


@torch.no_grad()
def test_context_tokens_train_as_they_decode(tiny_llama, records) -> None:
    """Each context entry carries the token written after it, in training and in the decode cache."""
    head = tiny_head(tiny_llama, num_layers=2, context_tokens=True).eval()
    shared = FrozenTargetParts.from_target(tiny_llama)
    anchors = [torch.tensor([4, 9, 15, 22]), torch.tensor([2, 10])]
    hidden = _training_forward(head, shared, records, anchors)
    for row, picked in enumerate(anchors):
        tokens, _, features, _ = records[row]
        for n, anchor in enumerate(picked.tolist()):
            half = anchor // 2  # the cache grows in two steps, as decoding does
            cache = head.extend(head.empty_cache(), features[:half], shared.embed(tokens[1 : half + 1]))
            cache = head.extend(cache, features[half:anchor], shared.embed(tokens[half + 1 : anchor + 1]))
            expected = head.draft(cache, shared.embed(tokens[anchor]))
            torch.testing.assert_close(hidden[row, n], expected, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="next tokens"):
        head.extend(head.empty_cache(), records[0][2][:3])


@torch.no_grad()
def test_a_context_entry_sees_the_token_after_it_and_nothing_later(tiny_llama, records) -> None:
    head = tiny_head(tiny_llama, context_tokens=True).eval()
    shared = FrozenTargetParts.from_target(tiny_llama)
    anchors = [torch.tensor([6, 9, 14])]
    before = _training_forward(head, shared, records[:1], anchors)
    tokens, prompt, features, final = records[0]
    changed = tokens.clone()
    changed[9] = (changed[9] + 1) % 256  # the token after context position 8
    after = _training_forward(head, shared, [(changed, prompt, features, final)], anchors)
    torch.testing.assert_close(after[0, 0], before[0, 0])  # anchor 6 sees entries 0..5: unchanged
    assert not torch.allclose(after[0, 2], before[0, 2])  # anchor 14 sees entry 8, which now differs


@pytest.mark.parametrize(("architecture", "qk_norm"), [("llama", False), ("qwen3", True)])
def test_init_from_target_copies_its_top_layers(architecture: str, qk_norm: bool) -> None:
    target = make_tiny_target(architecture)
    head = JetFlowDrafter.new_head(
        target, {"num_layers": 2, "init_from_target": True, "feature_layers": LAYERS}
    )
    assert head.config.qk_norm is qk_norm and head.config.init_from_target
    decoder = target.model.get_decoder()
    for mine, theirs in zip(head.layers, decoder.layers[-2:], strict=True):
        assert torch.equal(mine.attn.q_proj.weight, theirs.self_attn.q_proj.weight)
        assert torch.equal(mine.mlp.down_proj.weight, theirs.mlp.down_proj.weight)
        assert torch.equal(mine.post_norm.weight, theirs.post_attention_layernorm.weight)
    assert torch.equal(head.norm.weight, decoder.norm.weight)
    fresh = JetFlowDrafter.new_head(target, {"num_layers": 2, "feature_layers": LAYERS})
    assert not torch.equal(fresh.layers[0].attn.q_proj.weight, head.layers[0].attn.q_proj.weight)


def test_init_from_a_target_without_dense_layers_is_a_clear_error() -> None:
    target = make_tiny_target("qwen3_moe")
    with pytest.raises(ConfigError, match=r"no mlp\.gate_proj\.weight"):
        DFlashDrafter.new_head(target, {"init_from_target": True, "feature_layers": LAYERS})


def test_a_three_layer_head_with_every_option_trains_ships_and_is_lossless(tiny_llama, tmp_path) -> None:
    options = {"num_layers": 3, "context_tokens": True, "init_from_target": True}
    head = JetFlowDrafter.new_head(tiny_llama, options | {"feature_layers": LAYERS, "block_size": 6})
    trainer = quick_trainer(tiny_llama, tmp_path / "run", head=head, steps=20)
    before = trainer.evaluate()["eval_loss"]
    result = trainer.fit()
    assert result.evaluation["eval_loss"] < before
    with jetflow_registered():
        config = {
            "drafter": "jetflow",
            "drafter_params": {"checkpoint": str(result.final_checkpoint)},
            "tree": {"budget": 8, "width": 3},
            "max_new_tokens": 20,
            "stop_at_eos": False,
        }
        engine = Engine(build_config(GenerateConfig, config), tiny_llama)
        assert engine.drafter.head.config.num_layers == 3 and engine.drafter.head.token_proj is not None
        for prompt in ([5, 9, 14, 3, 22, 5, 9], [17]):
            assert engine.generate(prompt).token_ids == _reference(tiny_llama, prompt, 20, eos=False)
