"""``jetflow calibrate`` and ``--budget auto`` end to end on a tiny saved target (seconds).

Timings are never asserted: only the shape of the output and that every command agrees on
the chosen budget.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from jetflow.cli.main import main
from jetflow.core.cost_model import CHOICE_TOLERANCE, choose_budget
from jetflow.core.target import Target

from tests.conftest import make_tiny_target

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("tiny-chat-target")
    target = make_tiny_target("llama")
    target.tokenizer.chat_template = CHAT_TEMPLATE
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path))


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _calibrate(capsys, target_dir: str, *extra: str) -> tuple[int, dict, str]:
    code, out, err = _run(
        capsys,
        *("calibrate", "--target", target_dir, "--dtype", "float32", "--drafter", "ngram"),
        *("--budgets", "1,2,4", "--prompts", "2", "--max-new-tokens", "8", "--repeats", "1", "--json"),
        *extra,
    )
    return code, (json.loads(out) if code == 0 else {}), err


def _generate(capsys, target_dir: str, *extra: str) -> tuple[int, dict, str]:
    code, out, err = _run(
        capsys,
        *("generate", "--target", target_dir, "--dtype", "float32", "--drafter", "ngram"),
        *("--prompt", "w3 w4 w5 w3 w4 w5 w3", "--max-new-tokens", "6", "--json"),
        *extra,
    )
    return code, (json.loads(out) if code == 0 else {}), err


def test_calibrate_json_then_auto_budget_everywhere(capsys, target_dir: str) -> None:
    code, payload, _ = _calibrate(capsys, target_dir)
    assert code == 0
    speeds = payload["expected_tokens_per_s"]
    assert set(speeds) == {"0", "1", "2", "4"} and all(isinstance(v, float) for v in speeds.values())
    assert isinstance(payload["budget"], int)
    budgets = sorted(int(b) for b in speeds)  # the rule, not the argmax: near-ties go to the smaller
    rule = choose_budget(budgets, [speeds[str(b)] for b in budgets], CHOICE_TOLERANCE)
    assert payload["budget"] == rule
    assert set(payload["tau"]) == set(payload["draft_ms"]) == set(payload["verify_ms"]) == set(speeds)
    assert payload["verify_latency_ms"].keys() >= {"1", "5"}
    assert payload["cached"] is False and Path(payload["path"]).is_file()

    for budget_flags in (["--budget", "auto"], []):
        code, result, _ = _generate(capsys, target_dir, *budget_flags, "--no-adapt")
        assert code == 0 and result["stats"]["budget"] == payload["budget"]
        assert result["stats"]["budgets"] == {str(payload["budget"]): result["stats"]["steps"]}
        code, result, _ = _generate(capsys, target_dir, *budget_flags)  # adaptive: calibrated candidates
        assert code == 0 and set(result["stats"]["budgets"]) <= set(speeds)
        assert str(result["stats"]["budget"]) in result["stats"]["budgets"]
    code, result, _ = _generate(capsys, target_dir, "--budget", "7")
    assert code == 0 and result["stats"]["budget"] == 7

    code, again, _ = _calibrate(capsys, target_dir)
    assert code == 0 and again["cached"] is True and again["budget"] == payload["budget"]
    assert again["expected_tokens_per_s"] == speeds
    code, forced, _ = _calibrate(capsys, target_dir, "--force")
    assert code == 0 and forced["cached"] is False


def test_a_corrupt_cache_is_measured_again(capsys, target_dir: str) -> None:
    code, payload, _ = _calibrate(capsys, target_dir)
    Path(payload["path"]).write_text("{truncated")
    code, _, err = _generate(capsys, target_dir, "--budget", "auto")
    assert code == 2 and "unreadable" in err and err.count("\n") == 1
    code, again, err = _calibrate(capsys, target_dir)
    assert code == 0 and again["cached"] is False and "measuring again" in err
    assert json.loads(Path(payload["path"]).read_text())["budget"] == again["budget"]


def test_the_table_names_the_choice_and_why(capsys, target_dir: str) -> None:
    code, payload, _ = _calibrate(capsys, target_dir)
    code, out, _ = _run(
        capsys, "calibrate", "--target", target_dir, "--dtype", "float32", "--drafter", "ngram"
    )
    assert code == 0
    assert f"chosen: budget {payload['budget']}" in out and "expected tokens/s" in out
    assert "cached from" in out and "no drafter:" in out


def test_budget_auto_without_calibration_says_what_to_run(capsys, target_dir: str) -> None:
    code, _, err = _generate(capsys, target_dir, "--budget", "auto")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "jetflow calibrate --drafter ngram" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["calibrate", "--budgets", "0,4"], "--budgets"),
        (["calibrate", "--budgets", "4,x"], "--budgets"),
        (["calibrate", "--drafter", "none"], "needs a drafter"),
        (["calibrate", "--drafter", "nope"], "unknown drafter 'nope'"),
        (["calibrate", "--prompts", "0"], "--prompts"),
        (["calibrate", "--threads", "0"], "--threads"),
        (["generate", "--prompt", "hi", "--budget", "bad"], "tree.budget"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_loading(
    capsys, monkeypatch: pytest.MonkeyPatch, argv: list[str], message: str
) -> None:
    def refuse(*_args, **_kwargs):
        raise AssertionError("the target must not load for bad input")

    monkeypatch.setattr(Target, "load", refuse)
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("jetflow: error: ") and message in err
    assert err.count("\n") == 1


def test_generate_names_the_budget_and_where_it_came_from(capsys, target_dir: str) -> None:
    base = ("generate", "--target", target_dir, "--dtype", "float32", "--drafter", "ngram")
    base += ("--prompt", "w3 w4 w5 w3 w4 w5 w3", "--max-new-tokens", "6")
    code, out, _ = _run(capsys, *base, "--budget", "7")
    assert code == 0 and "[ngram:best-first B=7 (fixed)]" in out
    code, out, _ = _run(capsys, *base, "--budget", "0")
    assert code == 0 and "[ngram:best-first B=0 (fixed, no drafting)]" in out
    code, payload, _ = _calibrate(capsys, target_dir)
    code, out, _ = _run(capsys, *base, "--no-adapt")
    assert code == 0 and f"B={payload['budget']} (calibrated" in out
    code, out, _ = _run(capsys, *base)
    assert code == 0 and re.search(r"\[ngram:best-first B=\d+ \(adaptive: (\d+x\d+ ?)+\)\]", out)
