"""The compiled verify forward on a tiny random target (two buckets, no autotuning: CI-sized).

It must agree with the eager forward at every node (padding rows invisible), leave the slab as
a prefill of the accepted path would, build one package per bucket for every history length and
capacity, load it in a later process instead of compiling again, and the engine on it must decode
what plain greedy decoding does.
"""

from __future__ import annotations

import ast
import inspect
import os

import pytest
import torch
from jetflow.core.compiled import CompiledForward, built_buckets
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.engine import Engine
from jetflow.core.target import Target
from jetflow.core.tree import DraftTree

from ..conftest import make_tiny_target

ATOL = 1e-4
BUCKET = 4
#: the fixture's buckets: a 3-node tree runs padded in the larger, a 2-node one exactly in the smaller
BUCKETS = (2, BUCKET)


@pytest.fixture(scope="module")
def compiled_llama(tmp_path_factory) -> Target:
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path_factory.mktemp("packages")))
    target = make_tiny_target("llama", seed=3)
    target.use_compiled(CompiledForward(target.model, buckets=BUCKETS, autotune=False))
    yield target
    monkeypatch.undo()


def _eager(target: Target):
    eager = make_tiny_target("llama", seed=3)
    assert torch.equal(eager.model.lm_head.weight, target.model.lm_head.weight)
    return eager


def test_compiled_verify_and_commit_match_the_eager_forward(compiled_llama: Target) -> None:
    eager = _eager(compiled_llama)
    tree = DraftTree(tokens=torch.tensor([4, 8, 9]), parents=torch.tensor([-1, 0, 0]), scores=torch.zeros(3))
    prefix = [5, 9, 13, 7, 3, 22, 40, 41]
    for cut, capacity in ((4, 6), (5, 64), (7, 9)):  # new history lengths and slab capacities
        cache, _ = compiled_llama.prefill(torch.tensor(prefix[:cut]), capacity=capacity)
        out = compiled_llama.verify(cache, tree, layers=(1, 3))
        reference_cache, _ = eager.prefill(torch.tensor(prefix[:cut]))
        reference = eager.verify(reference_cache, tree, layers=(1, 3))
        torch.testing.assert_close(out.logits, reference.logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.features, reference.features, atol=ATOL, rtol=0)
        path = tree.path(2)
        compiled_llama.commit(cache, cut, path)
        expected, _ = eager.prefill(torch.tensor(prefix[:cut] + tree.tokens[path].tolist()))
        for layer, kept in zip(cache.layers, expected.layers, strict=True):
            torch.testing.assert_close(layer.keys, kept.keys, atol=ATOL, rtol=0)
            torch.testing.assert_close(layer.values, kept.values, atol=ATOL, rtol=0)
    assert BUCKET in compiled_llama.compiled.built  # three lengths and capacities, one package
    assert compiled_llama.compiled.package(BUCKET).is_file()


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_engine_on_the_compiled_target_decodes_greedily(compiled_llama: Target, drafter: str) -> None:
    prompt = [7, 8, 9, 10, 11] * 3 + [7]
    with torch.inference_mode():
        out = compiled_llama.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
    fields = {"drafter": drafter, "max_new_tokens": 24}
    if drafter != "none":
        fields["tree"] = {"policy": "chain", "budget": BUCKET - 1}  # every tree fits a bucket
    result = Engine(build_config(GenerateConfig, fields), compiled_llama).generate(prompt)
    assert result.token_ids == out[0, len(prompt) :].tolist()


def test_a_compiled_target_is_calibrated_apart_from_the_eager_one(compiled_llama: Target) -> None:
    from jetflow.core.calibration import key_for

    config = build_config(GenerateConfig, {"drafter": "ngram"})
    compiled_key = key_for(config, compiled_llama)
    eager_key = key_for(config, _eager(compiled_llama))
    assert compiled_key.compiled and not eager_key.compiled
    assert compiled_key.digest() != eager_key.digest()
    assert "compiled" in compiled_key.describe() and "compiled" not in eager_key.describe()


def test_buckets_share_one_slab_without_recompiling_per_length(compiled_llama: Target) -> None:
    """Trees of two sizes in turn on one growing slab: one graph per bucket, each still exact."""
    eager = _eager(compiled_llama)
    prefix = [5, 9, 13, 7, 3, 22, 40, 41]
    cache, _ = compiled_llama.prefill(torch.tensor(prefix[:4]), capacity=6)  # grows on the way
    for step in range(4):
        size = 2 + step % 2
        tokens = torch.tensor([prefix[4 + step], 8, 9][:size])
        tree = DraftTree(tokens=tokens, parents=torch.tensor([-1, 0, 0][:size]), scores=torch.zeros(size))
        out = compiled_llama.verify(cache, tree)
        reference_cache, _ = eager.prefill(torch.tensor(prefix[: 4 + step]))
        torch.testing.assert_close(out.logits, eager.verify(reference_cache, tree).logits, atol=ATOL, rtol=0)
        compiled_llama.commit(cache, 4 + step, torch.tensor([0]))  # root accepted: the history grows by 1
    assert sorted(compiled_llama.compiled.compile_s) == list(BUCKETS)


