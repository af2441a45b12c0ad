"""Fixtures of the benchmark tests: a tiny chat target, its saved folder, and prompt files.

The tiny target is the shared random Llama of ``tests/conftest.py`` with a one-line chat
template, so the runner's chat path (multi-turn conversations included) runs in
milliseconds; prompts are ``w<N>`` words its word-level tokenizer knows.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from jetflow.core.target import Target

from tests.conftest import make_tiny_target

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def chat_target(seed: int = 0) -> Target:
    target = make_tiny_target("llama", seed=seed)
    target.tokenizer.chat_template = CHAT_TEMPLATE
    return target


def words(*numbers: int) -> str:
    return " ".join(f"w{n}" for n in numbers)


@pytest.fixture(scope="package", autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models run faster on one thread, and far faster on a machine shared with other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def bench_target() -> Target:
    return chat_target()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat target saved as a folder, for code that loads a target by name."""
    folder = tmp_path_factory.mktemp("tiny-target")
    target = chat_target()
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two prompts: a repetitive one-turn prompt and a two-turn conversation."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [
        {"id": "loop", "prompt": words(*[3, 4, 5, 6] * 6)},
        {
            "id": "chat",
            "messages": [
                {"role": "user", "content": words(10, 11, 12, 13)},
                {"role": "assistant", "content": words(20)},
                {"role": "user", "content": words(30, 31, 32)},
            ],
        },
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
