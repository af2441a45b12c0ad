"""Cached target features for training heads: capture, on-disk layout and memory-mapped reads.

For every corpus sequence of ``T`` tokens the cache holds, at the ``T - 1`` positions that
have a next token, the outputs of the chosen decoder layers (``features [T-1, k, H]``) and
the final normed hidden state (``final [T-1, H]``); the frozen LM head turns ``final`` into
the teacher distribution, so the 49K-wide logits are never stored. Everything is fp16.

Layout: ``cache_root()/features/<corpus name>/layers-<a>-<b>-.../`` holds one pair of
``.npy`` files per corpus shard plus a manifest naming, per shard, the checksum of the
corpus tokens it was computed from and the precision the target ran in (fp32 and bf16 states
differ, so a shard computed in another precision is stale too): a stale or missing shard is
detected, never read; shards recorded before the precision was are taken as they are.
The cache is filled in the same pass as regeneration, or later by a teacher-forced forward
(:func:`build_features`), which costs a prefill, not a generation.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from filelock import FileLock
from jetflow.core.atomic import atomic_path, remove_staging_files, write_json_atomic
from jetflow.core.errors import ConfigError, DataError
from jetflow.core.precision import dtype_name
from jetflow.core.target import Target, cache_root
from jetflow.drafters.training.corpus import Corpus
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm
from transformers import Cache, PreTrainedModel

log = logging.getLogger(__name__)

FEATURES_FORMAT = 1
MANIFEST_NAME = "manifest.json"
#: guards the manifest's read-merge-write, so processes splitting one corpus can share a folder
MANIFEST_LOCK = ".manifest.lock"
FEATURE_DTYPE = torch.float16


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


def feature_dir(corpus_name: str, layers: Sequence[int]) -> Path:
    """Cache folder for the features of ``layers`` over the corpus called ``corpus_name``."""
    return cache_root() / "features" / corpus_name / ("layers-" + "-".join(str(x) for x in layers))


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


def _read_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST_NAME
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DataError(f"{path}: unreadable feature-cache manifest ({error})") from error
    if manifest.get("format") != FEATURES_FORMAT:
        raise DataError(f"{path}: not a jetflow feature-cache manifest of format {FEATURES_FORMAT}")
    return manifest


def _shard_paths(folder: Path, index: int) -> tuple[Path, Path]:
    stem = f"shard-{index:05d}"
    return folder / f"{stem}.features.npy", folder / f"{stem}.final.npy"


class FeatureWriter:
    """Writes feature shards aligned with corpus shards; each one is recorded once complete."""

    def __init__(
        self,
        folder: Path,
        *,
        corpus_name: str,
        target: dict,
        layers: Sequence[int],
        hidden_size: int,
        computed_in: str,
    ):
        """``computed_in``: the dtype name the target runs in, recorded with every shard."""
        self.folder = Path(folder)
        self.layers = tuple(layers)
        self.computed_in = computed_in
        self.manifest: dict[str, Any] = {
            "format": FEATURES_FORMAT,
            "corpus": corpus_name,
            "target": target,
            "layers": list(self.layers),
            "hidden_size": hidden_size,
            "dtype": "float16",
            "shards": {},
        }
        remove_staging_files(self.folder)
        previous = _read_manifest(self.folder)
        if previous is not None:
            if previous["target"].get("fingerprint") != target.get("fingerprint"):
                log.warning("%s: cached features come from another target; rebuilding them", self.folder)
            elif previous["layers"] == list(self.layers) and previous["hidden_size"] == hidden_size:
                self.manifest["shards"] = previous["shards"]

    @classmethod
    def for_target(
        cls, folder: Path, *, corpus_name: str, target: Target, layers: Sequence[int]
    ) -> FeatureWriter:
        """The writer of ``target``'s features: its identity, width and precision come from it."""
        return cls(
            folder,
            corpus_name=corpus_name,
            target={"name": target.name, "fingerprint": target.fingerprint()},
            layers=layers,
            hidden_size=target.hidden_size,
            computed_in=dtype_name(target.dtype),
        )

    def has(self, index: int, tokens_sha256: str) -> bool:
        """True when shard ``index`` is cached for exactly these corpus tokens, in this precision."""
        record = self.manifest["shards"].get(str(index))
        return (
            record is not None
            and record["tokens_sha256"] == tokens_sha256
            and record.get("computed_in", self.computed_in) == self.computed_in
        )

    def write(
        self, index: int, tokens_sha256: str, features: Sequence[Tensor], finals: Sequence[Tensor]
    ) -> None:
        """Store one shard: per sequence ``features [T_i-1, k, H]`` and ``final [T_i-1, H]``."""
        features_path, final_path = _shard_paths(self.folder, index)
        for path, parts in ((features_path, features), (final_path, finals)):
            array = torch.cat(list(parts)).to(FEATURE_DTYPE).numpy()
            if not np.isfinite(array).all():  # fp16 tops out at 65504; SmolLM2's outliers reach ~25K
                raise DataError(f"{path.name}: hidden states overflow float16 (or are not finite)")
            with atomic_path(path) as staging, open(staging, "wb") as handle:
                np.save(handle, array)
        record = {
            "tokens_sha256": tokens_sha256,
            "n_rows": sum(int(f.shape[0]) for f in features),
            "computed_in": self.computed_in,
        }
        with FileLock(self.folder / MANIFEST_LOCK):
            on_disk = _read_manifest(self.folder)
            identity = ("target", "layers", "hidden_size")
            if on_disk is not None and all(on_disk[key] == self.manifest[key] for key in identity):
                self.manifest["shards"].update(on_disk["shards"])  # what other writers recorded
            self.manifest["shards"][str(index)] = record
            write_json_atomic(self.folder / MANIFEST_NAME, self.manifest)


