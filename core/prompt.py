"""What a prompt may be, checked where it enters the engine: text, chat messages or token ids.

A bad prompt is named here in words before the tokenizer or the embedding sees it; left to them
it fails with their messages (a fast tokenizer's ``TypeError`` on a lone surrogate, an
embedding's ``IndexError`` on an id outside the vocabulary) that say nothing about the input.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import SupportsIndex

from jetflow.core.errors import ConfigError

#: chat messages as transformers' chat templates take them
Messages = list[dict[str, str]]
#: what :meth:`Engine.generate` decodes from
Prompt = str | Messages | Sequence[int]

ACCEPTED_PROMPTS = "a str, a list of chat messages ({'role': ..., 'content': ...}) or a sequence of token ids"


def check_text(text: str, what: str = "the prompt") -> str:
    """``text`` if it is non-empty and encodable as UTF-8, else a :class:`ConfigError`.

    A lone surrogate is what Python makes of bytes that are not UTF-8 (``surrogateescape``,
    as in ``sys.argv``); no tokenizer can encode it.
    """
    if not text:
        raise ConfigError(f"{what} is empty")
    return check_encodable(text, what)


def check_encodable(text: str, what: str = "the prompt") -> str:
    """``text`` if it is encodable as UTF-8 (empty is fine: a turn may be), else a :class:`ConfigError`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ConfigError(
            f"{what} is not valid text: character {error.start} is {text[error.start]!r}, a lone "
            "surrogate (text decoded from bytes that are not UTF-8?)"
        ) from None
    return text


def prompt_items(prompt: object) -> list[object]:
    """The items of a prompt given as a sequence (messages or token ids), at least one.

    Raises TypeError for anything that is neither text nor such a sequence.
    """
    if isinstance(prompt, bytes | bytearray):
        raise TypeError("the prompt is bytes: decode it to str first")
    if isinstance(prompt, str) or not isinstance(prompt, Sequence):
        raise TypeError(f"a prompt is {ACCEPTED_PROMPTS}, not {type(prompt).__name__}")
    if not prompt:
        raise ConfigError("the prompt is empty")
    return list(prompt)


def check_messages(items: Sequence[object]) -> Messages:
    """Chat messages whose role and content are text, each content checked by :func:`check_text`."""
    messages: Messages = []
    for index, message in enumerate(items):
        if not isinstance(message, Mapping):
            raise TypeError(f"chat message {index} is a {type(message).__name__}, not a dict")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise ConfigError(f"chat message {index} needs a str 'role' and a str 'content', got {message!r}")
        check_text(content, f"the content of chat message {index}")
        messages.append(dict(message))
    return messages


def check_token_ids(items: Sequence[object], vocab_size: int) -> list[int]:
    """Integer ids in ``[0, vocab_size)``, else a :class:`ConfigError` naming the first bad one."""
    ids = [_as_token_id(item, position) for position, item in enumerate(items)]
    for position, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise ConfigError(
                f"token id {token} at position {position} is outside the target's vocabulary "
                f"(ids 0 to {vocab_size - 1})"
            )
    return ids


def _as_token_id(item: object, position: int) -> int:
    """``item`` as an int if it is an integer (a Python, NumPy or 0-d torch one)."""
    if isinstance(item, SupportsIndex):
        try:
            return operator.index(item)
        except TypeError:  # a float tensor declares __index__ but refuses it
            pass
    raise ConfigError(f"token ids are integers; position {position} holds {item!r} ({type(item).__name__})")
