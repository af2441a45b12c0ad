"""``jetflow generate --prompts-file`` and ``jetflow.generate`` on a list, on a tiny saved target.

A batch must give each prompt exactly the tokens a single run gives it, in input order; every
mistake in the file or the flags is one line and exit code 2, named by its line where it has one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jetflow.cli.generate import read_prompts_file
from jetflow.cli.main import main
from jetflow.core.errors import DataError
from jetflow.core.target import Target

import jetflow
from tests.conftest import TINY_VOCAB, make_tiny_target

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
#: prompts of different lengths and words, so that their answers differ and rows finish apart
PROMPTS = ["w3 w4 w5 w3 w4 w5 w3", "w9", "w20 w21 w22 w20 w21", "w7 w7 w8 w100 w7 w7", "w42 w43"]
MAX_NEW = "7"
RECORD_KEYS = {"index", "text", "token_ids", "finish_reason", "stats"}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("tiny-chat-target")
    target = make_tiny_target("llama")
    target.tokenizer.chat_template = CHAT_TEMPLATE
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path))


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args, **_kwargs):
        raise AssertionError("the target must not load for bad input")

    monkeypatch.setattr(Target, "load", refuse)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _generate(capsys, target_dir: str, *extra: str) -> tuple[int, str, str]:
    return _run(
        capsys,
        *("generate", "--target", target_dir, "--dtype", "float32", "--drafter", "ngram"),
        *("--budget", "4", "--max-new-tokens", MAX_NEW),
        *extra,
    )


def _records(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def _single(capsys, target_dir: str, prompt: str) -> dict:
    code, out, err = _generate(capsys, target_dir, "--prompt", prompt, "--json")
    assert code == 0, err
    return json.loads(out)


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("batch_size", ["2", "8"])
def test_a_batch_gives_each_prompt_its_single_run_tokens_in_input_order(
    capsys, target_dir: str, tmp_path: Path, batch_size: str
) -> None:
    singles = [_single(capsys, target_dir, prompt) for prompt in PROMPTS]
    assert len({tuple(single["token_ids"]) for single in singles}) > 2, "the prompts must answer apart"
    file = _write(tmp_path, "prompts.txt", "\n".join(PROMPTS) + "\n")
    code, out, err = _generate(capsys, target_dir, "--prompts-file", file, "--batch-size", batch_size)
    assert code == 0, err
    records = _records(out)
    assert [record["index"] for record in records] == list(range(len(PROMPTS)))
    for record, single in zip(records, singles, strict=True):
        assert set(record) == RECORD_KEYS  # no id: the plain-text lines have none
        assert record["token_ids"] == single["token_ids"]
        assert record["text"] == single["text"]
        assert record["finish_reason"] == single["finish_reason"]
        assert record["stats"]["new_tokens"] == len(record["token_ids"])
        assert set(record["stats"]) == set(single["stats"])
    total = sum(len(record["token_ids"]) for record in records)
    summary = err.strip().splitlines()[-1]
    assert f"{len(PROMPTS)} prompts, {total} new tokens" in summary and "tokens/s" in summary


def test_json_lines_with_ids_messages_and_token_ids(capsys, target_dir: str, tmp_path: Path) -> None:
    chat = [{"role": "user", "content": PROMPTS[2]}]
    ids = make_tiny_target("llama").tokenizer(PROMPTS[3], add_special_tokens=False)["input_ids"]
    lines = [
        json.dumps(PROMPTS[0]),
        "",  # blank lines are skipped, and still counted in line numbers
        json.dumps({"id": "first", "prompt": PROMPTS[1]}),
        json.dumps({"id": 7, "messages": chat, "extra": "ignored"}),
        json.dumps({"token_ids": ids, "id": None}),
    ]
    file = _write(tmp_path, "prompts.jsonl", "\n".join(lines))
    code, out, err = _generate(capsys, target_dir, "--prompts-file", file, "--batch-size", "3")
    assert code == 0, err
    records = _records(out)
    assert [record.get("id", "absent") for record in records] == ["absent", "first", 7, None]
    assert [record["index"] for record in records] == [0, 1, 2, 3]
    assert next(iter(records[1])) == "id"  # the id leads its object
    assert records[0]["token_ids"] == _single(capsys, target_dir, PROMPTS[0])["token_ids"]
    assert records[1]["token_ids"] == _single(capsys, target_dir, PROMPTS[1])["token_ids"]
    # the chat and the token ids answer as the library answers them alone
    config = {"target": target_dir, "dtype": "float32", "drafter": "ngram", "max_new_tokens": int(MAX_NEW)}
    engine = jetflow.Engine(jetflow.GenerateConfig.model_validate({**config, "tree": {"budget": 4}}))
    assert records[2]["token_ids"] == engine.generate(chat).token_ids
    assert records[3]["token_ids"] == engine.generate(ids).token_ids
    assert records[2]["token_ids"] != records[3]["token_ids"]


def test_out_writes_the_json_lines_to_a_file_instead_of_stdout(
    capsys, target_dir: str, tmp_path: Path
) -> None:
    file = _write(tmp_path, "prompts.txt", "\n".join(PROMPTS[:3]))
    code, printed, err = _generate(capsys, target_dir, "--prompts-file", file)
    assert code == 0, err
    out = tmp_path / "answers" / "out.jsonl"
    code, stdout, err = _generate(capsys, target_dir, "--prompts-file", file, "--out", str(out))
    assert code == 0, err
    assert stdout == "" and str(out) in err
    written = _records(out.read_text(encoding="utf-8"))
    assert [r["token_ids"] for r in written] == [r["token_ids"] for r in _records(printed)]
    assert not [p for p in out.parent.iterdir() if p.name != "out.jsonl"], "no staging file is left"


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("p.txt", "w3 w4\n\n  \nw5\r\nw6 w7\n", ["w3 w4", "w5", "w6 w7"]),
        ("p.txt", "42\nw5\n", ["42", "w5"]),  # a first line of bare JSON that is no prompt: text
        ("p.txt", "{not json\nw5\n", ["{not json", "w5"]),
        ("p.txt", '"w3 w4"\n{"prompt": "w5"}\n', ["w3 w4", "w5"]),  # a JSON first line: JSON lines
        ("p.json-lines", '"w3"\n', ["w3"]),
        ("p.JSONL", '\n{"token_ids": [3, 4]}\n', [[3, 4]]),
    ],
)
def test_the_file_format_is_told_by_its_ending_or_its_first_line(
    tmp_path: Path, name: str, text: str, expected: list
) -> None:
    prompts = read_prompts_file(_write(tmp_path, name, text))
    assert [item.prompt for item in prompts] == expected


def test_a_file_line_is_named_by_its_number(tmp_path: Path) -> None:
    file = _write(tmp_path, "p.txt", "\nw3\n\nw4\n")
    assert [item.where for item in read_prompts_file(file)] == [f"{file} line 2", f"{file} line 4"]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("p.jsonl", "", "no prompts in it"),
        ("p.txt", "\n  \n\n", "no prompts in it"),
        ("p.jsonl", '"w3"\n\n{"prompt": "w4"\n', "line 3: not valid JSON"),
        ("p.txt", '"w3"\nw4 w5\n', "line 2: not valid JSON"),
        ("p.jsonl", '{"id": 1, "text": "w3"}\n', "line 1: the object has none of 'prompt', 'messages'"),
        ("p.jsonl", '{"prompt": "w3", "token_ids": [3]}\n', "line 1: the object has 'prompt' and"),
        ("p.jsonl", '"w3"\n[3, 4]\n', "line 2: expected a JSON string or object, got an array"),
        ("p.jsonl", '{"prompt": "  "}\n', "line 1: 'prompt' is empty"),
        ("p.jsonl", '{"prompt": 5}\n', "line 1: 'prompt' must be a string, got a number"),
        ("p.jsonl", '{"messages": []}\n', "line 1: 'messages' must be a non-empty list"),
        ("p.jsonl", '{"messages": [{"role": "user"}]}\n', "line 1: chat message 0 needs a str 'role'"),
        ("p.jsonl", '{"messages": ["hi"]}\n', "line 1: chat message 0 is a str, not a dict"),
        ("p.jsonl", '{"token_ids": [3, "w4"]}\n', "line 1: 'token_ids' position 1 holds \"w4\""),
        ("p.jsonl", '{"token_ids": [3, true]}\n', "line 1: 'token_ids' position 1 holds true"),
        ("p.jsonl", b'"w3 \xff"\n', "not UTF-8 text"),
    ],
)
def test_a_bad_prompts_file_is_one_line_and_exit_2_before_loading(
    capsys, tmp_path: Path, no_model_load: None, name: str, text: str | bytes, message: str
) -> None:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    code, out, err = _run(capsys, "generate", "--prompts-file", str(path))
    assert (code, out) == (2, "")
    named = f"{path} line" if "line" in message else f"--prompts-file {path}"
    assert err.startswith(f"jetflow: error: {named}")
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(DataError):
        read_prompts_file(str(path))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompts-file", "/no/such/prompts.jsonl"], "--prompts-file /no/such/prompts.jsonl: no such file"),
        (["--prompts-file", "."], "--prompts-file .: a folder, not a file"),
        (["--prompts-file", "FILE", "--prompt", "w3"], "give --prompt or --prompts-file, not both"),
        ([], "give --prompt TEXT or --prompts-file FILE"),
        (["--prompts-file", "FILE", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--prompts-file", "FILE", "--batch-size", "-3"], "--batch-size must be >= 1, got -3"),
        (["--prompts-file", "FILE", "--compare"], "--compare takes a single --prompt"),
        (["--prompt", "w3", "--out", "x.jsonl"], "--out goes with --prompts-file"),
        (["--prompts-file", "FILE", "--out", "."], "--out .: a folder is in the way"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2_before_loading(
    capsys, tmp_path: Path, no_model_load: None, argv: list[str], message: str
) -> None:
    file = _write(tmp_path, "prompts.txt", "w3\n")
    argv = [file if arg == "FILE" else arg for arg in argv]
    code, out, err = _run(capsys, "generate", *argv)
    assert (code, out) == (2, "")
    assert err.startswith("jetflow: error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_token_id_outside_the_vocabulary_is_named_by_its_line(
    capsys, target_dir: str, tmp_path: Path
) -> None:
    file = _write(tmp_path, "p.jsonl", f'"w3"\n{{"token_ids": [3, {TINY_VOCAB}]}}\n')
    code, out, err = _generate(capsys, target_dir, "--prompts-file", file)
    assert (code, out) == (2, "")
    assert err.startswith(f"jetflow: error: {file} line 2: token id {TINY_VOCAB} at position 1")
    assert err.count("\n") == 1


def test_the_library_takes_a_list_of_prompts_and_keeps_one_prompt_one_result(target_dir: str) -> None:
    config = {"target": target_dir, "dtype": "float32", "drafter": "ngram", "max_new_tokens": 5}
    config["tree"] = {"budget": 4}
    texts = jetflow.generate(PROMPTS[:3], batch_size=2, **config)
    assert isinstance(texts, list) and len(texts) == 3
    alone = [jetflow.generate(prompt, **config) for prompt in PROMPTS[:3]]
    assert all(isinstance(result, jetflow.GenerationResult) for result in alone)
    assert [r.token_ids for r in texts] == [r.token_ids for r in alone]

    ids = [3, 4, 5, 3, 4]
    single_ids = jetflow.generate(ids, **config)  # a list of ints is one prompt
    assert isinstance(single_ids, jetflow.GenerationResult) and single_ids.prompt_ids == ids
    listed = jetflow.generate([ids, [9, 10]], **config)  # a list of lists: one prompt each
    assert isinstance(listed, list) and [r.prompt_ids for r in listed] == [ids, [9, 10]]
    assert listed[0].token_ids == single_ids.token_ids

    chat = [{"role": "user", "content": PROMPTS[0]}]
    single_chat = jetflow.generate(chat, **config)  # a list of dicts is one chat
    assert isinstance(single_chat, jetflow.GenerationResult)
    chats = jetflow.generate([chat], **config)  # a list of chats
    assert isinstance(chats, list) and chats[0].token_ids == single_chat.token_ids
