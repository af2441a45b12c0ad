"""An output path that cannot be written is one line and exit code 2, before any model loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from jetflow.cli._options import new_output_path, writable_folder
from jetflow.cli.main import main
from jetflow.core.errors import ConfigError
from jetflow.core.target import Target


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args, **_kwargs):
        raise AssertionError("the target must not load for a bad --out")

    monkeypatch.setattr(Target, "load", refuse)


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text("not a folder")
    return path


def test_a_writable_folder_is_created_with_its_parents(tmp_path: Path) -> None:
    assert writable_folder(tmp_path / "a" / "b").is_dir()
    assert new_output_path(tmp_path / "c" / "export") == tmp_path / "c" / "export"
    assert (tmp_path / "c").is_dir() and not (tmp_path / "c" / "export").exists()


def test_a_folder_under_a_file_names_the_file(a_file: Path) -> None:
    file = re.escape(str(a_file))
    with pytest.raises(ConfigError, match=rf"cannot create or write this folder \({file} is a file\)"):
        writable_folder(a_file / "out")
    with pytest.raises(ConfigError, match=rf"cannot create or write its folder {file} \({file} is a file\)"):
        new_output_path(a_file / "out")
    with pytest.raises(ConfigError, match="a file is in the way"):
        new_output_path(a_file)


def test_a_folder_nothing_can_be_created_in_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"--out /proc/jetflow/out: cannot create or write this folder"):
        writable_folder("/proc/jetflow/out")


def _bench(out: Path | str) -> list[str]:
    return ["bench", "--drafters", "ngram", "--datasets", "humaneval", "--out", str(out), "--no-progress"]


def _export(out: Path | str) -> list[str]:
    return ["export", "--drafter", "jetflow", "--out", str(out)]


@pytest.mark.parametrize("command", [_bench, _export])
@pytest.mark.parametrize("under", ["a_file", "/proc/jetflow"])
def test_export_and_bench_refuse_an_out_they_cannot_write(
    capsys: pytest.CaptureFixture[str], no_model_load: None, a_file: Path, command, under: str
) -> None:
    out = (a_file if under == "a_file" else Path(under)) / "out"
    code = main(command(out))
    stdout, err = capsys.readouterr()
    assert (code, stdout) == (2, "")
    assert err.startswith(f"jetflow: error: --out {out}: cannot create or write")
    assert err.count("\n") == 1 and "Traceback" not in err
