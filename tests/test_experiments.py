"""The experiments folder stays a record a fresh clone can rerun, and never grows a head's weights.

Every experiment is a folder of ``experiments/`` with a README (what it asked, the command, the
table), its bench config and its results. A head an experiment measures is either rebuilt by a
make target into ``runs/`` or read from where the library keeps it, so results hold no weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from jetflow.bench.config import BenchConfig, load_bench_config

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
CONFIGS = sorted(EXPERIMENTS.glob("*/bench.toml"))
#: where a make target trains the heads an experiment measures (not committed)
RUNS = "runs/"


def test_every_experiment_has_a_readme() -> None:
    folders = [path for path in EXPERIMENTS.iterdir() if path.is_dir()]
    assert folders, "experiments/ holds at least one experiment"
    assert [path.name for path in folders if not (path / "README.md").is_file()] == []


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.parent.name)
def test_experiment_configs_are_valid(path: Path) -> None:
    assert isinstance(load_bench_config(path), BenchConfig)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.parent.name)
def test_experiment_heads_exist_or_are_trained_by_a_target(path: Path) -> None:
    config = load_bench_config(path)
    checkpoints = [str(variant.params["checkpoint"]) for variant in config.variants.values()]
    missing = [c for c in checkpoints if not c.startswith(RUNS) and not (ROOT / c / "config.json").is_file()]
    assert missing == [], f"{path.name} names heads neither in the tree nor under {RUNS}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.parent.name)
def test_experiment_results_are_written_inside_the_experiment(path: Path) -> None:
    out = Path(load_bench_config(path).out)
    assert out.parts[:2] == ("experiments", path.parent.name)


def test_no_head_weights_under_experiments() -> None:
    assert [str(p.relative_to(ROOT)) for p in EXPERIMENTS.rglob("*.safetensors")] == []
