"""Dropping one known, harmless library log record while a call that emits it runs."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def absl_records_dropped(matches: Callable[[logging.LogRecord], bool]) -> Iterator[None]:
    """Drops the records of the ``absl`` logger (tfds and orbax log through it) for which
    `matches(record)` is true, only inside the block; every other record passes."""

    def record_filter(record: logging.LogRecord) -> bool:  # A callable is a logging filter.
        return not matches(record)

    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(record_filter)
    try:
        yield
    finally:
        absl_logger.removeFilter(record_filter)
