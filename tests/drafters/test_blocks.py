"""Shared head building blocks: fusion, rotary, attention with injected context keys/values."""

from __future__ import annotations

import torch
from jetflow.drafters.blocks import (
    AttentionShape,
    ContextAttention,
    FeatureFusion,
    FrozenTargetParts,
    Rotary,
    apply_rotary,
)

SHAPE = AttentionShape(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)


def test_fusion_projects_k_layers_to_one_normed_vector() -> None:
    fusion = FeatureFusion(n_layers=3, hidden_size=32)
    out = fusion(torch.randn(2, 7, 3, 32))
    assert out.shape == (2, 7, 32)
    assert fusion.proj.bias is None
    assert torch.allclose(out.pow(2).mean(-1), torch.ones(2, 7), atol=1e-3)  # RMS-normed, unit gain


def test_rotary_scores_depend_only_on_relative_position() -> None:
    rotary = Rotary(head_dim=8, theta=10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(i: int, j: int) -> torch.Tensor:
        qi = apply_rotary(q, rotary(torch.tensor([[i]])))
        kj = apply_rotary(k, rotary(torch.tensor([[j]])))
        return (qi * kj).sum()

    assert torch.allclose(score(5, 2), score(105, 102), atol=1e-4)
    assert not torch.allclose(score(5, 2), score(5, 4), atol=1e-4)


def test_injected_context_equals_attending_over_the_concatenation() -> None:
    """Context K/V made by the layer's own projections act exactly like earlier tokens."""
    torch.manual_seed(0)
    attention = ContextAttention(SHAPE)
    rotary = Rotary(SHAPE.head_dim, 10000.0)
    ctx, block = torch.randn(1, 5, 32), torch.randn(1, 3, 32)
    positions = torch.arange(8)[None]
    context_kv = attention.project_kv(ctx, rotary(positions[:, :5]))
    mask = torch.cat([torch.ones(3, 5, dtype=torch.bool), torch.ones(3, 3, dtype=torch.bool).tril()], dim=1)
    injected = attention(block, rotary(positions[:, 5:]), context_kv, mask[None])

    empty = attention.project_kv(torch.zeros(1, 0, 32), rotary(positions[:, :0]))
    full_mask = torch.ones(8, 8, dtype=torch.bool).tril()[None]
    whole = attention(torch.cat([ctx, block], dim=1), rotary(positions), empty, full_mask)
    assert torch.allclose(injected, whole[:, 5:], atol=1e-5)


def test_frozen_target_parts_are_the_target_modules(tiny_llama) -> None:
    shared = FrozenTargetParts.from_target(tiny_llama)
    ids = torch.tensor([3, 4])
    assert torch.equal(shared.embed(ids), tiny_llama.model.get_input_embeddings()(ids))
    assert shared.logits(torch.randn(2, 64)).shape == (2, tiny_llama.vocab_size)
    assert not any(p.requires_grad for p in shared.lm_head.parameters())


def test_draft_lm_head_is_the_target_head_restricted_to_its_tokens(tiny_llama) -> None:
    from jetflow.drafters.blocks import DraftLMHead

    lm_head = tiny_llama.model.get_output_embeddings()
    hidden = torch.randn(3, 64)
    full = DraftLMHead.build(lm_head)
    torch.testing.assert_close(full.logits(hidden), lm_head(hidden))
    tokens = torch.tensor([2, 7, 40, 200])
    sub = DraftLMHead.build(lm_head, tokens)
    torch.testing.assert_close(sub.logits(hidden), lm_head(hidden)[:, tokens])
    assert sub.token_ids(torch.tensor([[0, 3]])).tolist() == [[2, 200]]
    assert sub.columns(torch.tensor([40, 41]), vocab_size=256).tolist() == [2, -1]


def test_a_bf16_draft_lm_head_is_packed_and_gives_the_plain_products_bits() -> None:
    import pytest
    from jetflow.core.packed_weights import packing_unavailable
    from jetflow.drafters.blocks import DraftLMHead

    torch.manual_seed(0)
    lm_head = torch.nn.Linear(64, 256, bias=False).to(torch.bfloat16).requires_grad_(False)
    if packing_unavailable(lm_head) is not None:
        pytest.skip(f"no packing here: {packing_unavailable(lm_head)}")
    hidden = torch.randn(5, 64, dtype=torch.bfloat16)
    tokens = torch.tensor([2, 7, 40, 200])
    for head in (DraftLMHead.build(lm_head), DraftLMHead.build(lm_head, tokens)):
        assert head.packed is not None
        assert torch.equal(head.logits(hidden), hidden @ head.weight_t)
    assert DraftLMHead.build(lm_head.float()).packed is None  # fp32 keeps the transposed product
