"""The verify forward's attention choice, and the tree kernel inside a whole model forward.

On CPU the target keeps SDPA and says so in the generation stats. Forced onto a tiny model
(interpreted on CPU), the kernel path must give the same logits as SDPA for every tree node,
leave prefill and one-node steps to SDPA, and keep greedy speculative decoding lossless.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jetflow.attention import verify_attention
from jetflow.attention.verify_attention import (
    enable_tree_attention,
    select_verify_attention,
    unsupported_reason,
)
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.engine import Engine
from jetflow.core.target import Target
from transformers import Qwen3Config, Qwen3ForCausalLM

from tests.conftest import make_tiny_target

from .trees import NO_SHRINK, parent_lists, tree_of

PROMPT = [7, 8, 9, 10, 11] * 3 + [7]


def _on(device: torch.device, architecture: str, tree_kernel: bool) -> Target:
    """A tiny target on ``device``: with the tree kernel forced on, or with it kept off."""
    tiny = make_tiny_target(architecture)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JETFLOW_TREE_ATTENTION", "0")  # the SDPA twin keeps SDPA on a GPU too
        target = Target(tiny.model.to(device), tiny.tokenizer, tiny.name)
    if tree_kernel:
        target.attention = enable_tree_attention(target.model)
    return target


@pytest.fixture(scope="module")
def twins(device) -> dict[str, tuple[Target, Target]]:
    """Per architecture, the same tiny target twice: on SDPA and on the tree kernel."""
    return {arch: (_on(device, arch, False), _on(device, arch, True)) for arch in ("llama", "qwen3")}


def _engine(target: Target) -> Engine:
    fields = {"drafter": "ngram", "tree": {"policy": "best-first", "budget": 8}, "max_new_tokens": 24}
    return Engine(build_config(GenerateConfig, fields), target)


def test_cpu_keeps_sdpa_and_the_stats_say_so() -> None:
    target = make_tiny_target("llama")
    assert target.attention == "sdpa" and target.model.config._attn_implementation == "sdpa"
    result = _engine(target).generate(PROMPT)
    assert result.stats()["attention"] == "sdpa"
    assert max(step.tree_size for step in result.steps) > 1  # trees were verified, not just roots


def test_selection_needs_cuda() -> None:
    model = make_tiny_target("qwen3").model
    assert select_verify_attention(model) == "sdpa"
    assert model.config._attn_implementation == "sdpa"


def test_unsupported_models_are_named() -> None:
    assert unsupported_reason(make_tiny_target("llama").model) is None
    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=1,
    )  # fmt: skip
    assert "sliding-window" in unsupported_reason(Qwen3ForCausalLM(config))
    eager = make_tiny_target("llama").model
    eager.set_attn_implementation("eager")
    assert "eager" in unsupported_reason(eager)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
@settings(
    max_examples=4,
    deadline=None,
    phases=NO_SHRINK,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(prefix=st.lists(st.integers(2, 255), min_size=1, max_size=20), parents=parent_lists(max_nodes=36))
def test_tree_verify_through_the_kernel_equals_sdpa(kernels, twins, architecture, prefix, parents) -> None:
    outputs = []
    for target in twins[architecture]:
        cache, _ = target.prefill(torch.tensor(prefix))
        outputs.append(target.verify(cache, tree_of(parents)).logits)
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=0)


def test_only_tree_verifies_run_the_kernel(kernels, device, monkeypatch) -> None:
    target = _on(device, "llama", True)
    calls = []
    launch = kernels.tree_attention
    monkeypatch.setattr(kernels, "tree_attention", lambda *args, **kw: calls.append(1) or launch(*args, **kw))
    cache, _ = target.prefill(torch.tensor(PROMPT))
    target.verify(cache, tree_of([-1]))
    assert calls == []  # prefill and the one-node step stay on SDPA
    target.verify(cache, tree_of([-1, 0, 0, 1]))
    assert len(calls) == target.num_layers


def test_speculative_decoding_through_the_kernel_is_lossless(kernels, twins, device) -> None:
    reference, tree_target = twins["llama"]
    with torch.inference_mode():
        expected = reference.model.generate(
            torch.tensor([PROMPT], device=device), max_new_tokens=24, do_sample=False
        )
    result = _engine(tree_target).generate(PROMPT)
    assert result.token_ids == expected[0, len(PROMPT) :].tolist()
    assert result.stats()["attention"] == "triton-tree" and result.tau > 1.0


def test_dense_mask_path_is_unchanged(device) -> None:
    """Off the kernel path verify still hands SDPA the additive mask it always had."""
    ancestor = tree_of([-1, 0, 0]).ancestor_mask
    mask = verify_attention.verify_mask(ancestor, 2, "sdpa", torch.float32, device)
    low = torch.finfo(torch.float32).min
    expected = torch.tensor([[0, 0, 0, low, low], [0, 0, 0, 0, low], [0, 0, 0, low, 0]], device=device)
    assert mask.shape == (1, 1, 3, 5) and torch.equal(mask[0, 0], expected)
    tree = verify_attention.verify_mask(ancestor, 2, "triton-tree", torch.float32, device)
    assert tree.dtype == torch.int32 and tree.shape == (1, 1, 3, 2)
    single = verify_attention.verify_mask(ancestor[:1, :1], 2, "triton-tree", torch.float32, device)
    assert single.dtype == torch.float32  # a one-node step keeps SDPA