class FeatureStore:
    """Memory-mapped features of a corpus: ``sequence(i)`` gives tokens, prompt length and states.

    ``layers`` may be a subset of the cached ones (an EAGLE head reads 3 of the 5 layers the
    block heads' cache holds): without ``folder``, the cache of exactly ``layers`` is used if
    it exists, else one of the corpus's caches holding all of them; only ``layers`` are served.

    Opening fails with a :class:`DataError` when a shard of the corpus has no (or a stale)
    feature shard, saying which command fills the cache.
    """

    def __init__(
        self, corpus: Corpus, layers: Sequence[int], folder: Path | None = None, limit: int | None = None
    ) -> None:
        """``limit``: read only the first ``limit`` sequences, so only their shards need features."""
        self.corpus = corpus
        self.layers = tuple(layers)
        self._length = len(corpus) if limit is None else min(len(corpus), limit)
        n_shards = corpus.locate(self._length - 1)[0] + 1 if self._length else 0
        self.folder = Path(folder) if folder else _find_cache(corpus.name, self.layers)
        manifest = _read_manifest(self.folder)
        # never written, or without some of the layers asked for
        if manifest is None or not set(self.layers) <= set(manifest["layers"]):
            listed = ",".join(map(str, self.layers))
            raise DataError(
                f"no cached features of layers {listed} for corpus {corpus.path} in {self.folder}: "
                f"run `jetflow data features --corpus {corpus.path} --layers {listed}`"
            )
        self.cache_manifest = manifest
        cached = list(manifest["layers"])
        #: positions of ``layers`` among the cached layers, None when they are all of them
        self._columns = None if cached == list(self.layers) else [cached.index(x) for x in self.layers]
        self.hidden_size = int(manifest["hidden_size"])
        described = ("source", "target", "settings", "counts", "regeneration")
        #: What the data is, small enough to copy into a checkpoint (no id list).
        self.manifest: dict[str, Any] = {
            "corpus": corpus.name,
            **{k: corpus.manifest.get(k) for k in described},
        }
        self.manifest["feature_layers"] = list(self.layers)
        stale = _stale_shards(manifest, corpus, n_shards)
        if stale:
            raise DataError(
                f"{self.folder}: features missing or stale for corpus shards {stale[:8]}"
                f"{'...' if len(stale) > 8 else ''}: run `jetflow data features --corpus {corpus.path}`"
            )
        records = [manifest["shards"][str(i)] for i in range(n_shards)]
        #: the precisions the target ran in for these features ("unrecorded" for old shards)
        self.manifest["features_computed_in"] = sorted({r.get("computed_in", "unrecorded") for r in records})
        self._arrays = [self._open_shard(i) for i in range(n_shards)]

    def _open_shard(self, index: int) -> tuple[np.ndarray, np.ndarray, Tensor]:
        """Map one shard's two arrays and derive its row offsets (``T_i - 1`` rows per sequence)."""
        shard = self.corpus.shards[index]
        row_offsets = shard.offsets - torch.arange(len(shard) + 1)
        n_rows, k = int(row_offsets[-1]), len(self.cache_manifest["layers"])
        expected = ((n_rows, k, self.hidden_size), (n_rows, self.hidden_size))
        arrays = []
        for path, shape in zip(_shard_paths(self.folder, index), expected, strict=True):
            try:
                array = np.load(path, mmap_mode="c")  # copy-on-write: zero-copy, yet torch may wrap it
            except (OSError, ValueError) as error:
                raise DataError(
                    f"{path}: truncated or unreadable feature shard ({error}); "
                    "rebuild it with `jetflow data features`"
                ) from error
            if array.shape != shape or array.dtype != np.float16:
                raise DataError(
                    f"{path}: feature shard is {array.dtype}{array.shape}, expected float16{shape}"
                )
            arrays.append(array)
        return arrays[0], arrays[1], row_offsets

    def __len__(self) -> int:
        return self._length

    def sequence(self, i: int) -> tuple[Tensor, int, Tensor, Tensor]:
        """``tokens [T]`` int64, prompt length, ``features [T-1, k, H]`` and ``final [T-1, H]`` fp16.

        Row ``t`` of the states belongs to token ``t``; ``lm_head(final[t])`` predicts token ``t + 1``.
        """
        if not 0 <= i < self._length:
            raise IndexError(f"sequence {i} out of range for a store of {self._length}")
        s, j = self.corpus.locate(i)
        shard = self.corpus.shards[s]
        features, final, rows = self._arrays[s]
        start, stop = int(rows[j]), int(rows[j + 1])
        features = features[start:stop] if self._columns is None else features[start:stop, self._columns]
        return (
            shard.sequence(j),
            int(shard.prompt_lengths[j]),
            torch.from_numpy(features),
            torch.from_numpy(final[start:stop]),
        )


