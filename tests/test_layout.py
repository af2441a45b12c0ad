"""The repository's folders never shadow a module that jetflow or its dependencies import.

The package folders sit at the repository root and are mapped into ``jetflow`` by pyproject.toml,
so whenever Python runs from the root (pytest, ``python -m``), the root is on ``sys.path`` ahead of
site-packages and each folder is also importable under its bare name. A folder named like an
installed or standard module then hides it: the tree-attention folder, once ``kernels/``, broke
every import of transformers when transformers 5.25 began to import the ``kernels`` distribution.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The project's own names: jetflow's package, and the test package (a stray top-level ``tests`` in a
# third-party wheel is never imported by anything).
OWN_NAMES = {"jetflow", "tests"}


def root_packages() -> list[str]:
    """The folders at the repository root that Python can import by their bare names."""
    return sorted(path.name for path in ROOT.iterdir() if (path / "__init__.py").is_file())


def test_the_mapped_folders_are_found_at_the_root() -> None:
    assert {"attention", "core", "drafters"} <= set(root_packages())


def test_no_root_folder_shadows_an_installed_or_standard_module() -> None:
    installed = importlib.metadata.packages_distributions()
    clashes = {
        name: installed.get(name, ["the standard library"])
        for name in root_packages()
        if name not in OWN_NAMES and (name in installed or name in sys.stdlib_module_names)
    }
    assert not clashes, (
        f"repository folders shadow modules of the same name while Python runs from the root: {clashes}; "
        "rename the folder and its mapping in pyproject.toml"
    )
