"""jetflow: lossless speculative decoding with causal parallel tree drafting.

The public API is small: :class:`Engine` (load once, generate many), :func:`generate`
(one call, for one prompt or a list of them), :class:`GenerateConfig`, and the plugin contracts
in :mod:`jetflow.core.contracts`.
Heavy modules (torch, transformers) load on first use, so ``import jetflow`` stays cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, cast, overload

__version__ = "0.1.0"
__all__ = ["Engine", "GenerateConfig", "GenerationResult", "__version__", "generate"]

if TYPE_CHECKING:
    from jetflow.core.config import GenerateConfig
    from jetflow.core.engine import Engine
    from jetflow.core.prompt import Messages, Prompt
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


@overload
def generate(
    prompt: list[str] | list[Messages] | list[list[int]], **config: Any
) -> list[GenerationResult]: ...
@overload
def generate(prompt: Prompt, **config: Any) -> GenerationResult: ...
def generate(prompt: Prompt | Sequence[Prompt], **config: Any) -> GenerationResult | list[GenerationResult]:
    """Generate with a config given as keyword fields (see :class:`GenerateConfig`).

    ``prompt`` is one prompt (text, a list of chat messages, or a list of token ids), which
    gives one :class:`GenerationResult`, or a list of prompts, which gives a list of results in
    the same order, decoded ``batch_size`` at a time (a config field, default 8) by
    :meth:`Engine.generate_batch`. A list is a list of prompts when its first item is a ``str``
    or a list (or tuple): ``["hi", "bye"]`` (two texts), ``[[{"role": "user", "content": "hi"}]]``
    (a list of one chat: a list of one result), ``[[1, 2], [3]]`` (two token-id prompts). A list
    of ints is one token-id prompt and a list of dicts one chat: ``generate([1, 2])`` and
    ``generate([{"role": "user", "content": "hi"}])`` each return a single result. An empty
    list is an empty prompt, refused with a :class:`~jetflow.core.errors.ConfigError`.

    For prompts that arrive over time build an :class:`Engine` once instead: it keeps the
    target loaded.
    """
    from jetflow.core.config import GenerateConfig, build_config
    from jetflow.core.engine import Engine

    engine = Engine.from_cache(build_config(GenerateConfig, config))
    if _is_prompt_list(prompt):
        return engine.generate_batch(prompt)
    return engine.generate(cast("Prompt", prompt))


def _is_prompt_list(prompt: object) -> TypeGuard[Sequence[Prompt]]:
    """Whether ``prompt`` is a list of prompts rather than one prompt (see :func:`generate`)."""
    return isinstance(prompt, list | tuple) and len(prompt) > 0 and isinstance(prompt[0], str | list | tuple)
