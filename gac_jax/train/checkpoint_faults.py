"""What goes wrong with checkpoints, said in one line: a step that cannot be read back
(`DamagedCheckpointError`), a disk that cannot take a save (`disk_errno`), and the cause
of either cut to its first line (`short_cause`; tensorstore's errors carry kilobytes of
spec)."""

from __future__ import annotations

import errno
import logging
import re
from pathlib import Path

# The errno of a disk that cannot take a save, as tensorstore spells it in its messages.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
CAUSE_CHARS = 200  # A cause longer than this is cut (tensorstore's specs run to kilobytes).


class DamagedCheckpointError(ValueError):
    """A finalised step whose files cannot be read back: truncated or missing data,
    manifests or metadata, or garbage in them."""

    def __init__(self, directory: Path, step: int, cause: BaseException):
        self.directory, self.step, self.cause = directory, step, cause
        super().__init__(
            f"checkpoint step {step} in {str(directory)!r} is damaged and cannot be read "
            f"({short_cause(cause)})"
        )


def disk_errno(error: BaseException) -> int | None:
    """The errno of a full, read-only or forbidden disk behind `error` (an OSError in its
    chain, or tensorstore's ``[os_error_code='28']``), or None."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in DISK_ERRNOS:
            return seen.errno
        match = re.search(r"os_error_code='(\d+)'", str(seen))
        if match and int(match.group(1)) in DISK_ERRNOS:
            return int(match.group(1))
        seen = seen.__cause__ or seen.__context__
    return None


def failed_write_record(record: logging.LogRecord) -> bool:
    """Orbax's log of a writer thread's exception: the caller gets the error itself."""
    return "raised an exception" in record.getMessage()


def short_cause(error: BaseException) -> str:
    """The first line of `error`'s message, without tensorstore's spec dump, at most
    `CAUSE_CHARS` characters, prefixed with its type."""
    text = str(error).strip().strip("'\"")
    for marker in (" See full TensorStore details", " [tensorstore_spec", "\n"):
        text = text.split(marker)[0]
    if len(text) > CAUSE_CHARS:
        text = text[: CAUSE_CHARS - 3] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
