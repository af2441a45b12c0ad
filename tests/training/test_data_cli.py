"""``jetflow data`` end to end on a tiny target: regenerate (resumable), features, stats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jetflow.cli.main import main
from jetflow.core.errors import DataError
from jetflow.core.target import Target
from jetflow.drafters.training.corpus import Corpus
from jetflow.drafters.training.feature_cache import FeatureStore

from tests.training.conftest import TinyDataTarget

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture
def tiny(tiny_data_target: TinyDataTarget) -> tuple[Target, Path]:
    """A tiny target, one known benchmark prompt and a prompt file that repeats it (whitespace aside)."""
    lines = ["w1 w2 w3", "w5  w6 w7", "w1 w2 w3", " ".join(["w9"] * 40), "w4 w8", "w10 w11 w12 w13"]
    # first turns are checked against benchmark first turns only: "w4 w8" is a follow-up
    benchmark = {False: {"w5 w6 w7"}, True: {"w5 w6 w7", "w4 w8"}}
    return tiny_data_target(CHAT_TEMPLATE, [{"prompt": p} for p in lines], benchmark)


def test_regenerate_features_and_stats(tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target, prompts = tiny
    out = tmp_path / "corpus"
    common = ["--source", f"file:{prompts}", "--max-new-tokens", "6", "--max-prompt-tokens", "20"]
    common += ["--threads", "1"]
    assert main(["data", "regenerate", *common, "--n", "2", "--shard-size", "1", "--out", str(out)]) == 0
    assert main(["data", "regenerate", *common, "--n", "5", "--shard-size", "1", "--out", str(out)]) == 0
    corpus = Corpus(out)
    assert corpus.ids == ["1", "5", "6"], "benchmark text, repeat and long prompt are skipped"
    skipped = corpus.manifest["selection"]["skipped"]
    assert skipped == {"benchmark_overlap": ["2"], "duplicate_prompt": ["3"], "prompt_too_long": ["4"]}
    assert len(corpus.manifest["shards"]) == 3, "the second run added one shard per new conversation"

    features = ["data", "features", "--corpus", str(out), "--layers", "1,2", "--threads", "1"]
    assert main([*features, "--part", "2/2"]) == 0  # two processes share the shards
    assert "part 2/2 of the features done" in capsys.readouterr().out
    assert main([*features, "--part", "1/2"]) == 0
    assert "features of layers [1, 2] for 3 sequences" in capsys.readouterr().out
    assert len(FeatureStore(corpus, (1, 2))) == 3
    with pytest.raises(SystemExit) as refused:
        main([*features, "--part", "3/2"])
    assert refused.value.code == 2 and "expected K/N" in capsys.readouterr().err
    assert main(["data", "stats", "--corpus", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["source"] == f"file:{prompts}" and stats["target"] == target.name
    assert stats["n_conversations"] == 3 and stats["n_response_tokens"] > 0


def test_benchmark_sources_are_refused(tiny, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "regenerate", "--source", "humaneval", "--n", "1"]) == 2
    assert "benchmark" in capsys.readouterr().err


def test_the_heldout_split_makes_an_evaluation_corpus_that_training_refuses(
    tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from jetflow.cli import data as data_cli
    from jetflow.core.errors import ConfigError
    from jetflow.data.prompt_sets import Sample
    from jetflow.drafters.training.stores import open_store

    target, _ = tiny
    # a held-out prompt equal to a benchmark text stays: the evaluation corpus is never trained on
    heldout = [Sample(str(i), "sharegpt-heldout", [text]) for i, text in enumerate(["w5 w6 w7", "w2 w4"])]
    monkeypatch.setattr(data_cli.prompt_sets, "load_sharegpt_heldout", lambda: heldout)
    out = tmp_path / "heldout"
    argv = ["data", "regenerate", "--source", "sharegpt-heldout", "--n", "2", "--max-new-tokens", "4"]
    assert main([*argv, "--threads", "1", "--layers", "1,2", "--out", str(out)]) == 0
    corpus = Corpus(out)
    assert corpus.ids == ["0", "1"] and corpus.manifest["source"] == "sharegpt-heldout"

    with pytest.raises(ConfigError, match="never for training"):
        open_store([str(out)], None, (1, 2), target)
    assert len(open_store([str(out)], None, (1, 2), target, purpose="eval")) == 2
    twice = [str(out), str(out)]
    assert len(open_store(twice, None, (1, 2), target, purpose="eval")) == 4
    assert len(open_store(twice, None, (1, 2), target, purpose="eval", limit=1)) == 1
    assert main([*argv, "--turn", "2"]) == 2
    assert "benchmark set" in capsys.readouterr().err


def test_features_of_the_first_sequences_only(
    tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--max-sequences N`` fills only the shards a run with ``max_sequences=N`` reads."""
    _, prompts = tiny
    out = tmp_path / "corpus"
    regenerate = ["data", "regenerate", "--source", f"file:{prompts}", "--max-new-tokens", "6"]
    regenerate += ["--max-prompt-tokens", "20", "--n", "3", "--shard-size", "1", "--no-features"]
    assert main([*regenerate, "--out", str(out)]) == 0
    features = ["data", "features", "--corpus", str(out), "--layers", "1,2", "--threads", "1"]
    assert main([*features, "--max-sequences", "2"]) == 0
    assert "features of layers [1, 2] for 2 sequences" in capsys.readouterr().out
    corpus = Corpus(out)
    assert len(FeatureStore(corpus, (1, 2), limit=2)) == 2
    with pytest.raises(DataError, match=r"missing or stale for corpus shards \[2\]"):
        FeatureStore(corpus, (1, 2))
