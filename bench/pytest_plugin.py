"""pytest plugin: ``pytest --benchmark`` runs jetflow's comparison suite through pytest-benchmark.

Without ``--benchmark`` every benchmark is skipped, so the normal suite stays fast: a
benchmark is any test that uses pytest-benchmark's ``benchmark`` fixture or carries the
``jetflow_benchmark`` marker. pytest-benchmark owns the ``--benchmark-*`` options and
defines no bare ``--benchmark``, and pytest matches long options exactly (no prefix
abbreviation), so the two never clash: ``--benchmark-json``, ``--benchmark-compare`` and
``--benchmark-autosave`` keep working alongside it.

A test that asks for ``bench_case`` is parametrised over the suite's cases (data set x
method x budget, and batch size where the suite has a batch axis: ``--bench-batch-sizes``
or ``batch_sizes`` in the config); the session fixture ``bench_suite`` loads the target
once and holds each data set's ``ar`` reference. The defaults (:data:`SUITE_DEFAULTS`, 2 rounds: 12
benchmarks) took 11.4 minutes on the shared 2-core CPU this was written on (one torch
thread, load average ~4); a bench TOML given with ``--bench-config`` overrides them.

Everything heavy (torch, transformers) is imported only when a suite actually runs:
installed through an entry point, this module loads into every pytest session.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from jetflow.bench.config import BenchConfig
    from jetflow.bench.suite import BenchSuite

FLAG = "--benchmark"
MARKER = "jetflow_benchmark"
#: The pytest-scale comparison: 3 prompts per data set (12 turns in all, MT-Bench has two per
#: prompt), at most 48 new tokens per turn, one budget. Per data set each method times
#: ``--bench-rounds`` passes, plus one untimed reference pass of ``ar``.
SUITE_DEFAULTS: dict[str, Any] = {"limit": 3, "max_new_tokens": 48, "budgets": [16], "warmup_tokens": 8}
DEFAULT_ROUNDS = 2
_CONFIG_KEY = pytest.StashKey["BenchConfig"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("jetflow-bench", "jetflow comparison benchmarks")
    group.addoption(
        FLAG,
        action="store_true",
        default=False,
        dest="jetflow_benchmark",
        help="run jetflow's benchmarks (tests using the `benchmark` fixture); skipped otherwise",
    )
    group.addoption(
        "--bench-config",
        dest="jetflow_bench_config",
        metavar="TOML",
        default=None,
        help="bench config (jetflow bench format) for the comparison suite; "
        f"default: the bench defaults with {SUITE_DEFAULTS}",
    )
    group.addoption(
        "--bench-batch-sizes",
        dest="jetflow_bench_batch_sizes",
        metavar="B,B,...",
        default=None,
        help="give the comparison suite a batch axis (over the config's batch_sizes): each case "
        "decodes every prompt that many at a time, against batched ar at that size",
    )
    group.addoption(
        "--bench-rounds",
        dest="jetflow_bench_rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        metavar="N",
        help=f"pedantic rounds per comparison case (default {DEFAULT_ROUNDS})",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: a benchmark; runs only with {FLAG}")
    if config.getoption("jetflow_benchmark"):
        from jetflow.core.errors import JetflowError

        try:  # a bad suite config is a usage error, reported before anything is collected
            suite_config(config)
        except JetflowError as error:
            raise pytest.UsageError(f"{FLAG}: {error}") from None


def suite_config(config: pytest.Config) -> BenchConfig:
    """The suite's bench config: :data:`SUITE_DEFAULTS` under the ``--bench-config`` file."""
    if _CONFIG_KEY not in config.stash:
        from jetflow.bench.config import BenchConfig
        from jetflow.core.config import build_config, load_toml, merge

        path = config.getoption("jetflow_bench_config")
        data = merge(SUITE_DEFAULTS, load_toml(path)) if path else dict(SUITE_DEFAULTS)
        batch_sizes = config.getoption("jetflow_bench_batch_sizes")
        if batch_sizes is not None:
            data["batch_sizes"] = batch_sizes  # text: the config validates it
        config.stash[_CONFIG_KEY] = build_config(BenchConfig, data)
    return config.stash[_CONFIG_KEY]


def is_benchmark(item: pytest.Item) -> bool:
    return "benchmark" in getattr(item, "fixturenames", ()) or item.get_closest_marker(MARKER) is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("jetflow_benchmark"):
        return
    skip = pytest.mark.skip(reason=f"benchmark: run with {FLAG}")
    for item in items:
        if is_benchmark(item):
            item.add_marker(skip)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "bench_case" not in metafunc.fixturenames:
        return
    from jetflow.bench.suite import bench_cases

    cases = bench_cases(suite_config(metafunc.config))
    metafunc.parametrize("bench_case", cases, ids=[case.id for case in cases])


@pytest.fixture(scope="session")
def bench_suite(request: pytest.FixtureRequest) -> BenchSuite:
    """The session's comparison state; the target loads on the first case that runs."""
    from jetflow.bench.suite import BenchSuite

    return BenchSuite(suite_config(request.config))


@pytest.fixture(scope="session")
def bench_rounds(request: pytest.FixtureRequest) -> int:
    return max(1, int(request.config.getoption("jetflow_bench_rounds")))
