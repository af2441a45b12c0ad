"""Dependencies run one way: decoding with any learned drafter imports nothing from ``training/``."""

from __future__ import annotations

import subprocess
import sys

INFERENCE_MODULES = (
    "jetflow.drafters.jetflow.plugin",
    "jetflow.drafters.dflash.plugin",
    "jetflow.drafters.eagle.plugin",
    "jetflow.core.engine",
    "jetflow.core.composition",
)


def test_inference_code_imports_no_training_module() -> None:
    script = (
        "import sys\n"
        + "".join(f"import {name}\n" for name in INFERENCE_MODULES)
        + "print(sorted(m for m in sys.modules if m.startswith('jetflow.drafters.training')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
