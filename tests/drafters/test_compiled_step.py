"""The block head's drafting step compiled beside a compiled target (tiny Llama, no autotuning).

It must draft what the eager head drafts from the same context (to rounding), extend the context
cache as the eager head does, leave the steps it cannot take (the prompt's, one with too many new
entries, one whose package was never built where building is off) to the eager head; an engine on
it has its step ready before decoding and decodes what plain greedy decoding does.
"""

from __future__ import annotations

import pytest
import torch
from jetflow.core.compiled import CompiledForward
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.contracts import DraftContext
from jetflow.core.engine import Engine
from jetflow.core.target import Target
from jetflow.drafters import compiled_step
from jetflow.drafters.compiled_step import CompiledBlockStep
from jetflow.drafters.dflash.plugin import DFlashDrafter
from jetflow.drafters.jetflow.plugin import BlockHeadParams, JetFlowDrafter

from ..conftest import make_tiny_target
from .tiny_heads import LAYERS, jetflow_registered, save_head, tiny_head

ATOL = 1e-4
#: the ends of the context each step has processed: the prompt, then steps accepting 3, 1 and 2
CUTS = (9, 12, 13, 15)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with jetflow_registered():
        yield


@pytest.fixture(scope="module")
def compiled_llama(tmp_path_factory) -> Target:
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    target = make_tiny_target("llama", seed=5)
    target.use_compiled(CompiledForward(target.model, buckets=(1, 2, 4), autotune=False))
    yield target
    monkeypatch.undo()


def _drafter(cls, target: Target, folder, **options) -> JetFlowDrafter:
    head = tiny_head(target, causal=cls.causal, **options)
    return cls(BlockHeadParams(checkpoint=str(save_head(folder, target, head, drafter=cls.name))), target)


def _contexts(target: Target, depth: int | None) -> list[DraftContext]:
    """One sequence's steps: the prompt, then a few accepted tokens at a time, with its features."""
    tokens = torch.arange(3, 3 + CUTS[-1]) % 50 + 2
    with torch.inference_mode():
        out = target.model(input_ids=tokens[None], output_hidden_states=True)
    features = torch.stack([out.hidden_states[i][0] for i in LAYERS], dim=1)
    starts = (0, *CUTS[:-1])
    return [
        DraftContext(tokens[:end], features[max(start - 1, 0) : end - 1], end - 1, depth)
        for start, end in zip(starts, CUTS, strict=True)
    ]


@pytest.mark.parametrize(
    ("cls", "options", "depth"),
    [
        pytest.param(
            JetFlowDrafter,
            {"anchored_slots": True, "context_tokens": True, "draft_vocab_size": 48},
            2,
            id="jetflow-anchored-tokens-vocab",
        ),
        pytest.param(JetFlowDrafter, {}, None, id="jetflow-unbounded"),
        pytest.param(DFlashDrafter, {}, 2, id="dflash"),
    ],
)
def test_the_compiled_step_drafts_what_the_eager_head_drafts(compiled_llama, tmp_path, cls, options, depth):
    drafter = _drafter(cls, compiled_llama, tmp_path, **options)
    compiled, eager = drafter.for_row(), drafter.for_row()
    forward = compiled_llama.compiled
    for index, context in enumerate(_contexts(compiled_llama, depth)):
        got = drafter.begin_rows([compiled], [context])[0]
        compiled_llama.use_compiled(None)  # the same drafter, eagerly
        try:
            want = drafter.begin_rows([eager], [context])[0]
        finally:
            compiled_llama.use_compiled(forward)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=ATOL, rtol=0)
        assert compiled._cache.length == eager._cache.length == context.n_processed
        for (keys, values), (want_keys, want_values) in zip(compiled._cache.kv, eager._cache.kv, strict=True):
            torch.testing.assert_close(keys, want_keys, atol=ATOL, rtol=0)
            torch.testing.assert_close(values, want_values, atol=ATOL, rtol=0)
        torch.testing.assert_close(compiled._cache.last_fused, eager._cache.last_fused, atol=ATOL, rtol=0)
        if index == 0:  # the prompt's step (an empty context) ran eagerly: nothing compiled yet
            assert drafter._compiled is not None and not drafter._compiled.compile_s
    step = drafter._compiled
    assert step is not None
    expected = step.depths(depth)
    assert list(step.compile_s) == [expected] and step.package(expected).is_file()
    assert expected == (2 if cls.causal and depth else drafter.head.config.block_size - 1)


def test_steps_it_cannot_take_run_eagerly(compiled_llama, tmp_path, monkeypatch) -> None:
    drafter = _drafter(JetFlowDrafter, compiled_llama, tmp_path)
    contexts = _contexts(compiled_llama, 2)
    row = drafter.for_row()
    drafter.begin_rows([row], [contexts[0]])
    step = CompiledBlockStep(drafter, compiled_llama.compiled)
    monkeypatch.setattr(compiled_step, "MAX_NEW_ENTRIES", 2)
    assert step(row._cache, contexts[1].features, contexts[1].tokens, 2) is None  # 3 new entries
    assert step(row._cache, None, contexts[1].tokens, 2) is None
    assert step(drafter.head.empty_cache(), contexts[0].features[:1], contexts[0].tokens[:2], 2) is None
    loading_only = CompiledForward(compiled_llama.model, buckets=(1, 2, 4), autotune=False, build=False)
    assert loading_only.folder == compiled_llama.compiled.folder
    unbuilt = CompiledBlockStep(drafter, loading_only)
    assert not unbuilt.package(3).is_file()
    assert unbuilt(row._cache, contexts[1].features[:1], contexts[1].tokens[:10], 3) is None
    assert not unbuilt.package(3).is_file(), "a run that may not build never builds"


@pytest.mark.parametrize("drafter", ["jetflow", "jetflow+ngram"])
def test_engine_with_the_compiled_head_decodes_greedily(compiled_llama, tmp_path, drafter) -> None:
    head = tiny_head(compiled_llama, anchored_slots=True, context_tokens=True)
    params = {"checkpoint": str(save_head(tmp_path, compiled_llama, head))}
    prompt = [7, 8, 9, 10, 11] * 3 + [7]
    with torch.inference_mode():
        out = compiled_llama.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
    fields = {
        "drafter": drafter,
        "drafter_params": params if drafter == "jetflow" else {"jetflow": params},
        "max_new_tokens": 24,
        "tree": {"budget": 3, "adapt": False},
    }
    engine = Engine(build_config(GenerateConfig, fields), compiled_llama)
    head_drafter = engine.drafter if drafter == "jetflow" else engine.drafter.drafters[0]
    step = head_drafter._compiled
    assert step is not None and list(step.compile_s) == [3], "ready before the first step is timed"
    result = engine.generate(prompt)
    assert result.token_ids == out[0, len(prompt) :].tolist()
    assert list(step.compile_s) == [3]
