"""The hot loop keeps its tensors on the target's device and reads the host once per step, not per node.

No GPU is needed to check either. With ``torch.device("meta")`` as the default device, any
tensor the loop creates without naming a device lands on the meta device, holds no data, and
the run fails or diverges; a loop that names the target's device for everything runs exactly
as before. Host reads (``bool``, ``int``, ``item``, ``tolist``, ``cpu``, ...) are counted with a
torch function mode: their number per step must not grow with the number of drafted nodes.
"""

from __future__ import annotations

import pytest
import torch
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.contracts import DraftContext, Drafter
from jetflow.core.engine import Engine
from jetflow.core.hookspecs import hookimpl
from jetflow.core.registry import default_registry
from jetflow.core.target import Target
from jetflow.core.tree import DraftTree
from torch import Tensor
from torch.overrides import TorchFunctionMode

HOST_READS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "numpy"}
PROMPT = [5, 6, 7, 8, 5, 6, 7]


class FormulaSession:
    """Proposals that are a pure tensor function of the node's token (device-clean, no host reads)."""

    max_depth = None

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def children(self, tree: DraftTree, nodes: Tensor, k: int) -> tuple[Tensor, Tensor]:
        offsets = torch.arange(k, device=tree.device)
        tokens = (tree.tokens[nodes, None] * 7 + 3 + offsets) % (self.vocab - 2) + 2
        logprobs = -(offsets + 1.0).expand(nodes.shape[0], k) / 2
        return tokens, logprobs

    def distributions(self, tree: DraftTree, nodes: Tensor) -> Tensor:
        tokens, logprobs = self.children(tree, nodes, 4)
        probs = torch.zeros(nodes.shape[0], self.vocab, device=tree.device)
        return probs.scatter(1, tokens, logprobs.exp()) / logprobs.exp().sum(dim=1, keepdim=True)


class FormulaDrafter(Drafter):
    name = "test-formula"
    description = "test drafter: proposals as a tensor formula of the parent token"

    def begin(self, context: DraftContext) -> FormulaSession:
        return FormulaSession(self.target.vocab_size)


@hookimpl
def jetflow_drafters() -> list[type]:
    return [FormulaDrafter]


@pytest.fixture(scope="module", autouse=True)
def _formula_registered():
    import sys

    module = sys.modules[__name__]
    default_registry().register(module)
    yield
    default_registry().unregister(module)


class HostReads(TorchFunctionMode):
    """Counts the calls that copy a tensor's value to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _engine(target: Target, **fields) -> Engine:
    fields = {"drafter": "test-formula", "max_new_tokens": 16, "stop_at_eos": False} | fields
    return Engine(build_config(GenerateConfig, fields), target)


CASES = [
    ("none", None, "greedy", {}),
    ("test-formula", "best-first", "greedy", {}),
    ("test-formula", "chain", "greedy", {}),
    ("test-formula", "eagle-dynamic", "greedy", {}),
    ("ngram", "best-first", "greedy", {}),
    ("test-formula", "best-first", "sampling", {"temperature": 0.8, "top_p": 0.9}),
    ("test-formula", "sampled", "sampling", {"temperature": 1.0}),
]


@pytest.mark.parametrize(("drafter", "policy", "verifier", "params"), CASES)
def test_no_hot_path_tensor_is_made_off_the_target_device(
    tiny_llama: Target, drafter: str, policy: str | None, verifier: str, params: dict
) -> None:
    engine = _engine(
        tiny_llama,
        drafter=drafter,
        tree={"budget": 6, "width": 3, **({"policy": policy} if policy else {})},
        verifier=verifier,
        verifier_params=params,
    )
    expected = engine.generate(PROMPT)
    with torch.device("meta"):  # the default device for every tensor created without one
        result = engine.generate(PROMPT)
    assert result.token_ids == expected.token_ids
    assert sum(step.tree_size for step in result.steps) > len(result.steps) or drafter == "none"


def test_an_adaptive_budget_makes_nothing_off_the_device(tiny_llama: Target, monkeypatch, tmp_path) -> None:
    """The adaptive budget's observation of each step (ranks of the accepted path) included."""
    from jetflow.core import calibration as cal

    from tests.core.test_adaptive import calibration_record

    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path))
    config = build_config(
        GenerateConfig, {"drafter": "test-formula", "max_new_tokens": 16, "stop_at_eos": False}
    )
    key = cal.key_for(config, tiny_llama)
    record = calibration_record(key, {0: 1.0, 2: 1.6, 6: 2.0}, {0: 10.0, 2: 11.0, 6: 12.0})
    engine = Engine(config, tiny_llama, calibration=record)
    assert engine.adaptive is not None
    expected = engine.generate(PROMPT)
    engine = Engine(config, tiny_llama, calibration=record)  # the controller starts afresh
    with torch.device("meta"):
        result = engine.generate(PROMPT)
    assert result.token_ids == expected.token_ids and max(step.budget for step in result.steps) > 0


def test_the_meta_check_catches_a_tensor_made_without_a_device(tiny_llama: Target) -> None:
    """The check above can fail: a session that makes its offsets on the default device trips it."""

    class Careless(FormulaSession):
        def children(self, tree: DraftTree, nodes: Tensor, k: int) -> tuple[Tensor, Tensor]:
            tokens, logprobs = super().children(tree, nodes, k)
            return tokens + torch.zeros(1, dtype=torch.long), logprobs

    engine = _engine(tiny_llama, tree={"budget": 4})
    engine.drafter.begin = lambda context: Careless(tiny_llama.vocab_size)
    with torch.device("meta"), pytest.raises((RuntimeError, NotImplementedError, IndexError)):
        engine.generate(PROMPT)


@pytest.mark.parametrize(("policy", "verifier"), [("best-first", "greedy"), ("sampled", "sampling")])
def test_host_reads_per_step_do_not_grow_with_the_tree(
    tiny_llama: Target, policy: str, verifier: str
) -> None:
    """At a fixed depth and width, four times the nodes cost no more host reads per step."""
    per_step = {}
    width = 4
    for budget in (3, 12):
        engine = _engine(
            tiny_llama,
            tree={"policy": policy, "budget": budget, "width": width, "max_depth": 3},
            verifier=verifier,
        )
        engine.generate(PROMPT, max_new_tokens=2)  # warm-up
        with HostReads() as reads:
            result = engine.generate(PROMPT)
        sizes = [step.tree_size for step in result.steps]
        assert max(sizes) == budget + 1
        per_step[budget] = reads.count / len(result.steps)
    assert per_step[12] <= per_step[3] * 1.25 + 2, per_step
