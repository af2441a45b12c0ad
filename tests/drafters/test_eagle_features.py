"""The feature cache serves a subset of its layers, so an EAGLE head trains on the block heads' cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jetflow.core.errors import DataError
from jetflow.drafters.training.corpus import Corpus
from jetflow.drafters.training.feature_cache import FeatureStore, FeatureWriter, feature_dir

from tests.training.test_corpus import HEADER, _write_corpus

CACHED = (1, 8, 14, 20, 27)
HIDDEN = 4


def _fill(folder: Path, corpus: Corpus, layers: tuple[int, ...]) -> None:
    """Features whose value names their layer: row r of layer L holds ``L + r / 100``."""
    writer = FeatureWriter(
        folder,
        corpus_name="c",
        target=HEADER["target"],
        layers=layers,
        hidden_size=HIDDEN,
        computed_in="float32",
    )
    for index, (record, shard) in enumerate(zip(corpus.manifest["shards"], corpus.shards, strict=True)):
        rows = [len(shard.sequence(j)) - 1 for j in range(len(shard))]
        features = [
            (torch.tensor(layers, dtype=torch.float32)[None, :, None] + torch.arange(r)[:, None, None] / 100)
            .expand(r, len(layers), HIDDEN)
            .contiguous()
            for r in rows
        ]
        writer.write(index, record["tokens_sha256"], features, [torch.zeros(r, HIDDEN) for r in rows])


def test_a_subset_of_the_cached_layers_is_served_in_its_own_order(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path / "cache"))
    _write_corpus(tmp_path / "c")
    corpus = Corpus(tmp_path / "c")
    _fill(feature_dir("c", CACHED), corpus, CACHED)

    full = FeatureStore(corpus, CACHED)
    subset = FeatureStore(corpus, (1, 14, 27))  # found in the cache of all five layers
    assert subset.folder == full.folder == feature_dir("c", CACHED)
    assert subset.layers == (1, 14, 27) and subset.manifest["feature_layers"] == [1, 14, 27]
    for index in range(len(corpus)):
        tokens, prompt_length, features, final = subset.sequence(index)
        want = full.sequence(index)
        assert torch.equal(tokens, want[0]) and prompt_length == want[1] and torch.equal(final, want[3])
        assert torch.equal(features, want[2][:, [0, 2, 4]])
        assert features.dtype == torch.float16 and features[0, :, 0].tolist() == [1.0, 14.0, 27.0]

    explicit = FeatureStore(corpus, (8, 20), full.folder)  # an explicit folder works alike
    assert explicit.sequence(3)[2][0, :, 0].tolist() == [8.0, 20.0]


def test_layers_no_cache_holds_are_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path / "cache"))
    _write_corpus(tmp_path / "c")
    corpus = Corpus(tmp_path / "c")
    _fill(feature_dir("c", CACHED), corpus, CACHED)
    with pytest.raises(DataError, match=r"no cached features of layers 1,15,27 .* --layers 1,15,27"):
        FeatureStore(corpus, (1, 15, 27))
