"""Linear weights packed once for oneDNN: the same bits as the plain forward, stepping aside
where the plain forward is needed (autograd, compiling, the peers measured as users run them)."""

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


def test_only_cpu_bfloat16_is_packed_and_the_switch_turns_it_off(monkeypatch) -> None:
    assert make_tiny_target("llama").linear_weights == "plain"  # fp32 keeps MKL's exact path
    assert "float32" in packing_unavailable(nn.Linear(2, 2))
    monkeypatch.setenv(packed_weights.ENV_SWITCH, "0")
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


@needs_packing
@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_the_engine_on_packed_weights_decodes_what_transformers_does(drafter: str) -> None:
    target = tiny_bf16()
    with torch.inference_mode(), unpacked(target.model):
        out = target.model.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False)
    fields = {"drafter": drafter, "max_new_tokens": 20}
    if drafter != "none":
        fields["tree"] = {"policy": "chain", "budget": 4}
    result = Engine(build_config(GenerateConfig, fields), target).generate(PROMPT)
    assert result.token_ids == out[0, len(PROMPT) :].tolist()
    assert result.stats()["linear_weights"] == "packed"


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
