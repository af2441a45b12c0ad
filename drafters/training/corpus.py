"""The regenerated training corpus on disk: shard format, writer and reader.

A corpus is a folder holding ``manifest.json`` and ``shard-NNNNN.safetensors`` files. Each
shard stores its sequences (prompt followed by the target's response) as one flat
``tokens`` array (uint16 when the vocabulary fits, else int32), ``offsets`` ``[n + 1]`` and
``prompt_lengths`` ``[n]``, plus the sample ids in its metadata: compact enough to commit
and readable without unpickling anything. The manifest lists only complete shards, so a
reader or a resumed writer never sees a partial one.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict

import torch
from jetflow.core.atomic import atomic_path, remove_staging_files, write_json_atomic
from jetflow.core.errors import DataError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

log = logging.getLogger(__name__)

CORPUS_FORMAT = 1
MANIFEST_NAME = "manifest.json"
#: Settings a resumed run must share with the shards already written (batch and shard sizes
#: may change: greedy answers do not depend on them).
RESUME_KEYS = ("max_new_tokens", "max_prompt_tokens", "dtype", "chat_template")


def token_dtype(vocab_size: int) -> torch.dtype:
    """The narrowest dtype that holds every token id: uint16 halves the committed size."""
    return torch.uint16 if vocab_size <= 2**16 else torch.int32


def shard_file_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def tokens_digest(tokens: Tensor) -> str:
    """Short content hash of a shard's tokens; ties a feature shard to its corpus shard."""
    return hashlib.sha256(tokens.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


@dataclass(frozen=True)
class ShardRecord:
    """One complete shard as listed in the manifest."""

    file: str
    n_sequences: int
    n_prompt_tokens: int
    n_response_tokens: int
    tokens_sha256: str


@dataclass(frozen=True)
class CorpusShard:
    """One shard's tensors: flat ``tokens [N]``, ``offsets [n+1]``, ``prompt_lengths [n]``."""

    ids: list[str]
    tokens: Tensor
    offsets: Tensor
    prompt_lengths: Tensor

    def __len__(self) -> int:
        return len(self.ids)

    def sequence(self, i: int) -> Tensor:
        """Token ids ``[T]`` (int64) of sequence ``i`` of this shard."""
        return self.tokens[int(self.offsets[i]) : int(self.offsets[i + 1])].long()


def pack_shard(
    ids: Sequence[str], sequences: Sequence[Tensor], prompt_lengths: Sequence[int], dtype: torch.dtype
) -> CorpusShard:
    """Concatenate sequences ``[T_i]`` into the flat shard layout."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    tokens = torch.cat([s.to(torch.int64) for s in sequences]).to(dtype)
    return CorpusShard(list(ids), tokens, offsets, torch.tensor(list(prompt_lengths), dtype=torch.int64))


def write_shard(path: Path, shard: CorpusShard) -> ShardRecord:
    """Write ``shard`` atomically and return its manifest record."""
    tensors = {"tokens": shard.tokens, "offsets": shard.offsets, "prompt_lengths": shard.prompt_lengths}
    with atomic_path(path) as staging:
        save_file(tensors, str(staging), metadata={"ids": json.dumps(shard.ids)})
    n_prompt = int(shard.prompt_lengths.sum())
    return ShardRecord(
        file=path.name,
        n_sequences=len(shard),
        n_prompt_tokens=n_prompt,
        n_response_tokens=int(shard.offsets[-1]) - n_prompt,
        tokens_sha256=tokens_digest(shard.tokens),
    )


def read_shard(path: Path) -> CorpusShard:
    """Load one shard, raising :class:`DataError` naming the file when it is truncated or malformed."""
    from safetensors import safe_open

    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as handle:
            ids = json.loads((handle.metadata() or {})["ids"])
        shard = CorpusShard(ids, tensors["tokens"], tensors["offsets"], tensors["prompt_lengths"])
    except FileNotFoundError as error:
        raise DataError(f"{path}: corpus shard missing") from error
    except (SafetensorError, OSError, KeyError, ValueError) as error:
        raise DataError(f"{path}: truncated or malformed corpus shard ({error})") from error
    n = len(shard.ids)
    if shard.offsets.shape != (n + 1,) or shard.prompt_lengths.shape != (n,):
        raise DataError(f"{path}: corpus shard has {n} ids but inconsistent offsets/prompt_lengths")
    if int(shard.offsets[-1]) != shard.tokens.numel():
        raise DataError(f"{path}: corpus shard offsets do not cover its {shard.tokens.numel()} tokens")
    return shard


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise DataError(
            f"{folder}: no corpus here (missing {MANIFEST_NAME}); create one with `jetflow data regenerate`"
        ) from error
    except (OSError, ValueError) as error:
        raise DataError(f"{path}: unreadable corpus manifest ({error})") from error
    if not isinstance(manifest, dict) or manifest.get("format") != CORPUS_FORMAT:
        raise DataError(f"{path}: not a jetflow corpus manifest of format {CORPUS_FORMAT}")
    return manifest


class Corpus:
    """Read-only view of the complete shards of a corpus folder (loaded eagerly: it is small)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.shards = [read_shard(self.path / record["file"]) for record in self.manifest["shards"]]
        for record, shard in zip(self.manifest["shards"], self.shards, strict=True):
            if tokens_digest(shard.tokens) != record["tokens_sha256"]:
                raise DataError(f"{self.path / record['file']}: tokens differ from the manifest's checksum")
        if self.ids != self.manifest["ids"]:
            raise DataError(f"{self.path}: the shards' ids differ from the manifest's id list")
        sizes = torch.tensor([len(s) for s in self.shards], dtype=torch.int64)
        self._starts = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])

    @property
    def name(self) -> str:
        return self.path.resolve().name

    @property
    def ids(self) -> list[str]:
        return [i for shard in self.shards for i in shard.ids]

    def __len__(self) -> int:
        return int(self._starts[-1])

    def locate(self, i: int) -> tuple[int, int]:
        """(shard index, index within shard) of global sequence ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range for a corpus of {len(self)}")
        shard = int(torch.searchsorted(self._starts, torch.tensor(i), right=True)) - 1
        return shard, i - int(self._starts[shard])

    def sequence(self, i: int) -> tuple[Tensor, int]:
        """Token ids ``[T]`` (int64, prompt then response) and the prompt length of sequence ``i``."""
        s, j = self.locate(i)
        shard = self.shards[s]
        return shard.sequence(j), int(shard.prompt_lengths[j])

    def stats(self) -> CorpusStats:
        """This corpus's part of what ``jetflow data stats --json`` prints."""
        return {
            "source": str(self.manifest["source"]),
            "target": str(self.manifest["target"]["name"]),
            "n_conversations": len(self),
            "n_response_tokens": int(self.manifest["counts"]["n_response_tokens"]),
            "corpus": self.name,
        }


