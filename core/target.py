"""The frozen target model: layer capture, one-forward tree verification, cache commit.

Wraps any ``transformers`` causal LM through its public forward: a tree is verified with
a 4-D additive attention mask (each node sees the cached prefix and its own ancestors)
and position ids ``cached length + depth``; committing keeps the accepted entries of the
KV cache in place and crops the rest, so the prefix is never recomputed.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
from jetflow.attention.verify_attention import select_verify_attention, verify_mask
from jetflow.core.compiled import CompiledForward
from jetflow.core.errors import TargetError
from jetflow.core.kv_cache import is_slab, slab_cache, slab_layers, supports_slab
from jetflow.core.model_files import DEFAULT_TARGET, load_model
from jetflow.core.packed_weights import pack_linear_weights
from jetflow.core.precision import default_device, dtype_name
from jetflow.core.prompt import check_encodable
from jetflow.core.tree import DraftTree
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin

log = logging.getLogger(__name__)


@dataclass
class VerifyOutput:
    """The target's answer for one tree.

    Attributes:
        logits: ``[n, vocab]`` float32 next-token logits after each node.
        features: ``[n, n_layers, hidden]`` hidden states at the requested layers, or None.
    """

    logits: Tensor
    features: Tensor | None


class Target:
    """A frozen causal LM plus its tokenizer, decoding one sequence at a time."""

    def __init__(self, model: PreTrainedModel, tokenizer, name: str) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        #: the verify forward's attention: ``triton-tree`` (CUDA, the tree kernel) or ``sdpa``
        self.attention = select_verify_attention(self.model)
        #: the compiled verify forward (:meth:`use_compiled`), or None for the eager one
        self.compiled: CompiledForward | None = None
        #: the linear layers' weights: ``packed`` once for oneDNN (CPU bfloat16) or ``plain``
        self.linear_weights = "packed" if pack_linear_weights(self.model) else "plain"
        self._raw_prompts_logged = False  # the no-chat-template notice is logged once per target

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, spec: str = DEFAULT_TARGET, dtype: torch.dtype = torch.float32, device=None) -> Target:
        """Load ``default`` (the embedded SmolLM2), a local folder, a ``.gguf`` file, or a hub id
        already in the local cache. Never downloads."""
        device = torch.device(device) if device else default_device()
        model, tokenizer, name = load_model(spec, dtype)
        return cls(model.to(device), tokenizer, name)

    # ------------------------------------------------------------------ facts
    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def context_length(self) -> int:
        return int(self.config.max_position_embeddings)

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """Tokens that end generation, as ``transformers.generate`` would see them."""
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return frozenset([eos] if isinstance(eos, int) else (eos or []))

    @cached_property
    def tokenizer_hash(self) -> str:
        vocab = sorted(self.tokenizer.get_vocab().items())
        return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]

    def fingerprint(self) -> dict[str, object]:
        """What a drafter checkpoint must agree with to be used on this target."""
        return {
            "architecture": self.config.model_type,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "tokenizer_hash": self.tokenizer_hash,
        }

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "dtype": dtype_name(self.dtype), **self.fingerprint()}

    # ------------------------------------------------------------------ text
    @cached_property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer formats chats (an instruct model) or not (a base model)."""
        return bool(self.tokenizer.chat_template)

    def encode_prompt(self, prompt: str | list[dict[str, str]], chat: bool = True) -> list[int]:
        """Token ids of a prompt: through the chat template unless ``chat`` is false or the
        tokenizer has none (a base model), where the text (a chat's turns joined by blank lines)
        is encoded as it is. Every path that formats prompts comes here, so they share the rule,
        and text no tokenizer can encode (a lone surrogate) is named here, whoever read it."""
        for text in [prompt] if isinstance(prompt, str) else [turn["content"] for turn in prompt]:
            check_encodable(text)  # not emptiness: a chat's earlier answer may be empty
        if chat and not self.has_chat_template:
            if not self._raw_prompts_logged:
                log.warning("%s has no chat template: prompts are encoded as raw text", self.name)
                self._raw_prompts_logged = True
            chat = False
        if not chat:
            text = prompt if isinstance(prompt, str) else "\n\n".join(turn["content"] for turn in prompt)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, Mapping):  # a BatchEncoding in some transformers versions
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, ids: list[int] | Tensor) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------------ forward passes
    def use_compiled(self, compiled: CompiledForward | None) -> None:
        """Verify through ``compiled`` (None: eagerly) from now on; slab caches only."""
        self.compiled = compiled

    def new_cache(self, capacity: int | None = None) -> DynamicCache:
        """A KV cache: a slab of ``capacity`` positions written in place (it grows if outrun),
        or transformers' ``DynamicCache`` without a capacity or for layers a slab cannot hold."""
        cache = DynamicCache(config=self.config)
        if capacity is None or not supports_slab(cache):
            return cache
        return slab_cache(self.model, 1, capacity)

    @torch.inference_mode()
    def prefill(
        self, ids: Tensor, layers: tuple[int, ...] = (), capacity: int | None = None
    ) -> tuple[DynamicCache, Tensor | None]:
        """Process ``ids`` (``[seq]``) into a fresh KV cache; features ``[seq, k, hidden]``.

        ``capacity``: the positions the cache will hold (prompt, answer and the largest tree);
        given, the cache is a preallocated slab (see :meth:`new_cache`).
        """
        cache = self.new_cache(capacity)
        if ids.numel() == 0:
            return cache, None
        out = self.model(
            input_ids=ids[None].to(self.device),
            cache=cache,
            use_cache=True,
            output_hidden_states=bool(layers),
            logits_to_keep=1,
        )
        return cache, self._features(out, layers)

    @torch.inference_mode()
    def verify(self, cache: DynamicCache, tree: DraftTree, layers: tuple[int, ...] = ()) -> VerifyOutput:
        """Run every node of ``tree`` in one forward after the cached prefix.

        Appends the tree's entries to ``cache``; :meth:`commit` then keeps the accepted ones.
        """
        n_cached = cache.get_seq_length()
        compiled = self.compiled
        if compiled is not None and n_cached > 0 and compiled.bucket(tree.size) and is_slab(cache):
            visible = torch.cat(
                [torch.ones(tree.size, n_cached, dtype=torch.bool), tree.ancestor_mask], dim=1
            )
            logits, hidden = compiled(
                cache,
                tree.tokens.to(self.device),
                (n_cached + tree.depths).to(self.device),
                visible.to(self.device),
            )
            features = torch.stack([hidden[i] for i in layers], dim=1) if layers else None
            return VerifyOutput(logits=logits.float(), features=features)
        mask = verify_mask(tree.ancestor_mask, n_cached, self.attention, self.dtype, self.device)
        out = self.model(
            input_ids=tree.tokens[None].to(self.device),
            attention_mask=mask,
            position_ids=(n_cached + tree.depths)[None].to(self.device),
            cache=cache,
            use_cache=True,
            output_hidden_states=bool(layers),
        )
        return VerifyOutput(logits=out.logits[0].float(), features=self._features(out, layers))

    @staticmethod
    @torch.inference_mode()
    def commit(cache: DynamicCache, n_cached: int, path: Tensor) -> None:
        """Keep the cache entries of the accepted ``path`` (tree node indices), drop the rest.

        The accepted entries are moved to the front of the tree's slot in place; the
        prefix before ``n_cached`` is never touched or recomputed.
        """
        slabs = slab_layers(cache)
        if slabs is not None:
            source = (n_cached + path).to(slabs[0].keys.device)
            for slab in slabs:
                slab.keep(n_cached, source)
            return
        end = n_cached + int(path.shape[0])
        for layer in cache.layers:
            keys, values = _filled_keys_values(layer)
            source = (n_cached + path).to(keys.device)
            keys[:, :, n_cached:end] = keys[:, :, source]
            values[:, :, n_cached:end] = values[:, :, source]
        cache.crop(end - cache.get_seq_length())  # a negative count: tokens to drop

    @staticmethod
    def _features(out, layers: tuple[int, ...]) -> Tensor | None:
        if not layers:
            return None
        return torch.stack([out.hidden_states[i][0] for i in layers], dim=1)


def _filled_keys_values(layer: object) -> tuple[Tensor, Tensor]:
    """An attention cache layer's keys and values ``[batch, kv_heads, length, head_dim]``.

    Raises :class:`TargetError` for a layer that holds none (a recurrent state, a layer never
    written): a tree's entries can only be kept in a cache of attention keys and values.
    """
    if isinstance(layer, CacheLayerMixin) and layer.keys is not None and layer.values is not None:
        return layer.keys, layer.values
    raise TargetError(f"cannot commit a tree path into a {type(layer).__name__} cache layer")
