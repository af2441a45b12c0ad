"""Linear weights laid out once for the CPU's kernels: in bf16 the same bits as the plain forward,
in fp32 the same values to rounding; stepping aside where the plain forward is needed (autograd,
compiling, the peers measured as users run them)."""

from __future__ import annotations

import pytest
import torch
from jetflow.core import packed_weights
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.engine import Engine
from jetflow.core.packed_weights import is_packed, pack_linear_weights, packing_unavailable, unpacked
from jetflow.core.target import Target
from jetflow.core.tree import DraftTree
from torch import nn

from ..conftest import TINY_ARCHITECTURES, make_tiny_target, tiny_tokenizer

PROMPT = [7, 8, 9, 10, 11, 7, 8, 9, 12, 7]


def tiny_bf16(architecture: str = "llama") -> Target:
    reference = make_tiny_target(architecture, seed=5)
    model = reference.model.to(torch.bfloat16)
    return Target(model, tiny_tokenizer(), f"tiny-{architecture}-bf16")


needs_packing = pytest.mark.skipif(
    packing_unavailable(nn.Linear(2, 2, dtype=torch.bfloat16)) is not None,
    reason=f"no packing here: {packing_unavailable(nn.Linear(2, 2, dtype=torch.bfloat16))}",
)


needs_fp32_packing = pytest.mark.skipif(
    packing_unavailable(nn.Linear(2, 2)) is not None,
    reason=f"no packing here: {packing_unavailable(nn.Linear(2, 2))}",
)


def big_fp32_linear(bias: bool) -> nn.Linear:
    """A float32 layer at the packing threshold (1 MiB of weights), with a fixed seed."""
    torch.manual_seed(3)
    return nn.Linear(512, packed_weights.MIN_FLOAT32_BYTES // (4 * 512), bias=bias).requires_grad_(False)


def test_what_is_packed_and_the_switch_turns_it_off(monkeypatch) -> None:
    assert make_tiny_target("llama").linear_weights == "plain"  # its fp32 weights sit in the cache
    assert "float16" in packing_unavailable(nn.Linear(2, 2, dtype=torch.float16))
    small = nn.Linear(512, packed_weights.MIN_FLOAT32_BYTES // (4 * 512) - 1)
    assert pack_linear_weights(small) == 0 and not is_packed(small)
    if packing_unavailable(nn.Linear(2, 2)) is None:
        assert pack_linear_weights(big_fp32_linear(bias=False)) == 1
    monkeypatch.setenv(packed_weights.ENV_SWITCH, "0")
    assert pack_linear_weights(big_fp32_linear(bias=False)) == 0
    assert tiny_bf16().linear_weights == "plain"
    assert packing_unavailable(nn.Linear(2, 2, dtype=torch.bfloat16)) == "JETFLOW_PACKED_WEIGHTS=0"


@needs_packing
@pytest.mark.parametrize("architecture", sorted(TINY_ARCHITECTURES))
def test_packed_forwards_give_the_plain_forwards_bits(architecture: str) -> None:
    target = tiny_bf16(architecture)
    assert target.linear_weights == "packed"
    linears = [m for m in target.model.modules() if type(m) is nn.Linear]
    assert linears and all(is_packed(m) for m in linears)
    tree = DraftTree(
        tokens=torch.tensor([4, 8, 9, 30]), parents=torch.tensor([-1, 0, 0, 1]), scores=torch.zeros(4)
    )
    cache, _ = target.prefill(torch.tensor(PROMPT), layers=(1, 3), capacity=32)
    packed = target.verify(cache, tree, layers=(1, 3))
    with unpacked(target.model):
        assert not any(is_packed(m) for m in linears)
        cache, _ = target.prefill(torch.tensor(PROMPT), layers=(1, 3), capacity=32)
        plain = target.verify(cache, tree, layers=(1, 3))
    assert all(is_packed(m) for m in linears)  # restored
    assert torch.equal(packed.logits, plain.logits)
    assert torch.equal(packed.features, plain.features)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_the_engine_on_packed_weights_decodes_what_transformers_does(
    monkeypatch, dtype, drafter: str
) -> None:
    if (reason := packing_unavailable(nn.Linear(2, 2, dtype=dtype))) is not None:
        pytest.skip(f"no packing here: {reason}")
    monkeypatch.setattr(packed_weights, "MIN_FLOAT32_BYTES", 0)  # the tiny model's fp32 weights too
    target = Target(make_tiny_target("llama", seed=5).model.to(dtype), tiny_tokenizer(), "tiny-llama")
    assert target.linear_weights == "packed"
    with torch.inference_mode(), unpacked(target.model):
        out = target.model.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False)
    fields = {"drafter": drafter, "max_new_tokens": 20}
    if drafter != "none":
        fields["tree"] = {"policy": "chain", "budget": 4}
    result = Engine(build_config(GenerateConfig, fields), target).generate(PROMPT)
    assert result.token_ids == out[0, len(PROMPT) :].tolist()
    assert result.stats()["linear_weights"] == "packed"
    assert max(step.tree_size for step in result.steps) > 1 or drafter == "none"


@needs_packing
def test_autograd_and_compiling_take_the_plain_forward() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(16, 8, dtype=torch.bfloat16).requires_grad_(False)
    reference = nn.Linear(16, 8, dtype=torch.bfloat16).requires_grad_(False)
    reference.load_state_dict(linear.state_dict())
    assert pack_linear_weights(linear) == 1
    x = torch.randn(3, 16, dtype=torch.bfloat16, requires_grad=True)
    linear(x).float().square().sum().backward()  # the packed kernel has no backward
    grad, x.grad = x.grad.clone(), None
    reference(x).float().square().sum().backward()
    assert torch.equal(grad, x.grad)

    traced: list[str] = []

    def recording_backend(graph: torch.fx.GraphModule, _inputs):
        traced.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
        return graph.forward

    compiled = torch.compile(linear, backend=recording_backend, fullgraph=True)
    with torch.no_grad():
        y = torch.randn(3, 16, dtype=torch.bfloat16)
        assert torch.equal(compiled(y), reference(y))
    assert any("linear" in name for name in traced) and not any("mkldnn" in name for name in traced)


@needs_fp32_packing
@pytest.mark.parametrize("bias", [False, True])
def test_packed_fp32_agrees_with_the_plain_forward_for_one_row_and_many(bias: bool) -> None:
    linear = big_fp32_linear(bias)
    assert pack_linear_weights(linear) == 1
    x = torch.randn(2, 9, linear.in_features)
    for rows in (x[:1, :1], x[:1, :5], x, x[0, 0]):  # one row (3-D and 1-D), a tree, a batch
        with torch.inference_mode():
            packed = linear(rows)
            with unpacked(linear):
                plain = linear(rows)
        assert packed.shape == plain.shape
        torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    one = x[0, :1]
    transposed = linear.weight.t().contiguous()
    expected = torch.addmm(linear.bias, one, transposed) if bias else one @ transposed
    with torch.inference_mode():
        assert torch.equal(linear(one), expected)  # one row: the transposed weight's product
