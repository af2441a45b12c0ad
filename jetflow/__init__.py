"""jetflow: lossless speculative decoding with causal parallel tree drafting.

The public API is small: :class:`Engine` (load once, generate many), :func:`generate`
(one call), :class:`GenerateConfig`, and the plugin contracts in :mod:`jetflow.core.contracts`.
Heavy modules (torch, transformers) load on first use, so ``import jetflow`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "GenerateConfig", "GenerationResult", "__version__", "generate"]

if TYPE_CHECKING:
    from jetflow.core.config import GenerateConfig
    from jetflow.core.engine import Engine
    from jetflow.core.prompt import Prompt
    from jetflow.core.result import GenerationResult

_LAZY = {
    "Engine": "jetflow.core.engine",
    "GenerateConfig": "jetflow.core.config",
    "GenerationResult": "jetflow.core.result",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jetflow' has no attribute {name!r}")


def generate(prompt: Prompt, **config: Any) -> GenerationResult:
    """Generate once with a config given as keyword fields (see :class:`GenerateConfig`).

    For many prompts build an :class:`Engine` once instead: it keeps the target loaded.
    """
    from jetflow.core.config import GenerateConfig, build_config
    from jetflow.core.engine import Engine

    return Engine(build_config(GenerateConfig, config)).generate(prompt)
