"""Text in and out (issue 14): the codec and its streaming decoder, the tokenizer inside a
bundle, kdtr-import-hf copying it in, the shipped demo target, and kdtree-run with text.

Runs on the reference backend with the shipped demo target (kdtree_numba/demo/), ~0.5 s per
generation of 16 tokens on 2 cores.
"""
from __future__ import annotations

import configparser
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from formats import kdtr
from kdtree_numba import demo
from kdtree_numba.bundle import (BundleError, BundleTokenizer, random_weights, read_bundle,
                                 read_bundle_tokenizer, size_config, write_bundle)
from kdtree_numba.cli import default_model, run_main
from kdtree_numba.cli_output import TextStream
from kdtree_numba.config import weight_shapes
from kdtree_numba.engine import generate
from kdtree_numba.hf_import import export_hf_checkpoint
from kdtree_numba.hf_import import main as import_main
from kdtree_numba.text import REPLACEMENT, TextCodec, TokenizerError, load_codec

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "tools" / "data" / "heldout_prompts.jsonl"
REF = ["--backend", "reference"]
FIB = "def fibonacci(n):"


@pytest.fixture(autouse=True)
def no_debug_env(monkeypatch):
    monkeypatch.delenv("KDTREE_DEBUG", raising=False)


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    c = load_codec(demo.TARGET)
    assert c is not None
    return c


@pytest.fixture(scope="module")
def model():
    return default_model("reference")


def words_json(top_id: int = 3) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": top_id},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


# ----------------------------------------------------------------------------- the codec

@pytest.mark.parametrize("text", [
    "def fibonacci(n):\n    return n\n", "", " ", "\t\n\n", "x = '€ é 日本 🐍'\n",
    "s = '<|endoftext|>'  # spelled, not the control token\n", "a\r\nb", "\x00\x1b[31m"])
def test_codec_round_trips_text(codec, text):
    ids = codec.encode(text)
    assert ids[0] == 0 and codec.bos_id == 0          # <|endoftext|> began every training file
    assert 0 not in ids[1:] and 1 not in ids[1:]      # control tokens only ever from their ids
    assert codec.decode(ids[1:]) == text
    assert codec.decode(ids) == "<|endoftext|>" + text   # special tokens are shown


def test_codec_matches_the_prompt_convention_of_training(codec):
    """Every shipped held-out prompt encodes to the token count training recorded for it."""
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    assert len(rows) >= 64 and PROMPTS.stat().st_size < 100_000
    assert [len(codec.encode(r["text"])) for r in rows] == [r["n_tokens"] for r in rows]


def stream_pieces(codec, ids, cuts):
    dec = codec.stream()
    pieces, start = [], 0
    for end in cuts + [len(ids)]:
        pieces.append(dec.push(ids[start:end]))
        start = end
    return pieces, dec.flush()


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, 8191), max_size=40), data=st.data())
def test_streaming_decode_is_decode_of_all_ids(codec, ids, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=10)))
    pieces, rest = stream_pieces(codec, ids, cuts)
    assert "".join(pieces) + rest == codec.decode(ids)
    for p in pieces:                                  # nothing but flush ends mid-character
        assert not p.endswith(REPLACEMENT)


def test_streaming_holds_a_character_until_its_last_byte(codec):
    text = "π = '€日🐍'\n"
    ids = codec.encode(text)[1:]
    pieces, rest = stream_pieces(codec, ids, list(range(1, len(ids))))   # one token at a time
    assert "".join(pieces) + rest == text and rest == ""
    assert any(p == "" for p in pieces)               # some tokens hold only part of a character
    assert REPLACEMENT not in "".join(pieces)


def test_text_stream_writes_and_flushes_each_round(codec, model):
    class Out:
        def __init__(self):
            self.writes, self.flushes = [], 0

        def write(self, s):
            self.writes.append(s)

        def flush(self):
            self.flushes += 1
    out = Out()
    stream = TextStream(codec, out)
    calls = []

    def spy(tokens):
        calls.append(len(tokens[0]))
        stream(tokens)
    result = generate(model, [codec.encode(FIB)], 12, stream=spy)
    stream.close()
    assert calls == list(range(1, 13)) and len(calls) == result.stats.rounds + 1
    assert "".join(out.writes) == codec.decode(result.tokens[0]) + "\n"
    assert len(out.writes) > 2 and out.flushes == len(out.writes)


# ----------------------------------------------------------------------------- in a bundle

