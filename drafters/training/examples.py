"""Training examples: sequence stores, anchor sampling and batch collation.

The batch and prediction types the heads' training hook speaks live beside the heads
(:mod:`jetflow.drafters.examples`), so inference code never imports this package.

A *sequence* is a target-regenerated conversation with the target's own hidden states:
``tokens [T]``, the prompt length, ``features [F, k, H]`` (the selected layers' hidden
states of tokens ``0 .. F-1``) and ``final [F, H]`` (the target's final normed hidden
state of those tokens, so the teacher distribution of token ``t + 1`` is
``lm_head(final[t])``). ``F`` is ``T`` or ``T - 1``.

An *anchor* ``p`` is a position whose token plays the root of a decoding step: the head
sees the features of tokens ``< p`` (what the target has processed) plus the token at
``p``, and predicts the tokens at ``p + 1 .. p + D`` (depths ``1 .. D``). Anchors lie in
the response: from the last prompt token (the first decoding step's root) onwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jetflow.drafters.examples import ExampleBatch
from jetflow.drafters.training.contracts import Record, SequenceStore
from torch import Tensor
from transformers import PreTrainedModel


@dataclass
class InMemoryStore:
    """A list of sequences held in memory: tests, small experiments.

    Attributes:
        records: the sequences.
        layers: target layers the features were taken from.
        manifest: what the data is (source, counts), copied into checkpoints.
    """

    records: list[Record]
    layers: tuple[int, ...]
    manifest: dict[str, Any]

    def __len__(self) -> int:
        return len(self.records)

    def sequence(self, index: int) -> Record:
        return self.records[index]

    def sequences(self, indices: Sequence[int]) -> list[Record]:
        return [self.records[int(i)] for i in indices]

    def tokens(self, index: int) -> tuple[Tensor, int]:
        tokens, prompt_length, _, _ = self.records[index]
        return tokens, prompt_length


class ConcatStore:
    """Several stores read as one, in order (a corpus and its second turns): indices run on.

    Attributes:
        layers: the target layers every part's features come from (they must agree).
        manifest: each part's manifest under ``parts`` and the summed ``counts``.
    """

    def __init__(self, stores: Sequence[SequenceStore]) -> None:
        if not stores:
            raise ValueError("ConcatStore needs at least one store")
        layers = {tuple(store.layers) for store in stores}
        if len(layers) > 1:
            raise ValueError(f"the stores hold features of different layers: {sorted(layers)}")
        self.stores = list(stores)
        self.layers = layers.pop()
        sizes = torch.tensor([len(store) for store in self.stores], dtype=torch.long)
        self._starts = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
        parts = [dict(store.manifest) for store in self.stores]
        counts: dict[str, int] = {}
        for part in parts:
            for key, value in (part.get("counts") or {}).items():
                counts[key] = counts.get(key, 0) + int(value)
        self.manifest = {"parts": parts, "counts": counts, "feature_layers": list(self.layers)}

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _locate(self, index: int) -> tuple[int, int]:
        """(part, index within the part) of sequence ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} out of range for a store of {len(self)}")
        part = int(torch.searchsorted(self._starts, torch.tensor(index), right=True)) - 1
        return part, index - int(self._starts[part])

    def sequence(self, index: int) -> Record:
        part, local = self._locate(index)
        return self.stores[part].sequence(local)

    def sequences(self, indices: Sequence[int]) -> list[Record]:
        """Each part reads its share of ``indices`` in one call (one batch where it computes)."""
        located = [self._locate(int(i)) for i in indices]
        records: dict[int, Record] = {}
        for part, store in enumerate(self.stores):
            slots = [slot for slot, (p, _) in enumerate(located) if p == part]
            if slots:
                records.update(zip(slots, store.sequences([located[s][1] for s in slots]), strict=True))
        return [records[slot] for slot in range(len(located))]

    def tokens(self, index: int) -> tuple[Tensor, int]:
        part, local = self._locate(index)
        return self.stores[part].tokens(local)


