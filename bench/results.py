"""The results of a comparison run and their JSON form (``results.json``).

Schema (the keys every consumer may rely on; each run carries more detail after them)::

    {"machine": {...}, "target": str, "settings": {...},
     "runs": [{"method": str, "dataset": str, "budget": int | null, "n_prompts": int,
               "new_tokens": int, "tau": float, "tokens_per_s": float, "speedup_vs_ar": float,
               "draft_share": float, "lossless": bool | null, "dtype": str, ...}]}

``lossless`` is null for sampled runs (temperature > 0), whose outputs are not compared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jetflow.core.errors import ConfigError

#: the keys of a run that the issue fixes, in order, with their JSON types
RUN_KEYS: dict[str, tuple[type, ...]] = {
    "method": (str,),
    "dataset": (str,),
    "budget": (int, type(None)),
    "n_prompts": (int,),
    "new_tokens": (int,),
    "tau": (float,),
    "tokens_per_s": (float,),
    "speedup_vs_ar": (float,),
    "draft_share": (float,),
    "lossless": (bool, type(None)),
    "dtype": (str,),
}


@dataclass
class BenchResults:
    """Everything ``results.json`` holds."""

    machine: dict[str, Any]
    target: str
    settings: dict[str, Any]
    runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def lossless(self) -> bool:
        """False if any run diverged for real (rounding ties and unchecked sampled runs do not count)."""
        return all(run["lossless"] is not False for run in self.runs)

    def failures(self) -> list[str]:
        """One line per real divergence, for the CLI's error message."""
        lines = []
        for run in self.runs:
            budget = "" if run["budget"] is None else f" budget {run['budget']}"
            for d in run.get("divergences", []):
                if d["kind"] == "bug":
                    lines.append(
                        f"{run['method']}{budget} on {run['dataset']} sample {d['sample_id']} "
                        f"turn {d['turn']}: token {d['position']} is {d['got']}, baseline has {d['expected']}"
                    )
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {"machine": self.machine, "target": self.target, "settings": self.settings, "runs": self.runs}

    def write_json(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def read_json(cls, path: Path) -> BenchResults:
        try:
            data = json.loads(Path(path).read_text())
            return cls(data["machine"], data["target"], data["settings"], data["runs"])
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ConfigError(f"{path} is not a complete jetflow results file ({error})") from None