def test_tokenizer_rides_in_the_bundle_and_is_crc_checked(tmp_path):
    cfg = size_config("tiny")
    path = tmp_path / "t.kdtr"
    blob = BundleTokenizer(words_json().encode(), bos_id=2)
    write_bundle(path, cfg, random_weights(cfg, 0), tokenizer=blob)
    assert read_bundle_tokenizer(path) == blob
    got_cfg, weights = read_bundle(path)               # not a tensor: the model load ignores it
    assert set(weights) == set(weight_shapes(cfg))
    c = load_codec(path)
    assert c.encode("a b zzz") == [2, 1, 2, 0] and c.vocab_size == 4
    with kdtr.File(str(path)) as f:
        offset = f["tokenizer/json"].offset
    raw = bytearray(path.read_bytes())
    raw[offset + 3] ^= 0x01
    bad = tmp_path / "bad.kdtr"
    bad.write_bytes(bytes(raw))
    with pytest.raises(kdtr.KdtrError, match="K056.*tokenizer/json"):
        load_codec(bad)
    assert run_main(["--model", str(bad), "--prompt", "a"] + REF) == 2


def test_bundle_without_tokenizer_runs_on_ids_and_refuses_text(tmp_path, capsys):
    cfg = size_config("tiny")
    path = tmp_path / "ids.kdtr"
    write_bundle(path, cfg, random_weights(cfg, 0))
    assert read_bundle_tokenizer(path) is None and load_codec(path) is None
    assert run_main(["--model", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]
                    + REF) == 0
    out = capsys.readouterr().out
    assert len(out.strip().split(",")) == 4
    assert run_main(["--model", str(path), "--max-new-tokens", "4", "--json"] + REF) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["text"] == [None] and len(j["tokens"][0]) == 4   # the built-in ids prompt
    assert run_main(["--model", str(path), "--prompt", "hello"] + REF) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer; use --prompt-ids" in err and len(err.splitlines()) == 1


def test_tokenizer_beyond_the_model_vocabulary_is_refused_at_load(tmp_path):
    cfg = size_config("tiny")
    path = tmp_path / "wide.kdtr"
    write_bundle(path, cfg, random_weights(cfg, 0),
                 tokenizer=BundleTokenizer(words_json(top_id=300).encode()))
    with pytest.raises(BundleError, match="ids up to 300.*vocabulary of 128"):
        load_codec(path)
    with pytest.raises(TokenizerError, match="not an HF tokenizers JSON"):
        TextCodec.from_json(b"{}")


def test_import_copies_the_tokenizer(tmp_path, capsys):
    cfg = size_config("tiny", num_hidden_layers=1, first_k_dense_replace=1, bos_token_id=1)
    hf = tmp_path / "hf"
    export_hf_checkpoint(cfg, dict(random_weights(cfg, 0)), hf)
    assert import_main([str(hf), str(tmp_path / "none.kdtr")]) == 0
    assert "no tokenizer.json" in capsys.readouterr().err
    assert load_codec(tmp_path / "none.kdtr") is None
    (hf / "tokenizer.json").write_text(words_json())
    assert import_main([str(hf), str(tmp_path / "t.kdtr")]) == 0
    err = capsys.readouterr().err
    assert "tokenizer.json copied in" in err and "begin with id 1" in err
    blob = read_bundle_tokenizer(tmp_path / "t.kdtr")
    assert blob.json == (hf / "tokenizer.json").read_bytes() and blob.bos_id == 1
    assert load_codec(tmp_path / "t.kdtr").encode("b a") == [1, 2, 1]
    assert import_main([str(hf), str(tmp_path / "n.kdtr"), "--no-tokenizer"]) == 0
    assert "--no-tokenizer" in capsys.readouterr().err
    assert read_bundle_tokenizer(tmp_path / "n.kdtr") is None


# ----------------------------------------------------------------------------- the demo

def test_shipped_demo_target():
    size = demo.TARGET.stat().st_size
    assert size < 20 * 2 ** 20
    cfg, weights = read_bundle(demo.TARGET, verify=False)
    # the router's correction bias is a buffer in transformers, not one of its parameters
    params = sum(int(np.prod(w.shape)) for n, w in weights.items()
                 if not n.endswith("e_score_correction_bias"))
    assert params == 8_747_776 and cfg.tie_word_embeddings and cfg.vocab_size == 8192
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.max_position_embeddings) == (256, 6, 512)
    assert {str(w.dtype) for w in weights.values()} == {"bfloat16", "float32"}
    router = [n for n, w in weights.items() if str(w.dtype) == "float32"]
    assert router and all(n.endswith(("mlp/gate", "e_score_correction_bias")) for n in router)
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    assert "*.kdtr" in setup["options.package_data"]["kdtree_numba.demo"]
    assert "tokenizers" in setup["options"]["install_requires"]


