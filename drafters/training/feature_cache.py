"""The feature cache of a corpus on disk: its layout, the writer of its shards and the memory-mapped store.

For every corpus sequence of ``T`` tokens the cache holds, at the ``T - 1`` positions that
have a next token, the outputs of the chosen decoder layers (``features [T-1, k, H]``) and
the final normed hidden state (``final [T-1, H]``); the frozen LM head turns ``final`` into
the teacher distribution, so the 49K-wide logits are never stored. Everything is fp16.

Layout: ``cache_root()/features/<corpus name>/layers-<a>-<b>-.../`` holds one pair of
``.npy`` files per corpus shard plus a manifest naming, per shard, the checksum of the
corpus tokens it was computed from and the precision the target ran in (fp32 and bf16 states
differ, so a shard computed in another precision is stale too): a stale or missing shard is
detected, never read; shards recorded before the precision was are taken as they are.
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
from jetflow.core.cache_root import cache_root
from jetflow.core.errors import DataError
from jetflow.core.precision import dtype_name
from jetflow.core.target import Target
from jetflow.drafters.training.corpus import Corpus
from torch import Tensor

log = logging.getLogger(__name__)

FEATURES_FORMAT = 1
MANIFEST_NAME = "manifest.json"
#: guards the manifest's read-merge-write, so processes splitting one corpus can share a folder
MANIFEST_LOCK = ".manifest.lock"
FEATURE_DTYPE = torch.float16


def feature_dir(corpus_name: str, layers: Sequence[int]) -> Path:
    """Cache folder for the features of ``layers`` over the corpus called ``corpus_name``."""
    return cache_root() / "features" / corpus_name / ("layers-" + "-".join(str(x) for x in layers))


def read_manifest(folder: Path) -> dict | None:
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
        previous = read_manifest(self.folder)
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
            on_disk = read_manifest(self.folder)
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
        manifest = read_manifest(self.folder)
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
        stale = stale_shards(manifest, corpus, n_shards)
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

    def tokens(self, i: int) -> tuple[Tensor, int]:
        """``tokens [T]`` int64 and the prompt length of sequence ``i``."""
        if not 0 <= i < self._length:
            raise IndexError(f"sequence {i} out of range for a store of {self._length}")
        return self.corpus.sequence(i)

    def sequences(self, indices: Sequence[int]) -> list[tuple[Tensor, int, Tensor, Tensor]]:
        """The sequences ``indices``, as :meth:`sequence` reads each (memory-mapped: no batching to gain)."""
        return [self.sequence(int(i)) for i in indices]

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


def stale_shards(manifest: dict | None, corpus: Corpus, n_shards: int | None = None) -> list[int]:
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
        manifest = read_manifest(folder)
        if manifest is not None and set(layers) <= set(manifest["layers"]):
            return folder
    return exact
