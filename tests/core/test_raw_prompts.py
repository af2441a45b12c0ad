"""A target whose tokenizer has no chat template (a base model) decodes prompts as raw text.

Every path that formats prompts goes through :meth:`Target.encode_prompt`, so one rule serves
``generate``, the bench, calibration and regeneration: the chat template where the tokenizer
has one, else the text as it is, with one log line saying so.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from jetflow.cli.main import main
from jetflow.core.config import GenerateConfig, build_config
from jetflow.core.engine import Engine
from jetflow.core.errors import ConfigError

from tests.conftest import make_tiny_target

CHAT_TEMPLATE = "{% for m in messages %}<eos> {{ m['content'] }} {% endfor %}"


def test_text_prompt_without_template_is_encoded_raw_and_logged_once(caplog) -> None:
    target = make_tiny_target("llama")
    assert not target.has_chat_template
    with caplog.at_level(logging.INFO, logger="jetflow.core.target"):
        first = target.encode_prompt("w3 w4 w5")
        second = target.encode_prompt("w6")
    assert first == target.tokenizer("w3 w4 w5", add_special_tokens=False)["input_ids"]
    assert second == target.tokenizer("w6", add_special_tokens=False)["input_ids"]
    notices = [r for r in caplog.records if "no chat template" in r.getMessage()]
    assert len(notices) == 1


def test_chat_turns_without_template_are_joined_as_text() -> None:
    target = make_tiny_target("llama")
    turns = [
        {"role": "user", "content": "w3 w4"},
        {"role": "assistant", "content": "w5"},
        {"role": "user", "content": "w6"},
    ]
    assert target.encode_prompt(turns) == target.encode_prompt("w3 w4\n\nw5\n\nw6")


def test_a_template_is_still_used_where_the_tokenizer_has_one() -> None:
    target = make_tiny_target("llama")
    target.tokenizer.chat_template = CHAT_TEMPLATE
    assert target.has_chat_template
    assert target.encode_prompt("w3") != target.encode_prompt("w3", chat=False)
    assert target.encode_prompt("w3")[0] == 1  # the template's <eos> marker opens the turn


def test_engine_generates_from_text_on_a_base_model() -> None:
    target = make_tiny_target("llama")
    engine = Engine(build_config(GenerateConfig, {"drafter": "ngram", "max_new_tokens": 6}), target)
    result = engine.generate("w3 w4 w5 w3 w4 w5 w3")
    assert result.prompt_ids == target.encode_prompt("w3 w4 w5 w3 w4 w5 w3", chat=False)
    assert len(result.token_ids) > 0


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("tiny-base-target")
    target = make_tiny_target("llama")
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return str(folder)


def test_cli_generate_on_a_base_model_needs_no_raw_flag(
    capsys, base_model_dir: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path))
    code = main(
        [
            *("generate", "--target", base_model_dir, "--dtype", "float32", "--drafter", "ngram"),
            *("--prompt", "w3 w4 w5 w3 w4 w5 w3", "--max-new-tokens", "4", "--budget", "2", "--json"),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["text"]


def test_text_no_tokenizer_can_encode_is_named_wherever_it_was_read() -> None:
    target = make_tiny_target("llama")
    with pytest.raises(ConfigError, match="lone surrogate"):
        target.encode_prompt("w3 \udcff")
    with pytest.raises(ConfigError, match="lone surrogate"):
        target.encode_prompt([{"role": "user", "content": "w3 \udcff"}])


def test_an_empty_earlier_turn_is_encoded_not_refused() -> None:
    target = make_tiny_target("llama")
    turns = [
        {"role": "user", "content": "w3"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "w4"},
    ]
    assert target.encode_prompt(turns) == target.encode_prompt("w3\n\n\n\nw4")
