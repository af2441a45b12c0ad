"""The README stays what a newcomer reads in ten minutes: short, with a complete map of the code."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
#: the README's budget: everything longer belongs in an experiment's README or a docstring
MAX_LINES = 215
#: the map is near the top: it starts within this many lines
MAP_WITHIN_LINES = 40
#: top-level folders that pyproject.toml does not map into the package but the map must show
UNMAPPED_FOLDERS = {"plugins", "experiments", "tests"}


def mapped_folders() -> set[str]:
    """The repository folders pyproject.toml maps into ``jetflow`` (``core``, ``drafters``, ...)."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {path.split("/")[0] for path in package_dir.values()}


def code_map() -> str:
    """The first fenced block of the README, the map of the code."""
    found = re.search(r"```\n(.*?)```", README, re.S)
    assert found, "the README opens with a map of the code in a fenced block"
    return found.group(1)


def test_readme_is_short() -> None:
    assert len(README.splitlines()) <= MAX_LINES


def test_the_map_of_the_code_names_every_top_level_folder() -> None:
    listed = {line.split("/")[0] for line in code_map().splitlines() if re.match(r"^[a-z][\w-]*/", line)}
    assert mapped_folders() | UNMAPPED_FOLDERS <= listed


def test_the_map_is_near_the_top() -> None:
    assert README[: README.index(code_map())].count("\n") < MAP_WITHIN_LINES
