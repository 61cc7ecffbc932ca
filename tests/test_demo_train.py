"""tools/demo (the demo target's training pipeline): corpus split and prompts, tokenizer,
data position, schedule, checkpoint round trip, and the export through kdtr-import-hf.

CPU only, a few seconds; skipped without torch, transformers and tokenizers (the ``train``
side of the project, not the engine's).
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))

from demo import bpe, checkpoint, corpus, target, trainer  # noqa: E402


def _file(rel: str, text: str = "x = 1\n") -> corpus.SourceFile:
    return corpus.SourceFile(path="/r/" + rel, root="site", rel=rel, size=len(text),
                             sha256=corpus.sha256_hex(rel + text), text=text)


def test_split_holds_out_whole_directories_deterministically():
    files = [_file(f"pkg{g}/sub/m{i}.py") for g in range(60) for i in range(g % 7 + 1)]
    corpus.assign_split(files, frac=0.01, min_files=20, max_group_files=5)
    held = [f for f in files if f.split == "heldout"]
    assert len(held) >= 20
    for g in {f.group for f in files}:
        assert len({f.split for f in files if f.group == g}) == 1
    assert all(len([f for f in files if f.group == h.group]) <= 5 for h in held)
    again = [_file(f.rel) for f in files]
    corpus.assign_split(again, frac=0.01, min_files=20, max_group_files=5)
    assert [f.split for f in again] == [f.split for f in files]


def test_file_prefix_ends_at_a_signature_line():
    lines = [f"# line {i}\n" for i in range(9)] + ["def f(a, b):\n"] + ["    pass\n"] * 30
    text, kind = corpus.file_prefix("".join(lines))
    assert kind == "def" and text.endswith("def f(a, b):\n") and text.count("\n") == 10
    text, kind = corpus.file_prefix("".join(f"x{i} = {i}\n" for i in range(40)))
    assert kind == "lines" and text.count("\n") == 20
    assert corpus.file_prefix("a = 1\n" * 10) is None              # nothing left to continue


def test_bpe_specials_and_round_trip():
    texts = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n"] * 20
    tok = bpe.load_bpe(bpe.train_bpe(iter(texts), 300).to_str())
    assert tok.token_to_id(bpe.EOT) == 0 and tok.token_to_id(bpe.MASK) == 1
    src = 'x = "<|endoftext|>"  # é\r\n'
    ids = tok.encode(src, add_special_tokens=False).ids
    assert 0 not in ids and tok.decode(ids) == src     # text never yields a control token
    stream = bpe.token_stream(bpe.encode_texts(tok, texts[:2]))
    assert stream.dtype == np.uint16 and stream[0] == 0 and (stream == 0).sum() == 2


def test_sampler_resumes_at_its_position():
    a = trainer.WindowSampler(10_000, 64, seed=3)
    draws = [a.next_starts(16) for _ in range(12)]     # 155 windows: crosses into epoch 1
    assert a.epoch == 1
    b = trainer.WindowSampler(10_000, 64, seed=3)
    for _ in range(5):
        b.next_starts(16)
    c = trainer.WindowSampler(10_000, 64, seed=3, epoch=b.epoch, cursor=b.cursor)
    for want in draws[5:]:
        np.testing.assert_array_equal(c.next_starts_on(16, "cpu").numpy(), want)
    assert all(s.max() + 65 <= 10_000 for s in draws)


def test_lr_warms_up_then_ends_at_the_floor():
    assert trainer.lr_at(0, 0.0, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert trainer.lr_at(9, 0.0, 1.0, 10, 0.1) == pytest.approx(1.0)
    assert trainer.lr_at(500, 0.5, 1.0, 10, 0.1) == pytest.approx(0.55)
    assert trainer.lr_at(900, 1.0, 1.0, 10, 0.1) == pytest.approx(0.1)


def _tiny(seed=0):
    torch.manual_seed(seed)
    cfg = target.hf_config(target.TINY, 128, 32)
    model = target.build_model(cfg, "cpu", attn="eager")
    return cfg, model, trainer.make_optimizer(model, 1e-2, 0.1, 0.95)


def test_checkpoint_round_trip(tmp_path):
    cfg, model, opt = _tiny()
    bal = target.RouterBalancer(model, 1e-2)
    stream = torch.randint(0, 128, (4000,), dtype=torch.int32)
    batch = trainer.gather(stream, np.arange(4) * 32, 32)
    for _ in range(3):
        trainer.train_step(model, opt, batch, 1e-2, 1.0, None)
        bal.update()
    assert float(bal.routers[0].e_score_correction_bias.abs().max()) > 0
    checkpoint.save_checkpoint(str(tmp_path), model, opt, {"hp": {}, "train": {}})
    state, tensors = checkpoint.read_checkpoint(str(tmp_path))
    _, again, opt2 = _tiny(seed=1)
    checkpoint.restore(again, opt2, state, tensors)
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        want = p.detach() if p.numel() < checkpoint.SMALL else p.detach().bfloat16().float()
        torch.testing.assert_close(q.detach(), want, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(again.model.layers[1].mlp.gate.e_score_correction_bias,
                               model.model.layers[1].mlp.gate.e_score_correction_bias)
    assert all(int(opt2.state[p]["step"]) == 3 for p in again.parameters())
    l1, _ = trainer.train_step(model, opt, batch, 1e-2, 1.0, None)
    l2, _ = trainer.train_step(again, opt2, batch, 1e-2, 1.0, None)
    assert abs(float(l1) - float(l2)) < 1e-2 * float(l1)


def test_export_imports_and_matches_transformers(tmp_path):
    from kdtree_numba.hf_import import import_hf
    from kdtree_numba.model import Model
    cfg, model, opt = _tiny()
    with torch.no_grad():                      # routing that depends on the bias
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.tensor(
            [0.3, -0.2, 0.1, 0.0]))
    names = checkpoint.export_pretrained(model, cfg, str(tmp_path / "export"), '{"x": 1}')
    assert names == ["config.json", "model.safetensors", "tokenizer.json"]
    # tokenizer=False: the export's tokenizer.json here is a placeholder, not a tokenizer
    got_cfg = import_hf(tmp_path / "export", tmp_path / "t.kdtr", quiet=True, tokenizer=False)
    assert got_cfg.tie_word_embeddings and got_cfg.eos_token_id == 0
    ours = Model.load(tmp_path / "t.kdtr", backend="reference")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "export", dtype=torch.float32, attn_implementation="eager").eval()
    ids = np.array([0, 5, 17, 99, 3, 64, 127, 2, 8])
    with torch.no_grad():
        want = hf(torch.tensor(ids[None])).logits[0].double().numpy()
    assert np.abs(ours.score(ids) - want).max() <= 1e-4 * np.abs(want).max()
