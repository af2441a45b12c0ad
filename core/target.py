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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from jetflow.attention.ragged_attention import LAYOUT_KEYWORD, RaggedRows, enable_ragged_attention
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

    def new_cache(self, capacity: int | None = None, rows: int = 1) -> DynamicCache:
        """A KV cache: a slab of ``rows`` sequences of ``capacity`` positions written in place (it
        grows if outrun), or transformers' ``DynamicCache`` without a capacity or for layers a
        slab cannot hold (one sequence only)."""
        cache = DynamicCache(config=self.config)
        if capacity is None or not supports_slab(cache):
            if rows > 1:
                raise TargetError(
                    f"{self.name} has layers a slab cache cannot hold: it decodes one sequence at a time"
                )
            return cache
        return slab_cache(self.model, rows, capacity)

    @staticmethod
    def lengths(cache: DynamicCache) -> list[int]:
        """Positions each row of ``cache`` holds."""
        slabs = slab_layers(cache)
        return list(slabs[0].lengths) if slabs is not None else [cache.get_seq_length()]

    @torch.inference_mode()
    def prefill_row(
        self, cache: DynamicCache, row: int, ids: Tensor, layers: tuple[int, ...] = ()
    ) -> Tensor | None:
        """Process ``ids`` (``[seq]``) as the whole history of ``row`` of a slab ``cache`` (what the
        row held is dropped); features as :meth:`prefill`'s. A cache of one row is written
        directly; in a batch the prompt runs alone and its keys and values are copied into the row.
        """
        slabs = slab_layers(cache)
        if slabs is None:
            raise TargetError("prefill_row writes into a slab cache (Target.new_cache with a capacity)")
        if slabs[0].rows == 1:
            for slab in slabs:
                slab.set_length(0)
            return self._prefill(cache, ids, layers)
        n = int(ids.numel())
        alone = slab_cache(self.model, 1, max(n, 1))
        features = self._prefill(alone, ids, layers)
        where = torch.tensor([row], device=self.device)
        for slab, source in zip(slabs, slab_layers(alone) or [], strict=True):
            slab.reserve(n)
            slab.write(where, 0, source.keys, source.values)
        return features

    @torch.inference_mode()
    def prefill(
        self, ids: Tensor, layers: tuple[int, ...] = (), capacity: int | None = None
    ) -> tuple[DynamicCache, Tensor | None]:
        """Process ``ids`` (``[seq]``) into a fresh KV cache; features ``[seq, k, hidden]``.

        ``capacity``: the positions the cache will hold (prompt, answer and the largest tree);
        given, the cache is a preallocated slab (see :meth:`new_cache`).
        """
        cache = self.new_cache(capacity)
        return cache, self._prefill(cache, ids, layers)

    def _prefill(self, cache: DynamicCache, ids: Tensor, layers: tuple[int, ...]) -> Tensor | None:
        if ids.numel() == 0:
            return None
        out = self.model(
            input_ids=ids[None].to(self.device),
            cache=cache,
            use_cache=True,
            output_hidden_states=bool(layers),
            logits_to_keep=1,
        )
        return self._features(out, layers)

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

    @torch.inference_mode()
    def verify_rows(
        self, cache: DynamicCache, trees: Sequence[DraftTree | None], layers: tuple[int, ...] = ()
    ) -> list[VerifyOutput | None]:
        """Verify one tree per row of a slab ``cache`` (None: the row sits out) in one forward.

        One row is :meth:`verify`. Several run flattened (:mod:`jetflow.attention.ragged_attention`):
        the linear layers see the sum of the trees, attention runs per row over its own history.
        Appends each tree after its row's history; :meth:`commit_rows` keeps the accepted paths.
        """
        if len(trees) == 1:
            return [None if trees[0] is None else self.verify(cache, trees[0], layers)]
        slabs = slab_layers(cache)
        if slabs is None or slabs[0].rows != len(trees):
            raise TargetError(f"verify_rows needs a slab cache of {len(trees)} rows")
        live = [tree for tree in trees if tree is not None]
        if not live:
            return [None] * len(trees)
        enable_ragged_attention(self.model)
        starts = list(slabs[0].lengths)
        counts = [0 if tree is None else tree.size for tree in trees]
        nodes = max(counts)
        for slab in slabs:
            slab.fit(max(starts) + nodes)  # room for commit_rows' padded moves too
        layout = RaggedRows.of(starts, counts, self.device, width=slabs[0].capacity)
        visible = layout.visibility([None if tree is None else tree.ancestor_mask for tree in trees])
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill_(~visible, torch.finfo(self.dtype).min)[:, None]
        positions = torch.cat(
            [
                start + tree.depths.to(self.device)
                for start, tree in zip(starts, trees, strict=True)
                if tree is not None
            ]
        )
        out = self.model(
            input_ids=torch.cat([tree.tokens for tree in live]).to(self.device)[None],
            attention_mask=mask,
            position_ids=positions[None],
            cache=cache,
            use_cache=True,
            output_hidden_states=bool(layers),
            **{LAYOUT_KEYWORD: layout},
        )
        if any(slab.last_layout is not layout for slab in slabs):
            raise TargetError(
                f"{self.name}'s attention does not hand the model's keywords to its cache: "
                "it cannot verify a batch"
            )
        logits = out.logits[0].float().split([tree.size for tree in live])
        features = self._features(out, layers)
        parts = features.split([tree.size for tree in live]) if features is not None else [None] * len(live)
        answers = iter(VerifyOutput(logit, feature) for logit, feature in zip(logits, parts, strict=True))
        return [None if tree is None else next(answers) for tree in trees]

    @staticmethod
    @torch.inference_mode()
    def commit_rows(cache: DynamicCache, starts: Sequence[int], paths: Sequence[Tensor | None]) -> None:
        """:meth:`commit` per row: row ``r`` keeps ``paths[r]`` of the tree verified after its first
        ``starts[r]`` positions (None: the row keeps ``starts[r]``), all rows in one gather."""
        if len(paths) == 1:
            if paths[0] is not None:
                Target.commit(cache, starts[0], paths[0])
            return
        slabs = slab_layers(cache)
        if slabs is None:
            raise TargetError("commit_rows needs a slab cache")
        kept = [0 if path is None else int(path.shape[0]) for path in paths]
        lengths = [start + count for start, count in zip(starts, kept, strict=True)]
        moved = [(row, path) for row, path in enumerate(paths) if path is not None and not _in_place(path)]
        if not moved:  # every kept entry already sits where it belongs (e.g. every step at budget 0)
            for slab in slabs:
                slab.set_lengths(lengths)
            return
        width = max(int(path.shape[0]) for _, path in moved)
        sources = torch.tensor([[starts[row]] * width for row, _ in moved], dtype=torch.long)
        for index, (row, path) in enumerate(moved):  # a copy per moved row, not per token
            sources[index, : path.shape[0]] = starts[row] + path.cpu()
        rows = torch.tensor([row for row, _ in moved], dtype=torch.long)
        for slab in slabs:
            slab.keep_rows(rows, [starts[row] for row, _ in moved], sources, lengths)

    @staticmethod
    @torch.inference_mode()
    def commit(cache: DynamicCache, n_cached: int, path: Tensor) -> None:
        """Keep the cache entries of the accepted ``path`` (tree node indices), drop the rest.

        The accepted entries are moved to the front of the tree's slot in place; the
        prefix before ``n_cached`` is never touched or recomputed.
        """
        slabs = slab_layers(cache)
        if slabs is not None:
            if _in_place(path):  # nothing to move: the root alone, or a chain accepted from its start
                for slab in slabs:
                    slab.set_length(n_cached + int(path.shape[0]))
                return
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


def _in_place(path: Tensor) -> bool:
    """Whether an accepted ``path``'s entries already sit where a commit would move them: nodes
    ``0, 1, ..., k - 1`` (the root alone at budget 0 or on a full rejection, or a tree's first
    nodes), so the commit only sets the length."""
    return torch.equal(path, torch.arange(path.shape[0], dtype=path.dtype, device=path.device))


def _filled_keys_values(layer: object) -> tuple[Tensor, Tensor]:
    """An attention cache layer's keys and values ``[batch, kv_heads, length, head_dim]``.

    Raises :class:`TargetError` for a layer that holds none (a recurrent state, a layer never
    written): a tree's entries can only be kept in a cache of attention keys and values.
    """
    if isinstance(layer, CacheLayerMixin) and layer.keys is not None and layer.values is not None:
        return layer.keys, layer.values
    raise TargetError(f"cannot commit a tree path into a {type(layer).__name__} cache layer")
