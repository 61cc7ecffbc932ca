"""The one error class of the formats package: every malformed or hostile input (KDTR, HDF5,
safetensors) raises ``KdtrError`` with the code of the rule it broke (``formats.layout.RULES``,
documented in docs/FORMAT.md)."""
from __future__ import annotations

from . import layout as L

__all__ = ["KdtrError"]


class KdtrError(ValueError):
    """A malformed or hostile KDTR (or HDF5) input.  ``code`` is the rule in docs/FORMAT.md."""

    def __init__(self, code: str, detail: str, node: str | None = None):
        self.code, self.rule, self.detail, self.node = code, L.RULES[code], detail, node
        where = f" at {node!a}" if node is not None else ""
        super().__init__(f"{code} {self.rule}{where}: {detail}")

    def __reduce__(self):  # copy and process pools rebuild exceptions from this
        return type(self), (self.code, self.detail, self.node)