def _stale_shards(manifest: dict | None, corpus: Corpus, n_shards: int | None = None) -> list[int]:
    """Indices of the first ``n_shards`` corpus shards (all: None) the cache manifest has no features for."""
    cached = manifest["shards"] if manifest else {}
    return [
        i
        for i, record in enumerate(corpus.manifest["shards"][:n_shards])
        if cached.get(str(i), {}).get("tokens_sha256") != record["tokens_sha256"]
    ]


def _find_cache(corpus_name: str, layers: tuple[int, ...]) -> Path:
    """The cache folder of exactly ``layers``, else the first (by name) holding them all."""
    exact = feature_dir(corpus_name, layers)
    if (exact / MANIFEST_NAME).exists():
        return exact
    for folder in sorted(exact.parent.glob("layers-*")):
        manifest = _read_manifest(folder)
        if manifest is not None and set(layers) <= set(manifest["layers"]):
            return folder
    return exact


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
    show_progress: bool = False,
) -> FeatureStore | None:
    """Fill the feature cache of ``corpus`` for ``layers`` by teacher forcing; skips shards already cached.

    ``part = (k, n)`` computes only the shards whose index is ``k - 1`` modulo ``n``, so ``n``
    processes (one per core) fill one cache together. Returns the store once every shard is
    cached, None while other parts are still missing.
    """
    layers = check_layers(layers, target.num_layers)
    k, n = part
    if not 1 <= k <= n:
        raise ConfigError(f"feature part must be K/N with 1 <= K <= N, got {k}/{n}")
    folder = Path(folder) if folder else feature_dir(corpus.name, layers)
    if corpus.manifest["target"]["fingerprint"] != target.fingerprint():
        raise DataError(f"corpus {corpus.path} was regenerated by another target than {target.name!r}")
    writer = FeatureWriter.for_target(folder, corpus_name=corpus.name, target=target, layers=layers)
    todo = [
        i
        for i, record in enumerate(corpus.manifest["shards"])
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
    if n > 1 and _stale_shards(_read_manifest(folder), corpus):  # every writer's records, on disk now
        return None  # the other parts' shards are still being computed
    return FeatureStore(corpus, layers, folder)  # a lone writer's missing shard is an error here
