"""The name rules of docs/FORMAT.md ("Pools": Names; codes K039-K041), in one place for the
reader, the writer and the HDF5 / safetensors importers, so that nothing is written that a
reader would reject."""
from __future__ import annotations

import re

from . import layout as L
from .errors import KdtrError

__all__ = ["check_name", "split_path"]

_BAD_NAME_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f/]")


def check_name(name: str, where: str) -> None:
    """The name rules of FORMAT.md (shared by reader and writer, so we never write what we reject)."""
    if not isinstance(name, str):
        raise TypeError(f"names are str, got {type(name).__name__}")
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: not storable as strict UTF-8
        raise KdtrError("K039", f"name {name!a} is not valid UTF-8: {e.reason}", where) from None
    if name in ("", ".", "..") or _BAD_NAME_CHARS.search(name):
        raise KdtrError("K040", f"name {name!a} is empty, '.', '..', or holds '/' or a "
                                f"control character", where)
    if len(raw) > L.MAX_NAME_BYTES:
        raise KdtrError("K041", f"{len(raw)} bytes > {L.MAX_NAME_BYTES}", where)


def split_path(path: str) -> list[str]:
    """``"/a/b/"`` -> ``["a", "b"]``; the root ("/" or "") has no components."""
    return [p for p in path.strip("/").split("/")] if path.strip("/") else []
