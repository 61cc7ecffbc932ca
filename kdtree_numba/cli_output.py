"""What ``kdtree-run`` writes to stdout (issue 14): text as rounds commit, text blocks, token
ids, or one JSON object.

* One text prompt (``--prompt``, ``--prompt-text-file`` or the built-in text prompt) and no
  ``--json``: the continuation is streamed, each round's complete characters written and
  flushed as the round commits (:class:`TextStream`; a token that ends inside a UTF-8
  character waits for the rest), then one newline.
* Several text prompts: each continuation once generation is done, in a block headed
  ``==> i/n LABEL <==`` (as ``head`` heads files), blocks separated by a blank line.
* Token-id prompts (``--prompt-ids``, ``--prompt-file``, or the built-in ids prompt of a
  model without a tokenizer): one line of comma-separated new token ids per prompt.
* ``--json``: ``{"text": [...], "tokens": [[...], ...], "stats": {...}}``, ``text`` holding
  one decoded continuation per prompt (each null when the model has no tokenizer).

Stdout carries only that; notices, progress and stats go to stderr.  A progress line on stderr
would garble text streamed to the same terminal, so it is off while text streams there
(:func:`same_terminal`); there, the prompt is written to stderr just before the stream, so the
terminal reads as prompt + continuation while stdout, redirected, holds the continuation alone.
"""
from __future__ import annotations

import json
import os
import sys

from kdtree_numba.text import TextCodec

__all__ = ["TextStream", "same_terminal", "print_result", "json_result"]


def same_terminal(out=None, err=None) -> bool:
    """True when ``out`` and ``err`` (stdout and stderr) are one terminal: a ``\\r`` line
    drawn on err would cut into the text on out."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        a, b = out.fileno(), err.fileno()
        return os.isatty(a) and os.isatty(b) and os.fstat(a).st_rdev == os.fstat(b).st_rdev
    except (AttributeError, OSError, ValueError):   # not a real file (a test's capture)
        return False


class TextStream:
    """The engine's ``stream`` callback for one request: writes the new complete text of
    request 0 to ``out`` and flushes it, each time the engine commits."""

    def __init__(self, codec: TextCodec, out=None):
        self.decoder = codec.stream()
        self.out = sys.stdout if out is None else out

    def __call__(self, tokens) -> None:
        new = tokens[0][len(self.decoder.ids):]
        if new:
            self._write(self.decoder.push(new))

    def close(self) -> None:
        """The rest of the text and the final newline."""
        self._write(self.decoder.flush() + "\n")

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()


def json_result(tokens, codec: TextCodec | None, stats) -> str:
    return json.dumps({"text": [None if codec is None else codec.decode(t) for t in tokens],
                       "tokens": tokens, "stats": stats.to_dict()})


def print_result(tokens, where: list[str], codec: TextCodec | None, as_text: bool,
                 out=None) -> None:
    """Everything but streaming and ``--json``: text blocks or id lines."""
    out = sys.stdout if out is None else out
    if not as_text:
        for toks in tokens:
            out.write(",".join(str(t) for t in toks) + "\n")
        return
    n = len(tokens)
    for i, (toks, label) in enumerate(zip(tokens, where)):
        if i:
            out.write("\n")
        out.write(f"==> {i + 1}/{n} {label} <==\n{codec.decode(toks)}\n")
    out.flush()
