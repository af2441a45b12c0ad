"""``jetflow train``: the command wires config, drafter, target, store and trainer together."""

from __future__ import annotations

import json
from pathlib import Path

from jetflow.cli import main as cli
from jetflow.cli import train as train_cli
from jetflow.drafters.checkpoint import load_checkpoint
from jetflow.drafters.jetflow.plugin import JetFlowDrafter
from jetflow.drafters.training import TrainConfig


def test_train_command_trains_and_ships_a_head(
    tiny_world, tiny_llama, ticking_clock, tmp_path, capsys
) -> None:
    config = tmp_path / "train.toml"
    config.write_text(
        "steps = 6\nbatch_sequences = 2\nanchors_per_sequence = 8\nholdout_sequences = 4\n"
        "[head]\nnum_layers = 1\nblock_size = 4\nfeature_layers = [1, 2, 3]\n"
    )
    code = cli.main(
        ["train", "--drafter", "jetflow", "--config", str(config), "--out", str(tmp_path / "run"), "--json"]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 6 and len(summary["agreement"]) == 3
    assert summary["final_step"] == 6 and 0 < summary["converged_step"] <= 6
    assert summary["train_s"] >= summary["wall_s"] > 0  # a fresh run: all its time is this run's
    assert (tmp_path / "run" / "learning_curve.png").is_file()
    info, _ = load_checkpoint(summary["checkpoint"], tiny_llama, drafter="jetflow")
    assert info.architecture["causal"] is True and info.architecture["block_size"] == 4
    # the recipe names the data the head saw, not the defaults that chose it
    corpus, eval_corpus = info.recipe["corpus"], info.recipe["eval_corpus"]
    assert [Path(c).name for c in corpus] == ["SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct-turn2"]
    assert Path(eval_corpus).name == "SmolLM2-135M-Instruct-heldout"

    warm = ["--warm-start", summary["checkpoint"], "--steps", "9", "--out", str(tmp_path / "warm")]
    assert cli.main(["train", "--drafter", "jetflow", "--config", str(config), *warm, "--json"]) == 0
    continued = json.loads(capsys.readouterr().out)
    assert continued["steps"] == 9
    # a warm start goes on counting from the time its checkpoint records
    assert continued["train_s"] >= info.state["train_s"] + continued["wall_s"] > continued["wall_s"]


def test_a_drafter_without_a_head_cannot_be_trained(tiny_world, tmp_path, capsys) -> None:
    (tmp_path / "t.toml").write_text("steps = 1\n")
    assert cli.main(["train", "--drafter", "no-such", "--config", str(tmp_path / "t.toml")]) == 2
    assert "unknown drafter 'no-such'" in capsys.readouterr().err


def test_the_shipped_recipe_is_a_valid_config() -> None:
    config = TrainConfig.from_toml(JetFlowDrafter.default_train_config())
    assert config.drafter == "jetflow" and config.loss.kind == "sft"


def test_a_recipe_naming_one_corpus_reads_as_a_list_of_one(tmp_path) -> None:
    recipe = tmp_path / "train.toml"
    recipe.write_text('corpus = "corpora/one"\n')
    assert TrainConfig.from_toml(recipe).corpus == ["corpora/one"]
    assert TrainConfig.from_toml(recipe, corpus=["a", "b"]).corpus == ["a", "b"]


def test_set_overrides_nested_values_and_a_typo_is_a_clear_error(
    tiny_world, tiny_llama, tmp_path, capsys
) -> None:
    config = tmp_path / "train.toml"
    config.write_text(
        "steps = 50\nbatch_sequences = 2\nanchors_per_sequence = 8\nholdout_sequences = 4\n"
        "[head]\nnum_layers = 1\nblock_size = 4\nfeature_layers = [1, 2, 3]\n"
    )
    out = tmp_path / "run"
    argv = ["train", "--drafter", "jetflow", "--config", str(config), "--out", str(out), "--json"]
    settings = [
        "--set",
        "steps=3",
        "--set",
        "loss.kind=sft",
        "--set",
        "head.block_size=3",
        "--set",
        "max_sequences=10",
    ]
    assert cli.main([*argv, *settings]) == 0
    summary = json.loads(capsys.readouterr().out)
    info, _ = load_checkpoint(summary["checkpoint"], tiny_llama, drafter="jetflow")
    assert summary["steps"] == 3 and info.recipe["loss"]["kind"] == "sft"
    assert info.architecture["block_size"] == 3
    assert info.data["train_sequences"] + info.data["holdout_sequences"] == 10
    assert cli.main([*argv, "--set", "loss.kind=kl"]) == 2
    assert "loss.kind" in capsys.readouterr().err
    assert cli.main([*argv, "--set", "nonsense"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_parse_settings_reads_toml_values_and_bare_words() -> None:
    assert train_cli.parse_settings(["a.b=3", "a.c=true", "d=[1, 2]", "e=sft", 'f="x y"']) == {
        "a": {"b": 3, "c": True},
        "d": [1, 2],
        "e": "sft",
        "f": "x y",
    }
