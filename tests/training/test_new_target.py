"""The whole path for a target jetflow has never seen, through the CLI: tiny random base models
(no chat template) saved as model folders are regenerated, trained online, decoded losslessly
with the head, benched against plain decoding and exported where vLLM's format can hold the head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jetflow.cli.main import main
from jetflow.drafters.checkpoint import read_checkpoint
from jetflow.drafters.training.corpus import Corpus

from tests.conftest import make_tiny_target

PROMPTS = ["w3 w4 w5", "w7 w8", "w9 w10 w11 w12", "w13 w14", "w20 w21 w22"]
#: the shipped recipe's head less the two inputs vLLM's DFlash model has no place for
EXPORTABLE_LAYOUT = ["--set", "head.anchored_slots=false", "--set", "head.context_tokens=false"]


@pytest.fixture
def isolated_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Derived files (feature caches, calibrations) go to a folder of this test alone."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("JETFLOW_CACHE", str(cache))
    return cache


def saved_base_model(architecture: str, folder: Path) -> str:
    """A tiny random target of ``architecture`` saved as a model folder, without a chat template."""
    target = make_tiny_target(architecture, seed=3)
    assert not target.has_chat_template
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return str(folder)


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def regenerated_corpus(target: str, folder: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Four conversations answered by ``target`` (tokens only: online training needs no features)."""
    prompts = folder.parent / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    regenerate = ["data", "regenerate", "--target", target, "--source", f"file:{prompts}", "--n", "4"]
    regenerate += ["--max-new-tokens", "24", "--no-features", "--threads", "1", "--out", str(folder)]
    assert main(regenerate) == 0
    assert "4 conversations" in capsys.readouterr().out
    return str(folder)


def trained_online(
    target: str, corpus: str, out: Path, capsys: pytest.CaptureFixture[str], settings: list[str]
) -> str:
    """Three online steps of the shipped jetflow recipe (under ``settings``); the final head's folder."""
    train = ["train", "--target", target, "--drafter", "jetflow", "--online", "--steps", "3"]
    train += ["--corpus", corpus, "--out", str(out), "--threads", "1", *settings]
    summary = run_json(train, capsys)
    assert summary["steps"] == 3 and summary["agreement"]
    return str(summary["checkpoint"])


@pytest.mark.parametrize(
    ("architecture", "target_dtype"), [("qwen3_moe", "bfloat16"), ("qwen3", "float32"), ("llama", "float32")]
)
def test_a_new_base_model_from_folder_to_a_lossless_head(
    architecture: str,
    target_dtype: str,
    isolated_cache: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    target = saved_base_model(architecture, tmp_path / "model")
    corpus = regenerated_corpus(target, tmp_path / "corpus", capsys)
    assert Corpus(Path(corpus)).manifest["settings"]["chat_template"] is False, "a base model: raw prompts"

    settings = [*EXPORTABLE_LAYOUT, "--set", f'target_dtype="{target_dtype}"']
    head = trained_online(target, corpus, tmp_path / "run", capsys, settings)
    assert not (isolated_cache / "features").exists(), "online training writes no feature cache"
    info, _ = read_checkpoint(head)
    assert info.data["features"] == "online" and info.data["features_computed_in"] == [target_dtype]

    config = tmp_path / "generate.toml"
    config.write_text(f'[drafter_params]\ncheckpoint = "{head}"\n')
    generate = ["generate", "--target", target, "--prompt", "w3 w4 w5", "--max-new-tokens", "24"]
    generate += ["--budget", "4", "--no-compile", "--threads", "1"]
    plain = run_json([*generate, "--drafter", "none"], capsys)
    drafted = run_json([*generate, "--config", str(config), "--drafter", "jetflow"], capsys)
    assert drafted["text"] == plain["text"], "decoding with the head is lossless"

    bench_config = tmp_path / "bench.toml"
    bench_config.write_text(f'baselines = []\n[drafter_params.jetflow]\ncheckpoint = "{head}"\n')
    bench = ["bench", "--config", str(bench_config), "--target", target, "--drafters", "jetflow"]
    bench += ["--datasets", f"file:{tmp_path / 'prompts.jsonl'}", "--limit", "2", "--budgets", "4"]
    bench += ["--max-new-tokens", "8", "--threads", "1", "--no-progress", "--out", str(tmp_path / "bench")]
    assert main(bench) == 0, capsys.readouterr().err
    runs = json.loads((tmp_path / "bench" / "results.json").read_text())["runs"]
    assert {run["method"] for run in runs} >= {"ar", "jetflow"}
    assert all(run["lossless"] for run in runs), "the bench finds every run lossless"

    export = ["export", "--drafter", "jetflow", "--checkpoint", head, "--target", target]
    assert main([*export, "--out", str(tmp_path / "exported")]) == 0, capsys.readouterr().err
    assert (tmp_path / "exported" / "config.json").is_file()


def test_a_head_vllm_cannot_hold_is_refused_in_words(
    isolated_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shipped recipe's own head trains for a new target, but no vLLM format holds its layout."""
    target = saved_base_model("qwen3", tmp_path / "model")
    corpus = regenerated_corpus(target, tmp_path / "corpus", capsys)
    head = trained_online(target, corpus, tmp_path / "run", capsys, [])
    export = ["export", "--drafter", "jetflow", "--checkpoint", head, "--target", target]
    assert main([*export, "--out", str(tmp_path / "exported")]) == 2
    assert "cannot be exported faithfully" in capsys.readouterr().err
    assert not (tmp_path / "exported" / "config.json").exists()
