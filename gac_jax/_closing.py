"""`with` blocks for the package's objects that have a `close()`."""

from typing import Self


class Closing:
    """`with obj:` gives `obj` and calls `obj.close()` when the block ends, however it ends."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
