"""The block head: one code path for training and inference, visibility, causal vs bidirectional."""

from __future__ import annotations

import pytest
import torch
from jetflow.drafters.block_head import BlockHead
from jetflow.drafters.blocks import FrozenTargetParts
from jetflow.drafters.head_sizes import default_feature_layers
from jetflow.drafters.training.examples import capture_sequences, collate

from .tiny_heads import LAYERS, tiny_head


@pytest.fixture(scope="module")
def records(tiny_llama):
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(2, 256, (length,), generator=generator) for length in (26, 19)]
    return capture_sequences(tiny_llama.model, sequences, [6, 4], LAYERS).records


def test_default_feature_layers_spread_from_1_to_l_minus_3() -> None:
    assert default_feature_layers(30) == (1, 8, 14, 20, 27)
    assert default_feature_layers(36) == (1, 9, 17, 25, 33)
    assert default_feature_layers(4) == (1,)


def _inference(head: BlockHead, shared: FrozenTargetParts, record, anchor: int) -> torch.Tensor:
    """The decode-time path: context grown in two steps, then one block forward from the root."""
    tokens, _, features, _ = record
    cache = head.extend(head.empty_cache(), features[: anchor // 2].float())
    cache = head.extend(cache, features[anchor // 2 : anchor].float())
    assert cache.length == anchor
    return head.draft(cache, shared.embed(tokens[anchor]))


@pytest.mark.parametrize(("causal", "anchored"), [(True, False), (False, False), (True, True), (False, True)])
@torch.no_grad()
def test_training_forward_equals_inference_for_every_anchor(
    tiny_llama, records, causal: bool, anchored: bool
) -> None:
    head = tiny_head(tiny_llama, causal=causal, num_layers=2, anchored_slots=anchored).eval()
    shared = FrozenTargetParts.from_target(tiny_llama)
    anchors = [torch.tensor([0, 5, 11, 17, 23]), torch.tensor([3, 9, 16])]
    batch = collate(records, anchors, torch.float32)
    hidden = head(batch.features, shared.embed(batch.tokens.gather(1, batch.anchors)), batch.anchors)
    assert hidden.shape == (2, 5, head.max_depth, 64)
    for row, picked in enumerate(anchors):
        for n, anchor in enumerate(picked.tolist()):
            expected = _inference(head, shared, records[row], anchor)
            torch.testing.assert_close(hidden[row, n], expected, atol=2e-5, rtol=1e-4)
            logits = shared.logits(hidden[row, n])
            torch.testing.assert_close(logits, shared.logits(expected), atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_a_block_sees_only_earlier_features_and_its_own_slots(tiny_llama, records) -> None:
    head = tiny_head(tiny_llama, num_layers=2).eval()
    shared = FrozenTargetParts.from_target(tiny_llama)
    batch = collate(records[:1], [torch.tensor([8, 12])], torch.float32)

    def run(features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return head(features, shared.embed(tokens.gather(1, batch.anchors)), batch.anchors)[0]

    base = run(batch.features, batch.tokens)
    later = batch.features.clone()
    later[:, 8:] += 1.0  # the anchor's own and later features: invisible to the block at 8
    assert torch.equal(run(later, batch.tokens)[0], base[0])
    assert not torch.allclose(run(later, batch.tokens)[1], base[1])
    earlier = batch.features.clone()
    earlier[:, 7] += 1.0
    assert not torch.allclose(run(earlier, batch.tokens)[0], base[0])
    other_anchor = batch.tokens.clone()
    other_anchor[0, 12] = (other_anchor[0, 12] + 1) % 256  # the second block's root
    assert torch.equal(run(batch.features, other_anchor)[0], base[0])


@torch.no_grad()
def test_causal_and_bidirectional_differ_only_in_the_in_block_mask(tiny_llama, records) -> None:
    causal = tiny_head(tiny_llama, causal=True).eval()
    bidirectional = tiny_head(tiny_llama, causal=False).eval()
    bidirectional.load_state_dict(causal.state_dict())  # same parameters, same names and shapes
    anchors = torch.tensor([[4, 10]])
    mask_c, mask_b = causal.block_mask(anchors, 26), bidirectional.block_mask(anchors, 26)
    size = causal.config.block_size
    assert torch.equal(mask_c[..., :26], mask_b[..., :26])  # same context visibility
    in_block = torch.ones(size, size, dtype=torch.bool)
    assert torch.equal(mask_c[0, :size, 26 : 26 + size], in_block.tril())
    assert torch.equal(mask_b[0, :size, 26 : 26 + size], in_block)
    assert not (mask_b[0, :size, 26 + size :]).any()  # never across blocks

    # Running the bidirectional head with the causal mask reproduces the causal head exactly.
    batch = collate(records[:1], [anchors[0]], torch.float32)
    shared = FrozenTargetParts.from_target(tiny_llama)
    x, offsets = bidirectional.block_inputs(shared.embed(batch.tokens.gather(1, batch.anchors)))
    positions = batch.anchors.repeat_interleave(size, dim=1) + offsets
    context = bidirectional.context_kv(batch.features)
    swapped = bidirectional.block_hidden(x, positions, context, causal.block_mask(batch.anchors, 26))
    expected = causal(batch.features, shared.embed(batch.tokens.gather(1, batch.anchors)), batch.anchors)
    torch.testing.assert_close(swapped.view(1, 2, size, -1)[:, :, 1:], expected)
    own = bidirectional(batch.features, shared.embed(batch.tokens.gather(1, batch.anchors)), batch.anchors)
    assert not torch.allclose(own, expected)


def test_head_owns_no_target_weights(tiny_llama) -> None:
    head = tiny_head(tiny_llama)
    vocab = tiny_llama.vocab_size
    assert all(vocab not in tensor.shape for tensor in head.state_dict().values())
    assert not any("embed_tokens" in name or "lm_head" in name for name in head.state_dict())
