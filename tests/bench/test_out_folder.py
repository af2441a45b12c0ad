"""One bench run per ``--out`` (resumed runs share it), and no silent replacement of results
measured with other settings."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from jetflow.bench.out_lock import hold_out_folder
from jetflow.bench.results import BenchResults, refuse_other_results
from jetflow.cli.main import main
from jetflow.core.errors import ConfigError
from jetflow.core.target import Target

from .test_cli_bench import _argv


@pytest.mark.parametrize(("first", "second"), [(False, False), (False, True), (True, False)])
def test_a_held_folder_refuses_a_second_run_naming_the_holder(
    tmp_path: Path, first: bool, second: bool
) -> None:
    holder = rf"is in use by another bench run \(pid {os.getpid()}\); use another"
    with (
        hold_out_folder(tmp_path, shared=first),
        pytest.raises(ConfigError, match=holder),
        hold_out_folder(tmp_path, shared=second),
    ):
        pass


def test_resumed_runs_share_a_folder_and_a_finished_run_lets_it_go(tmp_path: Path) -> None:
    with hold_out_folder(tmp_path, shared=True), hold_out_folder(tmp_path, shared=True):
        pass
    with hold_out_folder(tmp_path, shared=False):
        pass


def _saved(folder: Path, **settings: object) -> Path:
    path = folder / "results.json"
    BenchResults({"cpu": "test"}, "tiny", {"out": str(folder), "command": "x", **settings}).write_json(path)
    return path


def test_results_of_the_same_settings_may_be_measured_again(tmp_path: Path) -> None:
    path = _saved(tmp_path, budgets=[4], datasets=["champ"])
    refuse_other_results(path, {"budgets": [4], "datasets": ["champ"], "out": "elsewhere"})
    refuse_other_results(tmp_path / "none.json", {"budgets": [8]})


@pytest.mark.parametrize(
    ("config", "shown"),
    [
        ({"budgets": [8], "datasets": ["champ"]}, "budgets ([4] -> [8])"),
        ({"budgets": [4], "datasets": ["humaneval"]}, "datasets (['champ'] -> ['humaneval'])"),
    ],
)
def test_results_of_other_settings_are_not_replaced_silently(
    tmp_path: Path, config: dict, shown: str
) -> None:
    path = _saved(tmp_path, budgets=[4], datasets=["champ"])
    with pytest.raises(ConfigError) as caught:
        refuse_other_results(path, config)
    assert str(caught.value) == (
        f"{tmp_path} holds results measured with other settings: {shown}; pass --resume to add to "
        "them, --overwrite to replace them, or choose another --out"
    )


def test_an_unreadable_results_file_is_not_replaced_silently(tmp_path: Path) -> None:
    (tmp_path / "results.json").write_text("{")
    with pytest.raises(
        ConfigError, match=r"not a complete jetflow results file .*; pass --resume .* --overwrite"
    ):
        refuse_other_results(tmp_path / "results.json", {})


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args, **_kwargs):
        raise AssertionError("the target must not load")

    monkeypatch.setattr(Target, "load", refuse)


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_a_second_bench_on_a_held_out_fails_at_once(
    capsys: pytest.CaptureFixture[str], no_model_load: None, tmp_path: Path, prompt_file: Path
) -> None:
    with hold_out_folder(tmp_path, shared=False):  # as another process's run would
        err = _one_line_error(capsys, _argv(tmp_path / "target", prompt_file, tmp_path))
    assert f"{tmp_path} is in use by another bench run (pid {os.getpid()})" in err


def test_a_run_without_resume_refuses_results_of_other_settings_and_overwrite_replaces_them(
    capsys: pytest.CaptureFixture[str], tiny_target_dir: Path, prompt_file: Path, tmp_path: Path
) -> None:
    argv = _argv(tiny_target_dir, prompt_file, tmp_path)
    assert main(argv) == 0
    assert main(argv) == 0  # the same settings: measured again
    first = json.loads((tmp_path / "results.json").read_text())
    other = [*argv[: argv.index("--budgets") + 1], "8", *argv[argv.index("--budgets") + 2 :]]
    capsys.readouterr()
    err = _one_line_error(capsys, other)
    assert "holds results measured with other settings: budgets ([4] -> [8]); pass --resume" in err
    assert json.loads((tmp_path / "results.json").read_text()) == first
    assert main([*other, "--overwrite"]) == 0
    assert json.loads((tmp_path / "results.json").read_text())["settings"]["budgets"] == [8]
