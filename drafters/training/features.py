"""Target features for training heads, computed by a teacher-forced forward over a corpus.

What is cached and where is :mod:`jetflow.drafters.training.feature_cache`. The cache is
filled in the same pass as regeneration, or later by a teacher-forced forward
(:func:`build_features`), which costs a prefill, not a generation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from jetflow.core.errors import ConfigError, DataError
from jetflow.core.target import Target
from jetflow.drafters.training.corpus import Corpus
from jetflow.drafters.training.feature_cache import (
    FEATURE_DTYPE,
    FeatureStore,
    FeatureWriter,
    feature_dir,
    read_manifest,
    stale_shards,
)
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm
from transformers import Cache, PreTrainedModel

log = logging.getLogger(__name__)


def check_layers(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Validate 1-based decoder-layer ids (``hidden_states[i]`` of a transformers model).

    Layer ``L`` itself is refused: transformers replaces its raw output by the normed
    final state, which is stored separately as ``final``.
    """
    layers = tuple(int(x) for x in layers)
    if not layers or list(layers) != sorted(set(layers)) or not all(1 <= x < num_layers for x in layers):
        raise ConfigError(
            f"feature layers must be increasing decoder-layer ids in 1..{num_layers - 1}, got {layers}"
        )
    return layers


@torch.inference_mode()
def decoder_states(
    model: PreTrainedModel,
    input_ids: Tensor,
    layers: Sequence[int],
    *,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    cache: Cache | None = None,
) -> tuple[Tensor | None, Tensor]:
    """One decoder forward returning ``features [B, S, k, H]`` (None without layers) and ``final [B, S, H]``.

    Only the requested hidden states are kept alive (transformers' index selection), and the
    LM head is left to the caller, which needs it at one position at most.
    """
    out = model.get_decoder()(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=cache is not None,
        output_hidden_states=list(layers) if layers else False,
    )
    features = torch.stack([out.hidden_states[i] for i in layers], dim=2) if layers else None
    return features, out.last_hidden_state


def batches_by_length(lengths: Tensor, token_budget: int) -> list[Tensor]:
    """Indices grouped (longest first) so that ``batch size x longest length <= token_budget``."""
    order = torch.argsort(lengths, descending=True, stable=True)
    batches: list[Tensor] = []
    current: list[int] = []
    for index in order.tolist():
        if current and (len(current) + 1) * int(lengths[current[0]]) > token_budget:
            batches.append(torch.tensor(current))
            current = []
        current.append(index)
    if current:
        batches.append(torch.tensor(current))
    return batches


@torch.inference_mode()
def teacher_forced_states(
    model: PreTrainedModel, sequences: Sequence[Tensor], layers: Sequence[int], token_budget: int = 8192
) -> tuple[list[Tensor], list[Tensor]]:
    """Features ``[T_i-1, k, H]`` and finals ``[T_i-1, H]`` (fp16) of each sequence, batched by length.

    Sequences are right-padded: under a causal mask a real position never sees the padding
    after it, so no attention mask is needed and the states equal those of a lone forward.
    """
    lengths = torch.tensor([len(s) for s in sequences])
    features: list[Tensor] = [torch.empty(0)] * len(sequences)
    finals: list[Tensor] = [torch.empty(0)] * len(sequences)
    for batch in batches_by_length(lengths, token_budget):
        ids = pad_sequence([sequences[i].long() for i in batch.tolist()], batch_first=True)
        feats, final = decoder_states(model, ids.to(model.device), layers)
        if feats is None:
            raise ConfigError("teacher forcing captures features: name at least one layer")
        keep = torch.arange(ids.shape[1]) < (lengths[batch] - 1)[:, None]  # [b, width]
        rows = (lengths[batch] - 1).tolist()
        feats = feats[keep.to(feats.device)].to("cpu", FEATURE_DTYPE).split(rows)
        final = final[keep.to(final.device)].to("cpu", FEATURE_DTYPE).split(rows)
        for position, index in enumerate(batch.tolist()):
            features[index], finals[index] = feats[position], final[position]
    return features, finals


def build_features(
    target: Target,
    corpus: Corpus,
    layers: Sequence[int],
    *,
    folder: Path | None = None,
    token_budget: int = 8192,
    part: tuple[int, int] = (1, 1),
    limit: int | None = None,
    show_progress: bool = False,
) -> FeatureStore | None:
    """Fill the feature cache of ``corpus`` for ``layers`` by teacher forcing; skips shards already cached.

    ``part = (k, n)`` computes only the shards whose index is ``k - 1`` modulo ``n``, so ``n``
    processes (one per core) fill one cache together. ``limit``: only the shards holding the
    first ``limit`` sequences (what a run with ``max_sequences`` reads). Returns the store (of
    those sequences) once every shard is cached, None while other parts are still missing.
    """
    layers = check_layers(layers, target.num_layers)
    k, n = part
    if not 1 <= k <= n:
        raise ConfigError(f"feature part must be K/N with 1 <= K <= N, got {k}/{n}")
    folder = Path(folder) if folder else feature_dir(corpus.name, layers)
    if corpus.manifest["target"]["fingerprint"] != target.fingerprint():
        raise DataError(f"corpus {corpus.path} was regenerated by another target than {target.name!r}")
    if limit is not None and limit < 1:
        raise ConfigError(f"the feature limit must be a positive number of sequences, got {limit}")
    length = len(corpus) if limit is None else min(len(corpus), limit)
    n_shards = corpus.locate(length - 1)[0] + 1 if length else 0
    writer = FeatureWriter.for_target(folder, corpus_name=corpus.name, target=target, layers=layers)
    todo = [
        i
        for i, record in enumerate(corpus.manifest["shards"][:n_shards])
        if i % n == k - 1 and not writer.has(i, record["tokens_sha256"])
    ]
    log.info("features of %s: %d of %d shards to compute", corpus.name, len(todo), len(corpus.shards))
    total = sum(len(corpus.shards[i]) for i in todo)
    with tqdm(total=total, unit="seq", desc="features", disable=not show_progress) as bar:
        for index in todo:
            shard = corpus.shards[index]
            sequences = [shard.sequence(j) for j in range(len(shard))]
            features, finals = teacher_forced_states(target.model, sequences, layers, token_budget)
            writer.write(index, corpus.manifest["shards"][index]["tokens_sha256"], features, finals)
            bar.update(len(shard))
    if n > 1 and stale_shards(read_manifest(folder), corpus, n_shards):  # every writer's records, on disk
        return None  # the other parts' shards are still being computed
    return FeatureStore(corpus, layers, folder, limit)  # a lone writer's missing shard is an error here
