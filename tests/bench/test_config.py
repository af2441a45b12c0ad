"""Bench configs: TOML files, overrides, and every bad name caught before a model loads."""

from __future__ import annotations

from pathlib import Path

import pytest
from jetflow.bench.config import BenchConfig, DrafterSpec, load_bench_config
from jetflow.bench.suite import bench_cases
from jetflow.core.errors import ConfigError, PluginNotFoundError

CONFIGS = Path(__file__).resolve().parents[2] / "bench" / "configs"


def test_shipped_configs_are_valid() -> None:
    paths = sorted(CONFIGS.glob("*.toml"))
    assert paths, "bench/configs holds at least one example"
    for path in paths:
        assert isinstance(load_bench_config(path), BenchConfig)


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bench.toml"
    path.write_text('drafters = ["ngram:chain"]\nlimit = 5\n[tree]\nwidth = 2\n')
    config = load_bench_config(path, {"limit": 2, "budgets": [4]})
    assert (config.limit, config.budgets, config.drafters) == (2, (4,), ("ngram:chain",))
    assert config.tree.width == 2 and config.tree.max_depth == 16
    assert config.datasets == ("champ", "humaneval", "mtbench")


def test_a_config_extends_its_base_and_replaces_lists_whole(tmp_path: Path) -> None:
    (tmp_path / "full.toml").write_text(
        'drafters = ["ngram", "ngram:chain"]\nbudgets = [4, 8, 16]\nlimit = 20\n[tree]\nwidth = 2\n'
    )
    subset = tmp_path / "subset.toml"
    subset.write_text('base = "full.toml"\ndrafters = ["ngram"]\n[tree]\nmax_depth = 6\n')
    config = load_bench_config(subset, {"limit": 3})
    assert (config.drafters, config.budgets, config.limit) == (("ngram",), (4, 8, 16), 3)
    assert (config.tree.width, config.tree.max_depth) == (2, 6)
    subset.write_text('base = "subset.toml"\n')
    with pytest.raises(ConfigError, match="in a circle"):
        load_bench_config(subset)


@pytest.mark.parametrize(
    ("text", "drafter", "policy", "method"),
    [("ngram", "ngram", None, "ngram"), ("ngram:chain", "ngram", "chain", "ngram:chain")],
)
def test_drafter_spec(text: str, drafter: str, policy: str | None, method: str) -> None:
    spec = DrafterSpec.parse(text)
    assert (spec.drafter, spec.policy, spec.method) == (drafter, policy, method)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"drafters": ["nope"]}, "unknown drafter 'nope'; known drafters: .*ngram"),
        ({"drafters": ["ngram:zigzag"]}, "unknown tree policy 'zigzag'"),
        ({"drafters": ["ngram:"]}, "is not 'name' or 'name:policy'"),
        ({"drafters": ["ngram", "ngram"]}, "ngram listed more than once"),
        ({"datasets": ["gsm8k"]}, "unknown dataset 'gsm8k'; known datasets: champ"),
        ({"baselines": ["vllm"]}, "unknown baseline 'vllm'"),
        ({"budgets": [-1]}, "budgets"),
        ({"budgets": [8, 8]}, "listed twice"),
        ({"budgets": []}, "budgets"),
        ({"limit": 0}, "limit"),
        ({"dtype": "int8"}, "dtype"),
        ({"drafter_params": {"ngram": {"max_ngram": 0}}}, "drafter_params.ngram.max_ngram"),
        ({"drafter_params": {"eagle": {}}}, "drafter_params for drafters not in the run: eagle"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_values_are_config_errors(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_bench_config(None, overrides)


def test_unknown_drafter_lists_the_installed_ones() -> None:
    with pytest.raises(PluginNotFoundError) as caught:
        load_bench_config(None, {"drafters": ["ngram", "nosuch:chain"]})
    assert caught.value.name == "nosuch" and "ngram" in caught.value.known


def test_file_datasets_are_accepted_by_name() -> None:
    assert load_bench_config(None, {"datasets": ["file:prompts.jsonl"]}).datasets == ("file:prompts.jsonl",)


def test_suite_cases_cover_methods_by_data_set() -> None:
    config = load_bench_config(None, {"datasets": ["champ", "mtbench"], "budgets": [8, 16]})
    ids = [case.id for case in bench_cases(config)]
    assert ids == [
        "champ-ar",
        "champ-hf-generate",
        "champ-hf-prompt-lookup",
        "champ-ngram-B8",
        "champ-ngram-B16",
        "mtbench-ar",
        "mtbench-hf-generate",
        "mtbench-hf-prompt-lookup",
        "mtbench-ngram-B8",
        "mtbench-ngram-B16",
    ]


def test_a_variant_runs_its_drafter_under_its_own_name_with_its_own_params(tmp_path: Path) -> None:
    path = tmp_path / "bench.toml"
    path.write_text(
        'drafters = ["ngram", "short:chain"]\n'
        "[drafter_params.ngram]\nmax_ngram = 3\n"
        '[variants.short]\ndrafter = "ngram"\nparams = { max_ngram = 2 }\n'
    )
    config = load_bench_config(path)
    plain, short = config.drafter_specs
    assert (short.drafter, short.policy, short.method) == ("ngram", "chain", "short:chain")
    assert config.params_of(plain)["max_ngram"] == 3 and config.params_of(short)["max_ngram"] == 2


def test_a_variant_with_bad_params_names_its_section(tmp_path: Path) -> None:
    path = tmp_path / "bench.toml"
    path.write_text('drafters = ["v"]\n[variants.v]\ndrafter = "ngram"\nparams = { nope = 1 }\n')
    with pytest.raises(ConfigError, match=r"variants\.v\.params\.nope"):
        load_bench_config(path)