class CorpusStats(TypedDict):
    """One corpus in ``jetflow data stats``: where it comes from and how big it is."""

    source: str
    target: str
    n_conversations: int
    n_response_tokens: int
    corpus: str


class CombinedStats(TypedDict):
    """The corpora a trainer reads together, in ``jetflow data stats``."""

    source: str
    target: str
    n_conversations: int
    n_sequences: int
    n_response_tokens: int
    corpora: list[CorpusStats]


def combined_stats(corpora: Sequence[Corpus]) -> CombinedStats:
    """What ``jetflow data stats --json`` prints for the corpora a trainer reads together.

    ``n_conversations`` counts distinct conversations (a second turn belongs to the
    conversation of its first), ``n_sequences`` every trained sequence, and
    ``n_response_tokens`` the response tokens of them all; ``corpora`` has each one's stats.
    """
    parts = [corpus.stats() for corpus in corpora]
    return {
        "source": "+".join(dict.fromkeys(part["source"] for part in parts)),
        "target": "+".join(dict.fromkeys(part["target"] for part in parts)),
        "n_conversations": len({i for corpus in corpora for i in corpus.ids}),
        "n_sequences": sum(len(corpus) for corpus in corpora),
        "n_response_tokens": sum(part["n_response_tokens"] for part in parts),
        "corpora": parts,
    }