def run_json(capsys, argv):
    assert run_main(argv + ["--json"] + REF) == 0
    return json.loads(capsys.readouterr().out)


def test_run_prompt_streams_the_text_of_its_tokens(codec, capsys):
    argv = ["--prompt", FIB, "--max-new-tokens", "16"] + REF
    assert run_main(argv) == 0
    out, err = capsys.readouterr()
    assert "shipped demo target" in err and "16 tokens in" in err
    j = run_json(capsys, argv)
    assert set(j) == {"text", "tokens", "stats"} and len(j["tokens"][0]) == 16
    assert out == codec.decode(j["tokens"][0]) + "\n" == j["text"][0] + "\n"
    for key in ("mean_tau", "tokens_per_s", "rounds", "method", "budget"):
        assert key in j["stats"], key
    assert run_main(argv) == 0
    assert capsys.readouterr().out == out                   # T = 0: the same text again


def test_run_default_prompt_and_ddtree_give_the_ar_text(capsys):
    ar = run_json(capsys, ["--max-new-tokens", "12"])
    assert ar["stats"]["method"] == "ar" and ar["stats"]["budget"] is None
    assert run_main(["--max-new-tokens", "12", "--method", "ddtree", "--budget", "8"]
                    + REF) == 0
    out, err = capsys.readouterr()
    assert out == ar["text"][0] + "\n"                      # the built-in text prompt
    # the default drafter is the trained DFlash bundle: no test-drafter notice, no warning
    # that its 15-deep block outruns the budget (a block drafter drafts it in one forward)
    assert "mean tau" in err and "peeks" not in err and "warning" not in err


def test_run_a_batch_of_text_prompts(codec, capsys):
    prompts = [FIB, "class Stack:", "import os\n"]
    argv = [a for p in prompts for a in ("--prompt", p)] + ["--max-new-tokens", "6"]
    j = run_json(capsys, argv)
    assert len(j["text"]) == len(j["tokens"]) == 3
    assert j["text"] == [codec.decode(t) for t in j["tokens"]]
    assert run_main(argv + REF) == 0
    out = capsys.readouterr().out
    want = "\n".join(f"==> {i + 1}/3 --prompt {p!r} <==\n{t}\n"
                     for i, (p, t) in enumerate(zip(prompts, j["text"])))
    assert out == want
    one = run_json(capsys, ["--prompt", "class Stack:", "--max-new-tokens", "6"])
    assert one["tokens"][0] == j["tokens"][1]               # batching changes nothing


def test_run_text_file_and_ids_prompts(codec, tmp_path, capsys):
    src = tmp_path / "p.py"
    src.write_text(FIB + "\n")
    by_file = run_json(capsys, ["--prompt-text-file", str(src), "--max-new-tokens", "6"])
    by_text = run_json(capsys, ["--prompt", FIB + "\n", "--max-new-tokens", "6"])
    assert by_file["tokens"] == by_text["tokens"]
    ids = ",".join(map(str, codec.encode(FIB + "\n")))
    assert run_main(["--prompt-ids", ids, "--max-new-tokens", "6"] + REF) == 0
    out = capsys.readouterr().out                           # id prompts: id lines
    assert out == ",".join(map(str, by_text["tokens"][0])) + "\n"
    j = run_json(capsys, ["--prompt-ids", ids, "--max-new-tokens", "6"])
    assert j["text"] == by_text["text"]                     # --json decodes anyway


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_streaming_to_a_terminal_shows_no_progress_line():
    """On a terminal (stdout and stderr one pty): the prompt, then the text as it streams,
    then the stats; no \\r progress line cutting into it, even with --progress."""
    import pty
    leader, follower = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("KDTREE_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-m", "kdtree_numba.cli", "--max-new-tokens", "8",
                             "--progress"] + REF, stdin=follower, stdout=follower,
                            stderr=follower, env=env, cwd=ROOT)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=120) == 0
    screen = b"".join(chunks).decode().replace("\r\n", "\n")
    assert "\r" not in screen
    lines = screen.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(FIB))
    assert lines[-1].startswith("kdtree-run: 8 tokens in") and start < len(lines) - 1
