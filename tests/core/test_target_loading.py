"""Loading a target: what is missing or damaged is said in words (a TargetError), never a
traceback from the hub client or from safetensors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from jetflow.core.errors import TargetError
from jetflow.core.target import Target

from ..conftest import make_tiny_target


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny Llama saved as a standard Hugging Face folder."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    target = make_tiny_target("llama")
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return folder


def test_a_saved_folder_loads(tiny_folder: Path) -> None:
    assert Target.load(str(tiny_folder)).vocab_size == make_tiny_target("llama").vocab_size


@pytest.mark.parametrize("spec", ["./no/such/model", "/no/such/model", "~/no-such-model", "a/b/c", "x--y/z"])
def test_a_path_that_does_not_exist_is_no_such_folder(spec: str) -> None:
    with pytest.raises(TargetError, match=rf"^target '{re.escape(spec)}': no such folder or file$"):
        Target.load(spec)


def test_a_hub_id_not_in_the_cache_says_jetflow_never_downloads() -> None:
    with pytest.raises(
        TargetError, match="neither a folder here nor a hub model in the local cache; jetflow never"
    ):
        Target.load("no-such-org/no-such-model")


def test_a_file_is_not_a_target(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(
        TargetError, match=r"is a file; a target is a model folder, a \.gguf file or a cached"
    ):
        Target.load(str(tmp_path / "notes.txt"))


def test_truncated_weights_are_named_as_damaged(tiny_folder: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for file in tiny_folder.iterdir():
        data = file.read_bytes()
        (damaged / file.name).write_bytes(data[: len(data) // 2] if file.suffix == ".safetensors" else data)
    weights = damaged / "model.safetensors"
    with pytest.raises(
        TargetError, match=rf"damaged weights \({re.escape(str(weights))}\): truncated or not safetensors"
    ):
        Target.load(str(damaged))
