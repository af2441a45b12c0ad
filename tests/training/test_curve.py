"""Learning curves: cumulative training time over resumes, where the held-out loss settled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jetflow.cli.main import main
from jetflow.core.errors import DataError
from jetflow.drafters.training.curve import CURVE_PLOT, convergence, read_curve


def _write_log(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train_log.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return folder


def _eval(step: int, loss: float) -> dict:
    return {"step": step, "eval": True, "eval_loss": loss, "agreement": [0.3, 0.2], "chain_accept": 0.4}


LOSSES = {10: 5.0, 20: 4.0, 30: 3.5, 40: 3.33, 50: 3.31, 60: 3.30}


def _records(restart_at: int | None = None) -> list[dict]:
    """A log of 60 steps at 2 s each; ``restart_at``: an older trainer's clock restarted there."""
    records = []
    for step, loss in LOSSES.items():
        elapsed = 2.0 * step if restart_at is None or step <= restart_at else 2.0 * (step - restart_at)
        records += [{"step": step, "loss": loss, "elapsed_s": elapsed}, _eval(step, loss)]
    return records


@pytest.mark.parametrize("restart_at", [None, 30])
def test_training_time_is_cumulative_and_the_plateau_is_found(tmp_path: Path, restart_at: int | None) -> None:
    points = read_curve(_write_log(tmp_path, _records(restart_at)))
    assert [point.train_s for point in points] == [20.0, 40.0, 60.0, 80.0, 100.0, 120.0]
    settled = convergence(points, tolerance=0.01)
    assert (settled.step, settled.train_s, settled.final_step) == (40, 80.0, 60)  # 3.33 is within 1% of 3.30
    assert convergence(points, tolerance=0.001).step == 60


def test_curve_command_writes_the_plot_and_reports_json(tmp_path: Path, capsys) -> None:
    run = _write_log(tmp_path / "run", _records())
    assert main(["curve", str(run), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["converged_step"] == 40 and summary["final_train_s"] == 120.0
    assert (run / CURVE_PLOT).stat().st_size > 0


def test_a_missing_or_broken_log_is_a_clear_error(tmp_path: Path, capsys) -> None:
    with pytest.raises(DataError, match="no training log"):
        read_curve(tmp_path)
    (tmp_path / "train_log.jsonl").write_text(json.dumps(_eval(10, 5.0)) + '\n{"step": 2')
    with pytest.raises(DataError, match="line 2 is not JSON"):
        read_curve(tmp_path)
    assert main(["curve", str(tmp_path / "nowhere")]) == 2
    assert "no training log" in capsys.readouterr().err


def test_several_runs_compare_in_one_table_and_one_plot(tmp_path: Path, capsys) -> None:
    small = _write_log(tmp_path / "data-3k", _records())
    lower = [r | {"eval_loss": r["eval_loss"] - 1} if r.get("eval") else r for r in _records()]
    large = _write_log(tmp_path / "layers-2", lower)
    plot = tmp_path / "scaling.png"
    assert main(["curve", str(small), str(large), "--plot", str(plot)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| run | steps | train min | held-out loss | d1 | d2 | d3 | d4 | chain |")
    assert table[2] == "| data-3k | 60 | 2.0 | 3.3000 | 0.300 | 0.200 | - | - | 0.400 |"
    assert table[3].startswith("| layers-2 | 60 | 2.0 | 2.3000 |")
    assert plot.is_file()
    assert main(["curve", str(small), str(tmp_path / "x" / "data-3k")]) == 2
    assert "distinct folder names" in capsys.readouterr().err