class CorpusWriter:
    """Appends complete shards to a corpus folder and rewrites its manifest after each one.

    ``header`` holds the run's description (source, target, settings, selection); when the
    folder already holds shards, its settings must match (see :data:`RESUME_KEYS`) and the
    new run continues after the last complete shard.
    """

    def __init__(self, path: Path, header: dict) -> None:
        self.path = Path(path)
        self.manifest = {"format": CORPUS_FORMAT, **header, "ids": [], "shards": [], "counts": {}}
        self.manifest["regeneration"] = {"wall_time_s": 0.0, "cpu_time_s": 0.0}
        if remove_staging_files(self.path):
            log.info("%s: removed files of an interrupted write", self.path)
        if (self.path / MANIFEST_NAME).exists():
            previous = read_manifest(self.path)
            self._check_compatible(previous, header)
            for key in ("ids", "shards", "regeneration"):
                self.manifest[key] = previous[key]
        self._update_counts()

    @property
    def n_sequences(self) -> int:
        return len(self.manifest["ids"])

    @property
    def n_shards(self) -> int:
        return len(self.manifest["shards"])

    def append(self, shard: CorpusShard, wall_time_s: float, cpu_time_s: float = 0.0) -> ShardRecord:
        """Write ``shard`` as the next shard, then the manifest that lists it.

        ``cpu_time_s`` (this process's CPU seconds) tells, beside wall time, how much of
        the machine the run got: on a shared machine the two differ a lot.
        """
        record = write_shard(self.path / shard_file_name(self.n_shards), shard)
        self.manifest["shards"].append(asdict(record))
        self.manifest["ids"].extend(shard.ids)
        regeneration = self.manifest["regeneration"]
        regeneration["wall_time_s"] = round(regeneration["wall_time_s"] + wall_time_s, 2)
        regeneration["cpu_time_s"] = round(regeneration.get("cpu_time_s", 0.0) + cpu_time_s, 2)
        self._update_counts()
        write_json_atomic(self.path / MANIFEST_NAME, self.manifest)
        return record

    def _update_counts(self) -> None:
        shards = self.manifest["shards"]
        counts = {
            "n_conversations": sum(s["n_sequences"] for s in shards),
            "n_prompt_tokens": sum(s["n_prompt_tokens"] for s in shards),
            "n_response_tokens": sum(s["n_response_tokens"] for s in shards),
        }
        self.manifest["counts"] = counts
        regeneration = self.manifest["regeneration"]
        seconds = regeneration["wall_time_s"]
        regeneration["response_tokens_per_s"] = (
            round(counts["n_response_tokens"] / seconds, 2) if seconds else 0
        )
        total = counts["n_prompt_tokens"] + counts["n_response_tokens"]
        regeneration["tokens_per_s"] = round(total / seconds, 2) if seconds else 0

    def _check_compatible(self, previous: dict, header: dict) -> None:
        differences = [
            f"{key}: {previous['settings'].get(key)!r} there, {header['settings'].get(key)!r} now"
            for key in RESUME_KEYS
            if previous["settings"].get(key) != header["settings"].get(key)
        ]
        if previous["source"] != header["source"]:
            differences.append(f"source: {previous['source']!r} there, {header['source']!r} now")
        if previous["target"]["fingerprint"] != header["target"]["fingerprint"]:
            differences.append("target fingerprint differs")
        if differences:
            raise DataError(
                f"{self.path}: cannot resume a corpus made with other settings ({'; '.join(differences)}); "
                "choose another --out or remove the folder"
            )
