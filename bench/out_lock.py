"""One bench run per output folder: a lock held for the whole run.

Two runs writing one folder from scratch would each replace the other's ``results.json`` and
both report success. A run without ``--resume`` therefore holds the folder alone; runs with
``--resume`` (each measuring its own data sets, merged under ``results.json``'s own lock)
share it with one another but not with a run that starts anew. The lock is an ``flock`` on a
hidden file in the folder, so a killed run releases it with its process.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from jetflow.core.errors import ConfigError

#: under the output folder: the lock file, holding the process id of the run that took it last
LOCK_FILE = ".bench.lock"


@contextmanager
def hold_out_folder(folder: Path, *, shared: bool) -> Iterator[None]:
    """Hold ``folder`` for one run (``shared``: for resumed runs), or fail at once naming its holder."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / LOCK_FILE).open("a+") as handle:
        try:
            fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise ConfigError(
                f"{folder} is in use by another bench run (pid {holder}); use another --out "
                "(only runs with --resume, each given its own --datasets, can share one)"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
