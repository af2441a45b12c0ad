"""Prompts checked where they enter the engine: each bad one named in words, never a tokenizer's
or an embedding's own error; and ``max_new_tokens`` below 1 refused, not read as "the default"."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from jetflow.core.config import GenerateConfig
from jetflow.core.engine import Engine
from jetflow.core.errors import ConfigError
from jetflow.core.prompt import check_messages, check_text, check_token_ids, prompt_items
from jetflow.core.target import Target

from ..conftest import TINY_VOCAB


@pytest.fixture(scope="module")
def engine(tiny_llama: Target) -> Engine:
    return Engine(
        GenerateConfig(drafter="none", max_new_tokens=3, chat_template=False, stop_at_eos=False), tiny_llama
    )


def test_text_with_a_lone_surrogate_is_named() -> None:
    with pytest.raises(ConfigError, match=r"the prompt is not valid text: character 3 is '\\udcff'"):
        check_text("hi \udcff")
    assert check_text("héllo ✓") == "héllo ✓"


def test_token_ids_outside_the_vocabulary_name_the_range() -> None:
    for bad in (TINY_VOCAB, -1):
        with pytest.raises(
            ConfigError, match=rf"token id {bad} at position 1 .* \(ids 0 to {TINY_VOCAB - 1}\)"
        ):
            check_token_ids([5, bad], TINY_VOCAB)


def test_integer_ids_of_any_kind_pass_and_other_items_do_not() -> None:
    assert check_token_ids([np.int64(3), torch.tensor(4), 5], TINY_VOCAB) == [3, 4, 5]
    for bad in (2.0, "7", torch.tensor(1.5)):
        with pytest.raises(ConfigError, match="token ids are integers; position 0 holds"):
            check_token_ids([bad], TINY_VOCAB)


@pytest.mark.parametrize("prompt", [123, None, {"role": "user"}, 4.5])
def test_a_prompt_of_another_type_names_the_accepted_ones(prompt: object) -> None:
    with pytest.raises(
        TypeError, match=r"a prompt is a str, a list of chat messages .* or a sequence of token ids"
    ):
        prompt_items(prompt)


def test_bytes_are_refused_rather_than_read_as_token_ids() -> None:
    with pytest.raises(TypeError, match="bytes: decode it to str first"):
        prompt_items(b"w3 w4")


def test_chat_messages_need_text_role_and_content() -> None:
    assert check_messages([{"role": "user", "content": "w3"}]) == [{"role": "user", "content": "w3"}]
    with pytest.raises(ConfigError, match="chat message 0 needs a str 'role' and a str 'content'"):
        check_messages([{"role": "user", "content": 3}])
    with pytest.raises(ConfigError, match="the content of chat message 1 is not valid text"):
        check_messages([{"role": "user", "content": "w3"}, {"role": "user", "content": "\ud800"}])
    with pytest.raises(TypeError, match="chat message 0 is a str, not a dict"):
        check_messages(["w3"])


@pytest.mark.parametrize(
    ("prompt", "error", "message"),
    [
        ("w3 \udcff", ConfigError, "not valid text"),
        ([2, 3, TINY_VOCAB], ConfigError, "outside the target's vocabulary"),
        ([2, -1], ConfigError, "outside the target's vocabulary"),
        (123, TypeError, "a prompt is a str"),
        ([], ConfigError, "the prompt is empty"),
        ("", ConfigError, "the prompt is empty"),
    ],
)
def test_the_engine_refuses_bad_prompts_before_the_target_sees_them(
    engine: Engine, prompt: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        engine.generate(prompt)  # type: ignore[arg-type]


@pytest.mark.parametrize("max_new_tokens", [0, -3, 2.5, True])
def test_max_new_tokens_below_one_is_refused_not_taken_for_the_default(
    engine: Engine, max_new_tokens: object
) -> None:
    with pytest.raises(ConfigError, match="max_new_tokens must be an integer >= 1"):
        engine.generate([2, 3], max_new_tokens=max_new_tokens)  # type: ignore[arg-type]


def test_max_new_tokens_given_or_not(engine: Engine) -> None:
    assert len(engine.generate([2, 3], max_new_tokens=1).token_ids) == 1
    assert len(engine.generate([2, 3]).token_ids) == 3  # the config's
