"""Flags that several commands share."""

from __future__ import annotations

import argparse


def add_compile_flag(parser: argparse.ArgumentParser) -> None:
    """``--compile`` / ``--no-compile``: the compiled target forward, on or off (default: the config's,
    whose default compiles where a calibration made with ``--compile`` shows it pays)."""
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="verify through the target compiled by inductor, one graph per tree-size bucket, "
        "compiled on first use and cached on disk (--no-compile: the eager forward; default: "
        "compiled where `jetflow calibrate --compile` measured that it pays)",
    )
