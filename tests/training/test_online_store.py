"""Online training data: the target's states computed when a step reads its sequences, equal to
the feature cache's, read once per step and per process, with nothing written to disk."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from jetflow.cli.main import main
from jetflow.core.errors import ConfigError
from jetflow.core.target import Target
from jetflow.drafters.training.batches import anchored_batch
from jetflow.drafters.training.contracts import Record, SequenceStore
from jetflow.drafters.training.corpus import Corpus
from jetflow.drafters.training.distributed import DataParallel
from jetflow.drafters.training.examples import ConcatStore, InMemoryStore
from jetflow.drafters.training.feature_cache import FEATURE_DTYPE
from jetflow.drafters.training.features import build_features
from jetflow.drafters.training.head_options import fitted_head_options
from jetflow.drafters.training.online_store import OnlineStore, forward_token_budget
from jetflow.drafters.training.stores import open_store

from tests.conftest import make_tiny_target
from tests.drafters.tiny_heads import regenerated_store
from tests.training.conftest import TinyDataTarget

LAYERS = (1, 2)
PROMPTS = ["w3 w4 w5", "w7 w8", "w9 w10 w11 w12", "w13 w14 w15 w16 w17", "w20 w21"]


@pytest.fixture
def corpus(tiny_data_target: TinyDataTarget, tmp_path: Path) -> tuple[Target, Corpus]:
    """Five conversations of a tiny target, two to a shard, regenerated without features."""
    target, prompts = tiny_data_target("", [{"prompt": p} for p in PROMPTS], {False: set(), True: set()})
    out = tmp_path / "corpus"
    regenerate = ["data", "regenerate", "--source", f"file:{prompts}", "--n", "5", "--shard-size", "2"]
    assert main([*regenerate, "--max-new-tokens", "12", "--no-features", "--out", str(out)]) == 0
    return target, Corpus(out)


class CountingStore:
    """An in-memory store that records each call reading states."""

    def __init__(self, store: InMemoryStore) -> None:
        self.store, self.layers, self.manifest = store, store.layers, store.manifest
        self.reads: list[list[int]] = []

    def __len__(self) -> int:
        return len(self.store)

    def tokens(self, index: int) -> tuple[torch.Tensor, int]:
        return self.store.tokens(index)

    def sequence(self, index: int) -> Record:
        return self.sequences([index])[0]

    def sequences(self, indices: Sequence[int]) -> list[Record]:
        self.reads.append(list(indices))
        return self.store.sequences(indices)


@pytest.mark.parametrize("token_budget", [1, 4096], ids=["apart", "padded-together"])
def test_online_states_equal_the_feature_cache(
    corpus: tuple[Target, Corpus], tmp_path: Path, token_budget: int
) -> None:
    target, data = corpus
    cached = build_features(target, data, LAYERS, folder=tmp_path / "features")
    assert cached is not None
    online = OnlineStore(data, target, LAYERS, token_budget=token_budget)
    assert isinstance(online, SequenceStore) and len(online) == len(cached) == 5
    records = online.sequences([4, 0, 2])  # of different lengths
    for index, (tokens, prompt, features, final) in zip([4, 0, 2], records, strict=True):
        want_tokens, want_prompt, want_features, want_final = cached.sequence(index)
        assert torch.equal(tokens, want_tokens) and prompt == want_prompt
        assert features.dtype == final.dtype == FEATURE_DTYPE
        torch.testing.assert_close(features, want_features, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(final, want_final, atol=2e-3, rtol=2e-3)
    assert online.manifest["features"] == "online" and online.manifest["feature_layers"] == list(LAYERS)


def test_a_cpu_runs_one_sequence_per_forward_an_accelerator_a_step_at_once() -> None:
    assert forward_token_budget(torch.device("cpu")) == 1
    assert forward_token_budget(torch.device("cuda")) > 4 * 2048


def test_an_online_store_opens_no_feature_cache(corpus: tuple[Target, Corpus], tmp_path: Path) -> None:
    target, data = corpus
    store = open_store([str(data.path)], None, LAYERS, target, limit=3, online=True)
    assert isinstance(store, OnlineStore) and len(store) == 3
    assert store.sequence(2)[2].shape[1:] == (len(LAYERS), target.hidden_size)
    assert not (tmp_path / "cache" / "features").exists()
    with pytest.raises(ConfigError, match="online training never reads"):
        open_store([str(data.path)], str(tmp_path / "features"), LAYERS, target, online=True)


def test_each_process_computes_only_its_share_of_a_step_in_one_call(tiny_llama: Target) -> None:
    store = CountingStore(regenerated_store(tiny_llama))
    ids = [5, 9, 2, 7]
    whole = anchored_batch(store, ids, 8, torch.Generator().manual_seed(1), torch.device("cpu"))
    assert store.reads == [ids]
    store.reads.clear()
    second = DataParallel(rank=1, world=2)
    half = anchored_batch(store, ids, 8, torch.Generator().manual_seed(1), torch.device("cpu"), second)
    assert store.reads == [[9, 7]], "rank 1 of 2 reads sequences 1 and 3 of the step, at once"
    assert torch.equal(half.anchors, whole.anchors[1::2]), "the same anchors whichever process reads them"


def test_a_concatenated_store_reads_each_part_once_and_keeps_the_order(tiny_llama: Target) -> None:
    first, second = CountingStore(regenerated_store(tiny_llama)), CountingStore(regenerated_store(tiny_llama))
    both = ConcatStore([first, second])
    records = both.sequences([len(first) + 1, 0, len(first), 3])
    assert first.reads == [[0, 3]] and second.reads == [[1, 0]]
    assert [r[0] for r in records] == [
        second.store.records[1][0],
        first.store.records[0][0],
        second.store.records[0][0],
        first.store.records[3][0],
    ]
    assert torch.equal(both.tokens(len(first) + 2)[0], second.store.records[2][0])


def test_a_draft_vocabulary_too_large_for_the_target_gives_way_to_the_full_one() -> None:
    target = make_tiny_target("llama")  # 256 tokens
    assert fitted_head_options({"draft_vocab_size": 8192, "num_layers": 1}, target) == {
        "draft_vocab_size": None,
        "num_layers": 1,
    }
    assert fitted_head_options({"draft_vocab_size": 128}, target) == {"draft_vocab_size": None}
    assert fitted_head_options({"draft_vocab_size": 64}, target) == {"draft_vocab_size": 64}
    assert fitted_head_options({}, target) == {}


def test_regeneration_records_whether_the_chat_template_was_used(corpus: tuple[Target, Corpus]) -> None:
    _, data = corpus
    assert data.manifest["settings"]["chat_template"] is False
    assert json.loads((data.path / "manifest.json").read_text())["settings"]["chat_template"] is False
