"""The ``vllm`` tests run where vLLM's environment exists (``make vllm``); elsewhere they are deselected
(asked for with ``-m vllm``, they are skipped with the reason instead)."""

from __future__ import annotations

import pytest
from jetflow.bench.vllm_methods import vllm_python
from jetflow.core.errors import ConfigError


def _vllm_missing() -> str | None:
    try:
        vllm_python()
    except ConfigError as error:
        return str(error)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = _vllm_missing()
    if missing is None:
        return
    needs_vllm = [item for item in items if item.get_closest_marker("vllm")]
    if "vllm" in (config.getoption("markexpr") or ""):
        for item in needs_vllm:
            item.add_marker(pytest.mark.skip(reason=missing))
        return
    if needs_vllm:
        config.hook.pytest_deselected(items=needs_vllm)
        items[:] = [item for item in items if not item.get_closest_marker("vllm")]
