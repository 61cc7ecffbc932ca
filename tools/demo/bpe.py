"""The byte-level BPE tokenizer (HF ``tokenizers``) and the flat token streams.

Special tokens: ``<|endoftext|>`` (id 0) precedes every file in the streams, so it is the
model's BOS and EOS; ``<|mask|>`` (id 1) is never in the data: the block drafter's MASK input.
A tokenizer travels as its JSON text only (``Tokenizer.from_str``/``to_str``): nothing here
unpickles.  ``encode_special_tokens`` is switched on at every load (the JSON does not keep it),
so source text that spells ``<|endoftext|>`` (tokenizer code does) encodes as plain text and a
control token only ever comes from its id.
"""
from __future__ import annotations

import os

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = (EOT, MASK)


def train_bpe(texts, vocab_size: int) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` entries (the 256 bytes, the merges, the specials)
    trained on the iterable ``texts``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.encode_special_tokens = True
    if [tok.token_to_id(t) for t in SPECIAL_TOKENS] != [0, 1]:
        raise RuntimeError("the special tokens did not get ids 0 and 1")
    return tok


def load_bpe(json_text: str) -> Tokenizer:
    tok = Tokenizer.from_str(json_text)
    tok.encode_special_tokens = True
    return tok


def encode_texts(tok: Tokenizer, texts: list[str], chunk: int = 1024) -> list[np.ndarray]:
    """Token ids of each text (uint16), in chunks so the Rust side runs on all its threads
    (RAYON_NUM_THREADS) without holding every Encoding object at once."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)   # no offsets: faster
    out = []
    for i in range(0, len(texts), chunk):
        for enc in encode(texts[i:i + chunk], add_special_tokens=False):
            out.append(np.asarray(enc.ids, dtype=np.uint16))
    return out


def token_stream(pieces: list[np.ndarray], eot_id: int = 0) -> np.ndarray:
    """One flat uint16 array: ``<|endoftext|>`` before every file."""
    total = sum(p.size + 1 for p in pieces)
    out = np.empty(total, np.uint16)
    pos = 0
    for p in pieces:
        out[pos] = eot_id
        out[pos + 1:pos + 1 + p.size] = p
        pos += 1 + p.size
    return out


def train_on_files(files, vocab_size: int, sample_mb: float) -> Tokenizer:
    """BPE trained on the train files (sha256 order, a spread of packages) up to ``sample_mb``
    MB of text: more changes the merges little and costs time (64 MB took 62 s on 2 cores)."""
    budget = sample_mb * 1e6

    def sample():
        used = 0
        for f in sorted((f for f in files if f.split == "train"), key=lambda f: f.sha256):
            if used >= budget:
                return
            used += len(f.text)
            yield f.text
    return train_bpe(sample(), vocab_size)


def cached_streams(files, tok, key: str, work: str, log):
    """The train and held-out streams, from ``work`` when this manifest + tokenizer made them
    before, else tokenised now and saved there (.npy, no pickle)."""
    os.makedirs(work, exist_ok=True)
    paths = {s: os.path.join(work, f"tokens-{key}-{s}.npy") for s in ("train", "heldout")}
    if all(os.path.exists(p) for p in paths.values()):
        log(f"token streams: reused {work}")
        return {s: np.load(p, mmap_mode="r", allow_pickle=False) for s, p in paths.items()}
    out = {}
    for split in ("train", "heldout"):
        part = [f.text for f in files if f.split == split]
        out[split] = token_stream(encode_texts(tok, part))
        tmp = paths[split] + ".tmp.npy"
        np.save(tmp, out[split], allow_pickle=False)
        os.replace(tmp, paths[split])
    log(f"token streams: {out['train'].size / 1e6:.2f} M train, "
        f"{out['heldout'].size / 1e6:.3f} M held-out tokens -> {work}")
    return out