def test_a_later_process_loads_the_packages_and_compiles_nothing(compiled_llama: Target) -> None:
    """A new forward on the same model (as a later process makes) finds the built packages: it
    loads them, gives the first forward's logits, and with ``build`` off leaves a bucket no one
    built to the eager forward; another model's weights, or another thread count, never load them."""
    built = compiled_llama.compiled
    for bucket in BUCKETS:
        built._runner(bucket)  # whatever test order came before, both packages exist now
    assert built_buckets(compiled_llama.model, (*BUCKETS, 8), autotune=False) == list(BUCKETS)
    later = CompiledForward(compiled_llama.model, buckets=(*BUCKETS, 8), autotune=False, build=False)
    assert later.folder == built.folder and later.bucket(3) == BUCKET and later.bucket(5) is None
    tree = DraftTree(tokens=torch.tensor([4, 8, 9]), parents=torch.tensor([-1, 0, 0]), scores=torch.zeros(3))
    outputs = []
    for forward in (built, later):
        compiled_llama.use_compiled(forward)
        cache, _ = compiled_llama.prefill(torch.tensor([5, 9, 13, 7, 3]), capacity=16)
        outputs.append(compiled_llama.verify(cache, tree).logits)
    compiled_llama.use_compiled(built)
    torch.testing.assert_close(outputs[1], outputs[0], atol=0, rtol=0)
    assert later.built == set() and list(later.compile_s) == [BUCKET]
    later.load(rows=3)  # what an engine does before its first generation: every package a tree can use
    assert sorted(later.compile_s) == list(BUCKETS) and later.built == set()
    other = make_tiny_target("llama", seed=4)
    unbuilt = CompiledForward(other.model, buckets=BUCKETS, autotune=False)
    assert unbuilt.folder != built.folder
    unbuilt.load(rows=3)  # loading never builds: that is left to a tree's first forward
    assert unbuilt.compile_s == {} and not unbuilt.package(BUCKET).exists()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # kernels generated for one thread count serve no other
    try:
        assert CompiledForward(compiled_llama.model, buckets=BUCKETS, autotune=False).folder != built.folder
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("compiled_ms", "eager_ms", "setting", "built", "compiles"),
    [
        (None, 10.0, None, True, False),  # nothing calibrated through the compiled target: never a guess
        (8.0, 10.0, None, True, True),  # the compiled calibration predicts more tokens/s
        (8.0, 10.0, None, False, False),  # ... but its packages are gone: no run waits for a compile
        (12.0, 10.0, None, True, False),  # the eager one does
        (8.0, None, None, True, True),  # asked for by `calibrate --compile`, nothing to compare with
        (8.0, 10.0, False, True, False),  # --no-compile wins over any calibration
        (None, None, True, False, True),  # --compile needs none
    ],
)
def test_compiling_is_the_default_where_the_calibration_shows_it_pays(
    tmp_path, monkeypatch, compiled_ms, eager_ms, setting, built, compiles
) -> None:
    from jetflow.core import calibration as cal
    from jetflow.core import engine as engine_module

    from tests.core.test_adaptive import calibration_record

    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path))
    monkeypatch.setattr(engine_module, "built_buckets", lambda model: [1] if built else [])
    config = build_config(GenerateConfig, {"drafter": "ngram", "compile": setting})
    target = make_tiny_target("llama")
    eager_key = cal.key_for(config.model_copy(update={"compile": False}), target)
    for ms, compiled in ((compiled_ms, True), (eager_ms, False)):
        if ms is not None:
            key = eager_key.model_copy(update={"compiled": compiled})
            cal.save_calibration(calibration_record(key, {0: 1.0, 2: 1.5}, {0: ms, 2: ms * 1.1}))
    engine = Engine.from_cache(config, target)
    assert (target.compiled is not None) == compiles
    if compiles:  # a calibration's choice compiles nothing new; --compile builds what it needs
        assert target.compiled.build is (setting is True)
    calibrated = compiled_ms if compiles else eager_ms  # the budget comes from the path's own
    assert (engine.budget_source != "default") == (calibrated is not None)


def test_imports_point_one_way_from_the_target_to_the_compiled_forward() -> None:
    """core/target.py uses the compiled forward; core/compiled.py never imports the target back."""
    imported = {
        node.module
        for node in ast.walk(ast.parse(inspect.getsource(inspect.getmodule(CompiledForward))))
        if isinstance(node, ast.ImportFrom)
    }
    assert "jetflow.core.target" not in imported


def test_compiled_graphs_are_kept_in_jetflows_cache_unless_the_user_chose_one(tmp_path, monkeypatch) -> None:
    """torch writes its default (a temporary folder) into the variable when triton is imported:
    that counts as unset; a folder the user chose is kept."""
    from jetflow.core import compiled
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path / "jetflow"))
    monkeypatch.setenv(compiled.INDUCTOR_CACHE_VARIABLE, default_cache_dir())
    compiled._use_jetflow_caches()
    assert os.environ[compiled.INDUCTOR_CACHE_VARIABLE] == str(tmp_path / "jetflow" / "inductor")
    monkeypatch.setenv(compiled.INDUCTOR_CACHE_VARIABLE, str(tmp_path / "mine"))
    compiled._use_jetflow_caches()
    assert os.environ[compiled.INDUCTOR_CACHE_VARIABLE] == str(tmp_path / "mine")
