"""Corpus format and prompt selection: round trip, broken files, stats CLI, no benchmark overlap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from jetflow.cli.main import main
from jetflow.core.errors import DataError
from jetflow.data.prompt_sets import Sample, benchmark_prompt_texts, load_sharegpt, prompt_key
from jetflow.drafters.training.corpus import Corpus, CorpusWriter, pack_shard, token_dtype
from jetflow.drafters.training.corpus_folders import default_corpus_dir
from jetflow.drafters.training.feature_cache import FeatureStore, FeatureWriter
from jetflow.drafters.training.regenerate import select_prompts

HEADER = {
    "source": "unit",
    "target": {"name": "tiny", "fingerprint": {"vocab_size": 300}},
    "settings": {"max_new_tokens": 4, "max_prompt_tokens": 8, "dtype": "float32", "shard_size": 2},
    "selection": {},
}


def _write_corpus(folder: Path, n_shards: int = 2) -> list[torch.Tensor]:
    writer = CorpusWriter(folder, HEADER)
    sequences = []
    for s in range(n_shards):
        shard_sequences = [torch.arange(3 + i + s, dtype=torch.int64) + 250 for i in range(2)]
        sequences += shard_sequences
        shard = pack_shard([f"id{s}-{i}" for i in range(2)], shard_sequences, [2, 3], token_dtype(300))
        writer.append(shard, wall_time_s=1.0)
    return sequences


def test_round_trip_and_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sequences = _write_corpus(tmp_path / "c")
    corpus = Corpus(tmp_path / "c")
    assert len(corpus) == 4 and corpus.ids == ["id0-0", "id0-1", "id1-0", "id1-1"]
    for i, expected in enumerate(sequences):
        tokens, prompt_length = corpus.sequence(i)
        assert tokens.dtype == torch.int64 and torch.equal(tokens, expected)
        assert prompt_length == [2, 3][i % 2]
    with pytest.raises(IndexError):
        corpus.sequence(4)
    counts = corpus.manifest["counts"]
    assert counts == {"n_conversations": 4, "n_prompt_tokens": 10, "n_response_tokens": 6}
    assert corpus.manifest["regeneration"]["response_tokens_per_s"] == 3.0

    assert main(["data", "stats", "--corpus", str(tmp_path / "c"), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    own = {"source": "unit", "target": "tiny", "n_conversations": 4, "n_response_tokens": 6}
    assert stats == own | {"n_sequences": 4, "corpora": [own | {"corpus": "c"}]}


def test_token_dtype_is_the_narrowest_that_fits() -> None:
    assert token_dtype(49152) == torch.uint16
    assert token_dtype(65536) == torch.uint16
    assert token_dtype(151936) == torch.int32


def test_truncated_shard_is_a_data_error_naming_the_file(tmp_path: Path, capsys) -> None:
    _write_corpus(tmp_path / "c")
    shard = tmp_path / "c" / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(DataError, match=r"shard-00001\.safetensors"):
        Corpus(tmp_path / "c")
    assert main(["data", "stats", "--corpus", str(tmp_path / "c")]) == 2
    assert "shard-00001.safetensors" in capsys.readouterr().err


def test_missing_corpus_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="jetflow data regenerate"):
        Corpus(tmp_path)


def test_feature_store_refuses_missing_and_truncated_shards(tmp_path: Path) -> None:
    _write_corpus(tmp_path / "c")
    corpus = Corpus(tmp_path / "c")
    layers, hidden = (1, 2), 8
    with pytest.raises(DataError, match="jetflow data features"):
        FeatureStore(corpus, layers, tmp_path / "f")
    writer = FeatureWriter(
        tmp_path / "f",
        corpus_name="c",
        target=HEADER["target"],
        layers=layers,
        hidden_size=hidden,
        computed_in="float32",
    )
    for index, (record, shard) in enumerate(zip(corpus.manifest["shards"], corpus.shards, strict=True)):
        rows = [len(shard.sequence(j)) - 1 for j in range(len(shard))]
        writer.write(
            index,
            record["tokens_sha256"],
            [torch.full((r, 2, hidden), float(r)) for r in rows],
            [torch.full((r, hidden), -float(r)) for r in rows],
        )
    store = FeatureStore(corpus, layers, tmp_path / "f")
    tokens, prompt_length, features, final = store.sequence(3)
    assert len(tokens) == 5 and prompt_length == 3
    assert features.shape == (4, 2, hidden) and features.dtype == torch.float16 and (features == 4).all()
    assert final.shape == (4, hidden) and (final == -4).all()
    assert store.layers == layers and store.manifest["feature_layers"] == [1, 2]
    assert store.manifest["features_computed_in"] == ["float32"]

    with pytest.raises(DataError, match="overflow float16"):
        writer.write(0, "x", [torch.full((1, 2, hidden), 1e6)], [torch.zeros(1, hidden)])

    broken = tmp_path / "f" / "shard-00001.final.npy"
    broken.write_bytes(broken.read_bytes()[:-10])
    with pytest.raises(DataError, match=r"shard-00001\.final\.npy"):
        FeatureStore(corpus, layers, tmp_path / "f")
    first = FeatureStore(corpus, layers, tmp_path / "f", limit=2)  # the first shard is all it reads
    assert len(first) == 2 and first.sequence(1)[0].tolist() == corpus.sequence(1)[0].tolist()
    with pytest.raises(IndexError):
        first.sequence(2)
    with pytest.raises(DataError, match=r"shard-00001\.final\.npy"):
        FeatureStore(corpus, layers, tmp_path / "f", limit=3)


def test_features_computed_in_another_precision_are_stale(tmp_path: Path) -> None:
    """fp32 and bf16 target states differ: a shard is reused only in the precision it was computed in."""
    _write_corpus(tmp_path / "c")
    corpus = Corpus(tmp_path / "c")
    record = corpus.manifest["shards"][0]
    rows = [len(corpus.shards[0].sequence(j)) - 1 for j in range(len(corpus.shards[0]))]

    def writer(computed_in: str) -> FeatureWriter:
        return FeatureWriter(
            tmp_path / "f",
            corpus_name="c",
            target=HEADER["target"],
            layers=(1,),
            hidden_size=4,
            computed_in=computed_in,
        )

    writer("float32").write(
        0, record["tokens_sha256"], [torch.zeros(r, 1, 4) for r in rows], [torch.zeros(r, 4) for r in rows]
    )
    assert writer("float32").has(0, record["tokens_sha256"])
    assert not writer("bfloat16").has(0, record["tokens_sha256"])
    manifest_path = tmp_path / "f" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["shards"]["0"]["computed_in"]  # a shard recorded before precisions were
    manifest_path.write_text(json.dumps(manifest))
    assert writer("bfloat16").has(0, record["tokens_sha256"])
    assert FeatureStore(corpus, (1,), tmp_path / "f", limit=2).manifest["features_computed_in"] == [
        "unrecorded"
    ]


def _sample(i: int, text: str) -> Sample:
    return Sample(f"s{i}", "sharegpt", (text,))


def test_select_prompts_skips_benchmarks_duplicates_and_long_prompts() -> None:
    texts = ["hello there", "Write  a\npoem", "hello there", "x " * 50, "what is 2+2?", "tell me more"]
    samples = [_sample(i, t) for i, t in enumerate(texts)]

    def encode(text: str) -> list[int]:
        return [len(word) for word in text.split()]

    selection = select_prompts(samples, encode, 3, max_prompt_tokens=10, exclude={"Write a poem"})
    assert [p.id for p in selection.prompts] == ["s0", "s4", "s5"]
    assert selection.skipped == {
        "benchmark_overlap": ["s1"],
        "duplicate_prompt": ["s2"],
        "prompt_too_long": ["s3"],
    }
    fewer = select_prompts(samples, encode, 2, max_prompt_tokens=10, exclude={"Write a poem"})
    assert fewer.prompts == selection.prompts[:2], (
        "a smaller n selects a prefix, so resuming can grow a corpus"
    )


def test_committed_corpus_never_contains_a_benchmark_prompt() -> None:
    folder = default_corpus_dir()
    if not (folder / "manifest.json").exists():
        pytest.skip(f"no committed corpus at {folder} yet")
    corpus = Corpus(folder)
    by_id = {s.id: s.turns[0] for s in load_sharegpt()}
    used = {prompt_key(by_id[i]) for i in corpus.ids}
    assert len(used) == len(corpus), "every corpus id is a distinct ShareGPT prompt"
    assert used.isdisjoint({prompt_key(t) for t in benchmark_prompt_texts()})
