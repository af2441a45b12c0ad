"""The learned heads' sessions keep every tensor on the target's device.

As in ``tests/core/test_device_placement.py``: under ``torch.device("meta")`` as the default
device, a tensor a session makes without naming a device holds no data and the run fails or
diverges; a session that makes everything on the target's device decodes exactly as before.
A session that moves its proposals to the host (``.cpu()``) passes that check on a CPU but
breaks on a GPU, so those calls are counted too. The heads are untrained (their drafts are
mostly rejected), which is all placement needs.
"""

from __future__ import annotations

import pytest
import torch
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.engine import Engine
from jetflow.core.target import Target
from jetflow.drafters.eagle.head import EagleHead, EagleHeadConfig
from torch.overrides import TorchFunctionMode

from .tiny_heads import LAYERS, jetflow_registered, save_head, tiny_head

PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 11]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with jetflow_registered():
        yield


@pytest.fixture(scope="module")
def checkpoints(tiny_llama: Target, tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("heads")
    torch.manual_seed(0)
    eagle = EagleHead(EagleHeadConfig.for_target(tiny_llama, feature_layers=LAYERS, ttt_steps=4))
    heads = {
        "jetflow": ("jetflow", tiny_head(tiny_llama)),
        "jetflow-path": ("jetflow", tiny_head(tiny_llama, path_conditioning=1.0)),
        "jetflow-vocab": ("jetflow", tiny_head(tiny_llama, draft_vocab_size=48)),
        "dflash": ("dflash", tiny_head(tiny_llama, causal=False)),
        "eagle": ("eagle", eagle),
    }
    return {
        case: str(save_head(folder / case, tiny_llama, head, drafter=drafter))
        for case, (drafter, head) in heads.items()
    }


class HostCopies(TorchFunctionMode):
    """Counts ``Tensor.cpu`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") == "cpu"
        return func(*args, **(kwargs or {}))


CASES = [
    ("jetflow", "best-first", "greedy"),
    ("jetflow-path", "best-first", "greedy"),
    ("jetflow+ngram", "best-first", "greedy"),
    ("jetflow-vocab", "chain", "greedy"),
    ("jetflow", "sampled", "sampling"),
    ("dflash", "chain", "greedy"),
    ("eagle", "eagle-dynamic", "greedy"),
    ("eagle", "sampled", "sampling"),
]


@pytest.mark.parametrize(("case", "policy", "verifier"), CASES)
def test_no_head_tensor_is_made_off_the_target_device(
    tiny_llama: Target, checkpoints: dict[str, str], case: str, policy: str, verifier: str
) -> None:
    drafter = case.split("-")[0]
    params = {"checkpoint": checkpoints[case.split("+")[0]]}
    if case == "jetflow-path":
        params["refresh"] = True
    fields = {
        "drafter": drafter,
        "drafter_params": {"jetflow": params} if "+" in case else params,
        "tree": {"policy": policy, "budget": 6, "width": 3},
        "verifier": verifier,
        "max_new_tokens": 12,
        "stop_at_eos": False,
    }
    engine = Engine(build_config(GenerateConfig, fields), tiny_llama)
    expected = engine.generate(PROMPT)
    with torch.device("meta"), HostCopies() as copies:
        result = engine.generate(PROMPT)
    assert result.token_ids == expected.token_ids
    assert copies.count == 0
    assert max(step.tree_size for step in result.steps) > 1


def test_a_head_on_a_bf16_target_is_packed_like_the_target(tiny_llama: Target, checkpoints) -> None:
    from jetflow.core.packed_weights import is_packed, packing_unavailable, unpacked
    from jetflow.drafters.jetflow.plugin import BlockHeadParams, JetFlowDrafter
    from torch import nn

    from ..conftest import make_tiny_target

    target = make_tiny_target("llama")  # the weights of tiny_llama, which the checkpoints are for
    target = Target(target.model.to(torch.bfloat16), target.tokenizer, target.name)
    if packing_unavailable(target.model) is not None:
        pytest.skip(f"no packing here: {packing_unavailable(target.model)}")
    drafter = JetFlowDrafter(BlockHeadParams(checkpoint=checkpoints["jetflow"]), target)
    linears = [m for m in drafter.head.modules() if type(m) is nn.Linear]
    assert linears and all(is_packed(m) for m in linears) and drafter.lm.packed is not None
    hidden = torch.randn(3, target.config.hidden_size, dtype=torch.bfloat16)
    square = [m for m in linears if m.in_features == hidden.shape[1]]
    with unpacked(drafter.head):
        plain = [m(hidden) for m in square]
    assert square and all(torch.equal(m(hidden), p) for m, p in zip(square, plain, strict=True))
