"""Moved to :mod:`jetflow.core.atomic`, the one atomic-write helper; kept until its importers switch."""

from jetflow.core.atomic import atomic_path, remove_staging_files, write_json_atomic

__all__ = ["atomic_path", "remove_staging_files", "write_json_atomic"]
