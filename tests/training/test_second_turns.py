"""Second turns: the target answers the follow-up after the first-turn corpus's own answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from jetflow.cli.main import main
from jetflow.core.errors import ConfigError
from jetflow.core.target import Target
from jetflow.drafters.training import second_turns
from jetflow.drafters.training.corpus import Corpus
from jetflow.drafters.training.corpus_folders import second_turn_dir, training_corpus_dirs
from jetflow.drafters.training.feature_cache import FeatureStore
from jetflow.drafters.training.stores import open_store

from tests.training.conftest import TinyDataTarget

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}w0 {% endif %}{{ m['content'] }} {% endfor %}"
)
CONVERSATIONS = [
    ["w1 w2 w3", "w4 w5"],
    ["w6 w7"],  # no second turn
    ["w8 w9", "w5 w6 w7"],  # its follow-up is a benchmark text
    ["w10 w11", "w12 w13 w12"],
    ["w2 w2", "w9 w1"],
]


@pytest.fixture
def tiny(tiny_data_target: TinyDataTarget) -> tuple[Target, Path]:
    records = [
        {"id": str(i), "messages": [{"role": "user", "content": t} for t in turns]}
        for i, turns in enumerate(CONVERSATIONS)
    ]
    # conversation 2's follow-up is a benchmark text once every turn counts (whitespace aside)
    benchmark = {False: set(), True: {"w5  w6 w7"}}
    return tiny_data_target(CHAT_TEMPLATE, records, benchmark)


def _regenerate(prompts: Path, *args: str, features: str | None = None) -> int:
    common = ["--source", f"file:{prompts}", "--max-new-tokens", "5", "--threads", "1", "--shard-size", "1"]
    common += ["--layers", features] if features else ["--no-features"]
    return main(["data", "regenerate", *common, *args])


def test_second_turns_follow_the_corpus_own_answers_and_resume(tiny, tmp_path: Path) -> None:
    target, prompts = tiny
    first = tmp_path / "corpus"
    assert _regenerate(prompts, "--n", "3", "--out", str(first)) == 0
    assert _regenerate(prompts, "--turn", "2", "--parent", str(first)) == 0
    second = second_turn_dir(first)
    assert Corpus(second).ids == ["0"], "conversation 1 has no follow-up, 2 follows with a benchmark text"
    skipped = Corpus(second).manifest["selection"]["skipped"]
    assert skipped["no_second_turn"] == ["1"] and skipped["benchmark_overlap"] == ["2"]

    assert _regenerate(prompts, "--n", "5", "--out", str(first)) == 0  # the first turns grow
    assert _regenerate(prompts, "--turn", "2", "--parent", str(first)) == 0  # and the second resume
    parent, corpus = Corpus(first), Corpus(second)
    assert corpus.ids == ["0", "3", "4"] and len(corpus.manifest["shards"]) == 3
    assert (
        corpus.manifest["source"] == "sharegpt-turn2" and corpus.manifest["selection"]["parent"] == "corpus"
    )
    assert training_corpus_dirs(first) == [first, second]

    for index, sample_id in enumerate(corpus.ids):
        turns = CONVERSATIONS[int(sample_id)]
        tokens, prompt_length = parent.sequence(parent.ids.index(sample_id))
        answer = target.decode(tokens[prompt_length:])
        messages = [
            {"role": "user", "content": turns[0]},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": turns[1]},
        ]
        tokens, prompt_length = corpus.sequence(index)
        assert tokens[:prompt_length].tolist() == target.encode_prompt(messages)
        with torch.inference_mode():
            prompt = tokens[None, :prompt_length]
            mask = torch.ones_like(prompt)
            out = target.model.generate(prompt, attention_mask=mask, max_new_tokens=5, do_sample=False)
        assert out[0, prompt_length:].tolist() == tokens[prompt_length:].tolist()


def test_follow_stops_once_the_parent_is_complete(tiny, tmp_path: Path) -> None:
    _, prompts = tiny
    first = tmp_path / "corpus"
    assert _regenerate(prompts, "--n", "5", "--out", str(first)) == 0
    out = tmp_path / "turn2"
    args = ("--turn", "2", "--parent", str(first), "--out", str(out), "--follow", "--n", "2")
    assert _regenerate(prompts, *args) == 0, "a complete parent ends --follow at once"
    assert Corpus(out).ids == ["0", "3"]


def test_follow_waits_for_full_shards_while_the_parent_grows(
    tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, prompts = tiny
    first = tmp_path / "corpus"
    assert _regenerate(prompts, "--n", "3", "--out", str(first)) == 0
    manifest = json.loads((first / "manifest.json").read_text())
    manifest["selection"]["kept"] = 5  # as if its run (--n 5) were still writing
    (first / "manifest.json").write_text(json.dumps(manifest))
    waits = []

    def grow_parent(seconds: float) -> None:
        waits.append(seconds)
        assert not (first.parent / "corpus-turn2").exists(), "one second turn is less than a full shard"
        assert _regenerate(prompts, "--n", "5", "--out", str(first)) == 0

    monkeypatch.setattr(second_turns.time, "sleep", grow_parent)
    args = ("--turn", "2", "--parent", str(first), "--follow", "--shard-size", "2")
    assert _regenerate(prompts, *args) == 0
    assert len(waits) == 1
    corpus = Corpus(second_turn_dir(first))
    assert corpus.ids == ["0", "3", "4"], "the complete parent's last, partial shard is answered too"


def test_the_trainer_and_stats_read_first_and_second_turns_together(
    tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, prompts = tiny
    first = tmp_path / "corpus"
    assert _regenerate(prompts, "--n", "5", "--out", str(first), features="1,2") == 0
    assert _regenerate(prompts, "--turn", "2", "--parent", str(first), features="1,2") == 0
    second = second_turn_dir(first)
    store = open_store([str(first), str(second)], None, (1, 2), target)
    alone = FeatureStore(Corpus(second), (1, 2))
    assert len(store) == 5 + 3 and store.layers == (1, 2)
    for got, expected in zip(store.sequence(6), alone.sequence(1), strict=True):
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(expected))
    assert store.manifest["counts"]["n_conversations"] == 8
    with pytest.raises(ConfigError, match="one corpus"):
        open_store([str(first), str(second)], str(tmp_path), (1, 2), target)

    capsys.readouterr()
    assert main(["data", "stats", "--corpus", str(first), "--corpus", str(second), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["n_conversations"] == 5 and stats["n_sequences"] == 8
    assert stats["n_response_tokens"] == 8 * 5 and stats["source"] == f"file:{prompts}+sharegpt-turn2"
    assert [part["corpus"] for part in stats["corpora"]] == ["corpus", "corpus-turn2"]
