"""Text in and text out: a bundle's tokenizer as a codec (issue 14).

    codec = load_codec("kdtree_numba/demo/demo-target.kdtr")   # None: the bundle has none
    ids = codec.encode("def fibonacci(n):")                    # [bos] + the text's tokens
    text = codec.decode(new_ids)
    stream = codec.stream()
    for round_ids in rounds:                                   # tokens as rounds commit them
        sys.stdout.write(stream.push(round_ids))
    sys.stdout.write(stream.flush())

The tokenizer is HF ``tokenizers``' JSON (``tokenizer.json``), stored in the bundle as bytes
(kdtree_numba/bundle.py, ``BundleTokenizer``) and parsed with ``Tokenizer.from_str``: JSON
only, nothing is ever unpickled.  ``encode_special_tokens`` is set on every loaded tokenizer
(tokenizer.json does not keep it), so text that spells ``<|endoftext|>`` encodes as text and a
control token only ever comes from its id.  A text prompt is ``[bos_id] + encode(text)`` when
the bundle names a ``tokenizer.bos_id`` (the demo target: 0, the ``<|endoftext|>`` that began
every training file), else the text's tokens alone.  Decoding keeps special tokens: a model
that ends a file and starts another shows ``<|endoftext|>`` where it did.
"""
from __future__ import annotations

import os
from typing import Iterable

from tokenizers import Tokenizer

from kdtree_numba.bundle import BundleError, BundleTokenizer, read_bundle_config, \
    read_bundle_tokenizer

__all__ = ["TextCodec", "StreamDecoder", "TokenizerError", "load_codec", "REPLACEMENT"]

REPLACEMENT = "\ufffd"   # what a byte-level decoder shows for an incomplete UTF-8 sequence


class TokenizerError(ValueError):
    """A tokenizer that cannot be read, or does not fit the model it comes with."""


class TextCodec:
    """Text <-> token ids with an HF ``tokenizers.Tokenizer`` and the prompt convention
    (``bos_id`` in front of every encoded text, or nothing)."""

    def __init__(self, tokenizer: Tokenizer, bos_id: int | None = None):
        tokenizer.encode_special_tokens = True
        self.tokenizer = tokenizer
        self.bos_id = bos_id
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        # ids need not be dense: the vocabulary a model must cover is the highest id + 1
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        if bos_id is not None and tokenizer.id_to_token(bos_id) is None:
            raise TokenizerError(f"tokenizer.bos_id {bos_id} is not a token of the tokenizer "
                                 f"(ids 0 to {self.vocab_size - 1})")

    @classmethod
    def from_json(cls, data: bytes | str, bos_id: int | None = None,
                  model_vocab: int | None = None) -> "TextCodec":
        """A codec from tokenizer.json's text.  ``model_vocab``: the vocabulary of the model it
        serves; a tokenizer with ids beyond it is refused (its tokens could not be fed)."""
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
        try:
            tok = Tokenizer.from_str(text)
        except Exception as e:   # tokenizers raises a bare Exception for every parse problem
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerError(f"not an HF tokenizers JSON: {first}") from None
        codec = cls(tok, bos_id)
        if model_vocab is not None and codec.vocab_size > model_vocab:
            raise TokenizerError(f"the tokenizer has ids up to {codec.vocab_size - 1}, beyond "
                                 f"the model's vocabulary of {model_vocab} (ids 0 to "
                                 f"{model_vocab - 1})")
        if model_vocab is not None and bos_id is not None and bos_id >= model_vocab:
            raise TokenizerError(f"tokenizer.bos_id {bos_id} is outside the model's "
                                 f"vocabulary of {model_vocab}")
        return codec

    def encode(self, text: str) -> list[int]:
        """The ids of a text prompt: ``[bos_id] +`` the text's tokens (no other special
        token is added; text that spells one encodes as text)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.bos_id is not None else []) + list(ids)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``, special tokens shown; an incomplete UTF-8 sequence at the end
        (a byte-level token cut off from the rest of its character) shows as U+FFFD."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def stream(self) -> "StreamDecoder":
        """An incremental decoder for tokens that arrive a few at a time."""
        return StreamDecoder(self)


class StreamDecoder:
    """Text of a growing token sequence, piece by piece: the pieces that :meth:`push` returns,
    followed by :meth:`flush`'s, are exactly ``decode(all ids)``, and a piece never ends in the
    middle of a character (a byte-level token can hold part of one; its text waits for the
    token that completes it).

    The way vLLM's detokenizer does it: decode the ids from the start of the last piece
    (``prefix``) and drop the text of that piece, so that a decoder whose output depends on
    its neighbours (a leading space, a byte split across tokens) sees context, while each push
    decodes only a few tokens."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self._prefix = 0   # start of the last piece returned
        self._read = 0     # end of the text returned so far

    def push(self, ids: Iterable[int]) -> str:
        """Add tokens; the new text that is complete (may be empty)."""
        self.ids.extend(int(i) for i in ids)
        return self._take(final=False)

    def flush(self) -> str:
        """The rest, incomplete characters included (as U+FFFD, as ``decode`` shows them)."""
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        done = self.codec.decode(self.ids[self._prefix:self._read])
        full = self.codec.decode(self.ids[self._prefix:])
        if not final and (full.endswith(REPLACEMENT) or len(full) <= len(done)):
            return ""   # the last token ends inside a character: wait for the rest
        self._prefix, self._read = self._read, len(self.ids)
        return full[len(done):]


def load_codec(path, *, verify: bool = True) -> TextCodec | None:
    """The codec of the bundle at ``path``, or None when it carries no tokenizer.  Its JSON is
    CRC32C-checked (unless ``verify=False``) and checked against the bundle's own
    vocabulary: a problem is a BundleError naming the file."""
    path = os.fspath(path)
    blob: BundleTokenizer | None = read_bundle_tokenizer(path, verify=verify)
    if blob is None:
        return None
    config, _ = read_bundle_config(path)
    try:
        return TextCodec.from_json(blob.json, blob.bos_id, config.vocab_size)
    except (TokenizerError, UnicodeDecodeError) as e:
        raise BundleError(f"{path}: its tokenizer: {e}") from None
