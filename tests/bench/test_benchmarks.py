"""The comparison suite: ``pytest --benchmark tests/bench/test_benchmarks.py``.

One benchmark per data set x method (x budget), timed by pytest-benchmark in pedantic
mode (``--bench-rounds`` rounds of one iteration, each round every prompt of the data set),
so ``--benchmark-json``, ``--benchmark-autosave`` and ``--benchmark-compare`` work as usual.
tau and the speedup over ``ar`` go into each record's ``extra_info``. Nothing here asserts a
time; the one assertion is that the method reproduced ``ar``'s greedy tokens.

With a batch axis (``--bench-batch-sizes 1,4`` or ``batch_sizes`` in ``--bench-config``) each
case is also a batch size: a round decodes every prompt that many at a time, the speedup is over
batched ``ar`` at that size, and the tokens are checked against batched ``ar`` and ``ar`` alone.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _needs_flag(request: pytest.FixtureRequest) -> None:
    """Skip even when the jetflow plugin is not loaded (its hooks skip these otherwise)."""
    if not request.config.getoption("jetflow_benchmark", default=False):
        pytest.skip("benchmark: run with --benchmark")


def test_compare(benchmark, bench_suite, bench_case, bench_rounds: int) -> None:
    case = bench_suite.prepare(bench_case)
    benchmark.group = bench_case.dataset
    benchmark.pedantic(case.once, rounds=bench_rounds, iterations=1, warmup_rounds=0)
    summary = bench_suite.finish(case)
    keys = ("tau", "speedup_vs_ar", "tokens_per_s", "draft_share", "new_tokens", "n_prompts", "lossless")
    benchmark.extra_info.update({key: summary[key] for key in keys})
    benchmark.extra_info.update(method=summary["method"], budget=summary["budget"], dtype=summary["dtype"])
    if bench_case.batch_size is not None:
        batch = ("batch_size", "speedup_vs_hf_generate", "mean_latency_s", "mean_batch_budget", "mean_rows")
        benchmark.extra_info.update({key: summary[key] for key in batch})
    assert summary["lossless"], f"{bench_case.id} diverged from ar: {summary['divergences']}"
