"""``jetflow generate`` sampling flags: they reach the verifier's params, and bad values are one line."""

from __future__ import annotations

import pytest
from jetflow.cli.generate import config_from_args
from jetflow.cli.main import build_parser, main


def test_flags_map_into_the_verifier_params() -> None:
    sampling = ["--temperature", "0.7", "--top-p", "0.9", "--top-k", "20"]
    args = build_parser().parse_args(
        ["generate", "--prompt", "hi", "--verifier", "sampling", *sampling, "--seed", "5"]
    )
    config = config_from_args(args)
    assert config.verifier == "sampling" and config.seed == 5
    assert config.verifier_params == {"temperature": 0.7, "top_p": 0.9, "top_k": 20}


def test_flags_override_the_config_file(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('verifier = "sampling"\n[verifier_params]\ntemperature = 0.5\ntop_k = 8\n')
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--config", str(path), "--top-k", "3"])
    assert config_from_args(args).verifier_params == {"temperature": 0.5, "top_k": 3}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--verifier", "sampling", "--temperature", "0"], "temperature: Input should be greater than 0"),
        (["--verifier", "sampling", "--top-p", "1.5"], "top_p: Input should be less than or equal to 1"),
        (["--verifier", "sampling", "--top-k", "-1"], "top_k"),
        (["--temperature", "0.7"], "--temperature: not a parameter of the 'greedy' verifier"),
        (["--verifier", "greedy", "--top-p", "0.9", "--top-k", "4"], "--top-p, --top-k: not a parameter"),
    ],
)
def test_bad_sampling_flags_are_one_line_errors(capsys, argv: list[str], message: str) -> None:
    code = main(["generate", "--prompt", "hello", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("jetflow: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
