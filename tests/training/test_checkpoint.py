"""Checkpoints: round trip, what is (not) saved, and refusal on a target that does not fit."""

from __future__ import annotations

import json

import pytest
import torch
from jetflow.core.errors import CheckpointMismatchError, DataError
from jetflow.drafters.checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    load_checkpoint,
    load_weights,
    read_checkpoint,
    save_checkpoint,
)

from tests.drafters.tiny_heads import head_info, save_head, tiny_head


def test_round_trip_keeps_weights_and_describes_the_target(tiny_llama, tmp_path) -> None:
    head = tiny_head(tiny_llama)
    save_head(tmp_path, tiny_llama, head)
    info, state = load_checkpoint(tmp_path, tiny_llama, drafter="jetflow")
    assert info.drafter == "jetflow"
    assert info.architecture == head.config.model_dump(mode="json")
    assert info.target | {} == {
        "name": "tiny-llama",
        **tiny_llama.fingerprint(),
        "feature_layers": [1, 2, 3],
    }
    assert state.keys() == head.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in head.state_dict().items())
    raw = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert raw["format"] == 1 and {"recipe", "data", "state"} <= raw.keys()


def test_shipping_in_fp16_halves_the_file_and_keeps_values(tiny_llama, tmp_path) -> None:
    head = tiny_head(tiny_llama)
    save_head(tmp_path / "fp32", tiny_llama, head)
    save_head(tmp_path / "fp16", tiny_llama, head, dtype=torch.float16)
    _, state = read_checkpoint(tmp_path / "fp16")
    assert all(t.dtype == torch.float16 for t in state.values())
    size = {name: (tmp_path / name / WEIGHTS_FILE).stat().st_size for name in ("fp32", "fp16")}
    assert size["fp16"] < 0.6 * size["fp32"]
    restored = tiny_head(tiny_llama, seed=1)
    load_weights(restored, state, tmp_path / "fp16")
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(restored.state_dict()[name], tensor, atol=1e-3, rtol=1e-3)


def _save_with_target(tmp_path, target, **changes):
    head = tiny_head(target)
    info = head_info(target, head)
    info = type(info)(**{**info.__dict__, "target": info.target | changes})
    return save_checkpoint(tmp_path, head, info)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", 128),
        ("vocab_size", 49152),
        ("tokenizer_hash", "0123456789abcdef"),
        ("num_layers", 30),
        ("architecture", "qwen3"),
    ],
)
def test_a_checkpoint_for_another_target_is_refused_naming_the_difference(
    tiny_llama, tmp_path, field, value
) -> None:
    folder = _save_with_target(tmp_path, tiny_llama, **{field: value})
    with pytest.raises(CheckpointMismatchError, match=field) as caught:
        load_checkpoint(folder, tiny_llama)
    message = str(caught.value)
    assert f"checkpoint {value!r}" in message
    assert "does not fit target 'tiny-llama'" in message


def test_feature_layers_beyond_the_target_are_refused(tiny_llama, tmp_path) -> None:
    folder = _save_with_target(tmp_path, tiny_llama, feature_layers=[1, 8, 14])
    with pytest.raises(CheckpointMismatchError, match=r"feature_layers \[8, 14\] do not exist in a 4-layer"):
        load_checkpoint(folder, tiny_llama)


def test_layers_the_caller_feeds_must_be_the_trained_ones(tiny_llama, tmp_path) -> None:
    save_head(tmp_path, tiny_llama, tiny_head(tiny_llama))
    with pytest.raises(
        CheckpointMismatchError, match=r"feature_layers: checkpoint \[1, 2, 3\], target \[1, 2\]"
    ):
        load_checkpoint(tmp_path, tiny_llama, feature_layers=(1, 2))


def test_a_really_different_target_is_refused(tiny_llama, tmp_path) -> None:
    """A head of a 64-wide, 256-token target on a 32-wide, 300-token one: both differences named."""
    from jetflow.core.target import Target
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import tiny_tokenizer

    save_head(tmp_path, tiny_llama, tiny_head(tiny_llama))
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    other = Target(LlamaForCausalLM(config), tiny_tokenizer(), "other")
    with pytest.raises(CheckpointMismatchError) as caught:
        load_checkpoint(tmp_path, other)
    assert "hidden_size: checkpoint 64, target 32" in str(caught.value)
    assert "vocab_size: checkpoint 256, target 300" in str(caught.value)


def test_missing_or_corrupt_files_are_clear_errors(tiny_llama, tmp_path) -> None:
    with pytest.raises(DataError, match=r"config\.json not found"):
        read_checkpoint(tmp_path / "nowhere")
    folder = save_head(tmp_path / "ok", tiny_llama, tiny_head(tiny_llama))
    (folder / WEIGHTS_FILE).write_bytes((folder / WEIGHTS_FILE).read_bytes()[:100])
    with pytest.raises(DataError, match="unreadable"):
        read_checkpoint(folder)
    (folder / CONFIG_FILE).write_text("{not json")
    with pytest.raises(DataError, match="malformed"):
        read_checkpoint(folder)


def test_weights_that_do_not_fit_the_architecture_are_a_clear_error(tiny_llama, tmp_path) -> None:
    folder = save_head(tmp_path, tiny_llama, tiny_head(tiny_llama, num_layers=2))
    _, state = read_checkpoint(folder)
    with pytest.raises(DataError, match="does not match its own architecture"):
        load_weights(tiny_head(tiny_llama, num_layers=1), state, folder)