@torch.inference_mode()
def capture_sequences(
    model: PreTrainedModel,
    sequences: Sequence[Tensor],
    prompt_lengths: Sequence[int],
    layers: tuple[int, ...],
    manifest: dict[str, Any] | None = None,
) -> InMemoryStore:
    """Run ``model`` (an HF causal LM) over each sequence once and keep what training needs.

    ``features[t]`` are ``hidden_states[layer][t]`` for each chosen layer and ``final[t]`` is
    the last (normed) hidden state, exactly what the engine shows a drafter at decode time.
    """
    records: list[Record] = []
    for tokens, prompt_length in zip(sequences, prompt_lengths, strict=True):
        out = model(input_ids=tokens[None].to(model.device), output_hidden_states=True)
        features = torch.stack([out.hidden_states[i][0] for i in layers], dim=1)
        final = out.hidden_states[-1][0]
        records.append((tokens.cpu(), int(prompt_length), features.half().cpu(), final.half().cpu()))
    info = {"source": "in-memory", "n_sequences": len(records)} | (manifest or {})
    return InMemoryStore(records, tuple(layers), info)


def response_token_counts(store: SequenceStore, indices: Sequence[int], vocab_size: int) -> Tensor:
    """How often each token occurs in the responses of ``indices``: ``[vocab_size]`` long."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for index in indices:
        tokens, prompt_length = store.tokens(index)
        counts += torch.bincount(tokens[prompt_length:].long(), minlength=vocab_size)
    return counts


def anchor_bounds(prompt_length: int, length: int, n_features: int) -> tuple[int, int]:
    """Inclusive range ``(lo, hi)`` of anchors that supervise at least depth 1 (empty if lo > hi).

    Depth 1 of anchor ``p`` needs the token at ``p + 1`` and the teacher state ``final[p]``.
    """
    return max(prompt_length - 1, 0), min(length - 2, n_features - 1)


def sample_anchors(
    prompt_length: int, length: int, n_features: int, count: int, generator: torch.Generator
) -> Tensor:
    """Up to ``count`` distinct anchors drawn uniformly from the response, sorted: ``[<= count]``."""
    lo, hi = anchor_bounds(prompt_length, length, n_features)
    if hi < lo:
        return torch.zeros(0, dtype=torch.long)
    picked = torch.randperm(hi - lo + 1, generator=generator)[:count] + lo
    return picked.sort().values


def collate(records: Sequence[Record], anchors: Sequence[Tensor], dtype: torch.dtype) -> ExampleBatch:
    """Pad ``records`` and their ``anchors`` (``[n_i]`` each) into one :class:`ExampleBatch`."""
    b = len(records)
    length = max(int(r[0].shape[0]) for r in records)
    n_feat = max(int(r[2].shape[0]) for r in records)
    k, hidden = records[0][2].shape[1:]
    n_anchors = max(max((int(a.shape[0]) for a in anchors), default=0), 1)
    batch = ExampleBatch(
        tokens=torch.zeros(b, length, dtype=torch.long),
        lengths=torch.tensor([int(r[0].shape[0]) for r in records]),
        features=torch.zeros(b, n_feat, k, hidden, dtype=dtype),
        feature_lengths=torch.tensor([int(r[2].shape[0]) for r in records]),
        final=torch.zeros(b, n_feat, hidden, dtype=dtype),
        anchors=torch.zeros(b, n_anchors, dtype=torch.long),
        anchor_valid=torch.zeros(b, n_anchors, dtype=torch.bool),
    )
    for row, ((tokens, _, features, final), picked) in enumerate(zip(records, anchors, strict=True)):
        batch.tokens[row, : tokens.shape[0]] = tokens
        batch.features[row, : features.shape[0]] = features.to(dtype)
        batch.final[row, : final.shape[0]] = final.to(dtype)
        batch.anchors[row, : picked.shape[0]] = picked
        batch.anchor_valid[row, : picked.shape[0]] = True
    return batch
