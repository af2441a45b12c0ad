"""Benchmarks: data sets, the side-by-side runner, reports and plots, the pytest plugin.

Entry points: ``jetflow bench`` (:mod:`jetflow.bench.runner` + :mod:`jetflow.bench.report`),
``pytest --benchmark`` (:mod:`jetflow.bench.pytest_plugin`). Nothing heavy is imported
here: the pytest plugin loads this package into every pytest session.
"""
