"""The one error class of the formats package: every malformed or hostile input (KDTR, HDF5,
safetensors) raises ``KdtrError`` with the code of the rule it broke (``formats.layout.RULES``,
documented in docs/FORMAT.md)."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

from . import layout as L

__all__ = ["KdtrError", "about_file"]


class KdtrError(ValueError):
    """A malformed or hostile KDTR (or HDF5, safetensors) input.  ``code`` is the rule in
    docs/FORMAT.md, ``node`` the path (or ``node #i``) at fault, ``file`` the file, where
    known: ``K056 tensor checksum mismatch at '/w' in file 'm.kdtr': stored ..., computed ...``.
    The message always starts with the code."""

    def __init__(self, code: str, detail: str, node: str | None = None,
                 file: str | None = None):
        self.code, self.rule, self.detail, self.node = code, L.RULES[code], detail, node
        self.file = None if file is None else os.fsdecode(file)
        super().__init__(self._message())

    def _message(self) -> str:
        return self.describe()

    def describe(self, with_file: bool = True) -> str:
        """The message; ``with_file=False`` leaves the file out (for a line that names it)."""
        where = f" at {self.node!a}" if self.node is not None else ""
        if with_file and self.file is not None:
            where += f" in file {self.file!a}"
        return f"{self.code} {self.rule}{where}: {self.detail}"

    def set_file(self, file) -> "KdtrError":
        """Name the file this error is about (once: the innermost file wins)."""
        if self.file is None:
            self.file = os.fsdecode(file)
            self.args = (self._message(),)
        return self

    def __reduce__(self):  # copy and process pools rebuild exceptions from this
        return type(self), (self.code, self.detail, self.node, self.file)


@contextlib.contextmanager
def about_file(file) -> Iterator[None]:
    """Within the block, a ``KdtrError`` that names no file is given ``file``."""
    try:
        yield
    except KdtrError as e:
        e.set_file(file)
        raise
