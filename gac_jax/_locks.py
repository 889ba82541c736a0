"""An exclusive lock between processes on one machine (or a shared POSIX file system): the
processes of a sweep each need the same thing made once (a tfds dataset, a warm start); the
first to take the lock makes it, the others wait and then find it made.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def exclusive_lock(path: str | Path) -> Iterator[None]:
    """Holds an `fcntl` lock on the file `path` (created with its folders if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
