"""Regeneration on a tiny random target: greedy equality, early stops, resume, captured features."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from jetflow.core.errors import ConfigError, DataError
from jetflow.core.kv_cache import SlabLayer
from jetflow.core.target import Target
from jetflow.drafters.head_sizes import default_feature_layers
from jetflow.drafters.training import greedy
from jetflow.drafters.training import regenerate as regen
from jetflow.drafters.training.corpus import Corpus
from jetflow.drafters.training.feature_cache import FeatureStore
from jetflow.drafters.training.features import build_features

from tests.conftest import make_tiny_target

LAYERS = (1, 3)
MAX_NEW = 12


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads, and spinning threads crawl on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _prompts(n: int, seed: int = 1) -> list[regen.Prompt]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=generator).tolist()
    return [
        regen.Prompt(f"p{i}", tuple(torch.randint(2, 256, (m,), generator=generator).tolist()))
        for i, m in enumerate(lengths)
    ]


def _reference(model, prompt: regen.Prompt, eos: list[int]) -> list[int]:
    ids = torch.tensor([prompt.token_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=MAX_NEW,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def stopping_target() -> Target:
    """A tiny target whose EOS set makes some answers stop early (random weights rarely stop)."""
    target = make_tiny_target("llama", seed=3)
    prompts = [torch.tensor(p.token_ids) for p in _prompts(8)]
    free = greedy.greedy_generate(target.model, prompts, MAX_NEW, eos_ids=[])
    eos = sorted({int(free[0].response[2]), int(free[5].response[6]), 1})
    target.model.generation_config.eos_token_id = eos
    return target


@pytest.fixture(scope="module")
def generate_references(stopping_target: Target) -> list[list[int]]:
    """``transformers.generate`` answers to ``_prompts(8)``, one prompt at a time."""
    eos = sorted(stopping_target.eos_token_ids)
    return [_reference(stopping_target.model, prompt, eos) for prompt in _prompts(8)]


def test_default_feature_layers_follow_the_recipe() -> None:
    assert default_feature_layers(30) == (1, 8, 14, 20, 27)
    assert default_feature_layers(36) == (1, 9, 17, 25, 33)


@pytest.mark.parametrize(("batch_size", "prefill_tokens"), [(5, 4096), (8, 64)])
def test_batched_greedy_equals_generate_per_prompt(
    stopping_target: Target,
    generate_references: list[list[int]],
    batch_size: int,
    prefill_tokens: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    eos = sorted(stopping_target.eos_token_ids)
    prompts = _prompts(8)
    compactions = []
    original = SlabLayer.compact
    monkeypatch.setattr(SlabLayer, "compact", lambda self, *a: compactions.append(a[1]) or original(self, *a))
    results = greedy.generate_chunk(
        stopping_target.model,
        [torch.tensor(p.token_ids) for p in prompts],
        MAX_NEW,
        eos,
        batch_size=batch_size,
        prefill_tokens=prefill_tokens,  # 64: prompts prefilled in several groups, merged into one cache
    )
    assert min(len(r.response) for r in results) < MAX_NEW, "some answers must stop early"
    assert compactions, "finished rows must leave the batch at least once"
    if batch_size == 8:
        assert max(compactions) > 0, "a compaction must also drop padding columns"
    for prompt, result, reference in zip(prompts, results, generate_references, strict=True):
        assert result.response.tolist() == reference, prompt.id


def test_captured_states_equal_a_teacher_forced_forward(stopping_target: Target) -> None:
    model = stopping_target.model
    prompts = _prompts(6, seed=2)
    results = greedy.generate_chunk(
        model, [torch.tensor(p.token_ids) for p in prompts], MAX_NEW, stopping_target.eos_token_ids, 4, LAYERS
    )
    for prompt, result in zip(prompts, results, strict=True):
        tokens = torch.cat([torch.tensor(prompt.token_ids), result.response])
        with torch.no_grad():
            out = model(tokens[None], output_hidden_states=True)
        n = len(tokens) - 1
        expected = torch.stack([out.hidden_states[i][0, :n] for i in LAYERS], dim=1)
        assert result.features.shape == (n, len(LAYERS), model.config.hidden_size)
        assert result.features.dtype == torch.float16
        _assert_fp16_close(result.features, expected)
        _assert_fp16_close(result.final, out.hidden_states[-1][0, :n])
        logits = model.get_output_embeddings()(result.final.float())
        assert torch.equal(logits.argmax(-1), out.logits[0, :n].argmax(-1))


def _assert_fp16_close(stored: torch.Tensor, reference: torch.Tensor) -> None:
    """Equal up to fp16 storage rounding (half an ulp, with margin) plus 1e-4."""
    error = (stored.float() - reference).abs()
    assert (error <= reference.abs() * 2**-10 + 1e-4).all(), float(error.max())


def test_regenerate_writes_shards_manifest_and_features(tmp_path: Path) -> None:
    target = make_tiny_target("llama", seed=4)
    prompts = _prompts(7)
    corpus = regen.regenerate(
        target,
        prompts,
        tmp_path / "corpus",
        max_new_tokens=MAX_NEW,
        batch_size=3,
        shard_size=3,
        layers=LAYERS,
    )
    assert sorted(p.name for p in corpus.path.iterdir()) == [
        "manifest.json",
        "shard-00000.safetensors",
        "shard-00001.safetensors",
        "shard-00002.safetensors",
    ]
    manifest = corpus.manifest
    assert manifest["ids"] == [p.id for p in prompts] == corpus.ids
    assert manifest["target"] == {"name": target.name, "fingerprint": target.fingerprint()}
    assert manifest["settings"]["max_new_tokens"] == MAX_NEW
    assert manifest["counts"]["n_conversations"] == len(corpus) == 7
    assert corpus.shards[0].tokens.dtype == torch.uint16
    response_tokens = 0
    for i, prompt in enumerate(prompts):
        tokens, prompt_length = corpus.sequence(i)
        assert prompt_length == len(prompt.token_ids)
        assert tokens[:prompt_length].tolist() == list(prompt.token_ids)
        response_tokens += len(tokens) - prompt_length
    assert manifest["counts"]["n_response_tokens"] == response_tokens
    assert manifest["regeneration"]["wall_time_s"] > 0

    store = FeatureStore(corpus, LAYERS)
    tokens, prompt_length, features, final = store.sequence(4)
    assert torch.equal(tokens, corpus.sequence(4)[0])
    assert features.shape == (len(tokens) - 1, len(LAYERS), 64) and final.shape == (len(tokens) - 1, 64)
    # the teacher-forced rebuild (fresh clone, no cache) gives the same states
    rebuilt = build_features(target, corpus, LAYERS, folder=tmp_path / "rebuilt", token_budget=64)
    for i in range(len(corpus)):
        _, _, f1, g1 = store.sequence(i)
        _, _, f2, g2 = rebuilt.sequence(i)
        _assert_fp16_close(f1, f2.float())
        _assert_fp16_close(g1, g2.float())


def test_resume_after_interruption_continues_without_duplicates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = make_tiny_target("llama", seed=5)
    prompts = _prompts(10)
    kwargs = dict(max_new_tokens=MAX_NEW, batch_size=4, shard_size=4, layers=LAYERS)
    reference = regen.regenerate(target, prompts, tmp_path / "reference", **kwargs)

    real_chunk, calls, interrupts = regen.generate_chunk, [], [KeyboardInterrupt]

    def interrupted(*args, **kw):
        calls.append(len(args[1]))
        if len(calls) == 2 and interrupts:
            raise interrupts.pop()
        return real_chunk(*args, **kw)

    monkeypatch.setattr(regen, "generate_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        regen.regenerate(target, prompts, tmp_path / "corpus", **kwargs)
    assert len(Corpus(tmp_path / "corpus")) == 4
    (tmp_path / "corpus" / f".shard-00001.safetensors.tmp{_dead_pid()}").write_bytes(b"torn")  # killed
    calls.clear()
    resumed = regen.regenerate(target, prompts, tmp_path / "corpus", **kwargs)
    assert calls == [4, 2], "only the missing shards are generated"
    assert resumed.ids == reference.ids == [p.id for p in prompts]
    for i in range(len(prompts)):
        assert torch.equal(resumed.sequence(i)[0], reference.sequence(i)[0])
    assert not [p for p in (tmp_path / "corpus").iterdir() if p.name.startswith(".")], "no staging files left"
    assert len(FeatureStore(resumed, LAYERS)) == 10


def _dead_pid() -> int:
    """The id of a process that has exited (so a staging file naming it is stale)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_processes_splitting_the_shards_fill_one_cache(tmp_path: Path) -> None:
    target = make_tiny_target("llama", seed=5)
    corpus = regen.regenerate(target, _prompts(7), tmp_path / "corpus", max_new_tokens=MAX_NEW, shard_size=2)
    folder = tmp_path / "split"
    folder.mkdir()
    live, dead = folder / f".x.npy.tmp{os.getppid()}", folder / f".y.npy.tmp{_dead_pid()}"
    live.write_bytes(b"another writer's")
    dead.write_bytes(b"torn")
    assert build_features(target, corpus, LAYERS, folder=folder, part=(2, 2)) is None
    assert live.exists() and not dead.exists(), "only a dead writer's temporaries are removed"
    with pytest.raises(DataError, match=r"missing or stale for corpus shards \[0, 2\]"):
        FeatureStore(corpus, LAYERS, folder)
    split = build_features(target, corpus, LAYERS, folder=folder, part=(1, 2))
    whole = build_features(target, corpus, LAYERS, folder=tmp_path / "whole")
    assert split is not None and whole is not None
    for i in range(len(corpus)):
        assert torch.equal(split.sequence(i)[2], whole.sequence(i)[2])
        assert torch.equal(split.sequence(i)[3], whole.sequence(i)[3])
    with pytest.raises(ConfigError, match="K/N"):
        build_features(target, corpus, LAYERS, folder=folder, part=(3, 2))


def test_resume_refuses_other_settings(tmp_path: Path) -> None:
    target = make_tiny_target("llama", seed=5)
    prompts = _prompts(3)
    regen.regenerate(target, prompts, tmp_path / "corpus", max_new_tokens=4, shard_size=2)
    with pytest.raises(DataError, match="max_new_tokens"):
        regen.regenerate(target, prompts, tmp_path / "corpus", max_new_tokens=5, shard_size=2)
    with pytest.raises(DataError, match="not the first"):
        regen.regenerate(target, prompts[1:], tmp_path / "corpus", max_new_tokens=4, shard_size=2)
