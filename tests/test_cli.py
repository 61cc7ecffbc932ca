"""The console scripts kdtree-run, kdtr-make-model and kdtr-import-hf on bad input (issue 16).

Every bad input is one line on stderr naming the option, file or value at fault, exit 2, no
traceback (formats.console.run_console); ``--debug`` shows the traceback; a flipped bit in a
bundle is caught at load naming the tensor; ``--no-verify`` loads it and says so.  The entry
points run in-process (their ``main(argv)`` returns the exit code); one case also runs as a
real process to see what a shell sees.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from formats import kdtr
from formats.console import UsageError
from kdtree_numba import compat
from kdtree_numba.bundle import (BundleTokenizer, make_random_bundle, random_weights,
                                 read_bundle, size_config, write_bundle)
from kdtree_numba.cli import make_model_main, run_main
from kdtree_numba.engine import generate
from kdtree_numba.hf_import import export_hf_checkpoint
from kdtree_numba.hf_import import main as import_main
from kdtree_numba.model import Model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_debug_env(monkeypatch):
    """KDTREE_DEBUG=1 in the caller's environment would turn every one-line error into a
    traceback."""
    monkeypatch.delenv("KDTREE_DEBUG", raising=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Bundles and files the cases refer to by name."""
    d = tmp_path_factory.mktemp("cli")
    make_random_bundle(d / "tiny.kdtr", "tiny")
    make_random_bundle(d / "small.kdtr", "small")
    make_random_bundle(d / "tiny_drafter.kdtr", "tiny", role="drafter")
    # a block drafter for a target of hidden size 32: the tiny target's is 64
    make_random_bundle(d / "narrow_block.kdtr", "tiny", role="block_drafter", hidden_size=32)
    (d / "prompts.txt").write_text("1 2\n3,9999\n")
    (d / "blank.txt").write_text("\n  \n")
    (d / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    (d / "notes.txt").write_text("not a bundle\n")
    (d / "folder").mkdir()
    hf = {"nocfg": None, "badjson": "{bad", "llama": '{"model_type": "llama"}',
          "nofield": '{"model_type": "deepseek_v3"}', "list": "[1]"}
    for name, text in hf.items():
        (d / f"hf_{name}").mkdir()
        if text is not None:
            (d / f"hf_{name}" / "config.json").write_text(text)
    cfg = size_config("tiny", num_hidden_layers=1, first_k_dense_replace=1)
    for name, tok in (("noshards", None), ("badtok", "{bad"), ("widetok", word_tokenizer(500))):
        (d / f"hf_{name}").mkdir()
        (d / f"hf_{name}" / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
        if tok is not None:
            (d / f"hf_{name}" / "tokenizer.json").write_text(tok)
    tiny = size_config("tiny")
    for name, top in (("wide_tokenizer", 500), ("words", 5)):
        write_bundle(d / f"{name}.kdtr", tiny, random_weights(tiny, 0),
                     tokenizer=BundleTokenizer(word_tokenizer(top).encode()))
    return d


def word_tokenizer(top_id: int) -> str:
    """A tokenizer.json of a few whole words, the last one with id ``top_id``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "c": top_id}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


RUN, MAKE, IMPORT = run_main, make_model_main, import_main
DD = ["--method", "ddtree"]

# (id, entry point, argv ({d} is the files folder), words the one error line must hold)
CASES = [
    ("prompt-id-outside-vocab", RUN, ["--prompt-ids", "1,9000"],
     ["--prompt-ids", "token id 9000", "0 to 8191"]),
    ("prompt-id-outside-tiny-vocab", RUN, ["--model", "{d}/tiny.kdtr", "--prompt-ids", "1,500"],
     ["--prompt-ids", "token id 500", "0 to 127"]),
    ("prompt-file-id-outside-vocab", RUN, ["--prompt-file", "{d}/prompts.txt"],
     ["prompts.txt:2", "9999"]),
    ("prompt-id-not-a-number", RUN, ["--prompt-ids", "1,x"], ["--prompt-ids", "'x'"]),
    ("prompt-ids-empty", RUN, ["--prompt-ids", ""], ["--prompt-ids", "no token ids"]),
    ("budget-0", RUN, DD + ["--budget", "0"], ["--budget 0", ">= 1"]),
    ("budget-not-a-number", RUN, DD + ["--budget", "wide"], ["--budget 'wide'", "or auto"]),
    ("max-new-tokens-negative", RUN, ["--max-new-tokens", "-5"],
     ["--max-new-tokens -5", ">= 0"]),
    ("temperature-negative", RUN, ["--temperature", "-1"], ["--temperature -1", ">= 0"]),
    ("temperature-nan", RUN, ["--temperature", "nan"], ["--temperature nan"]),
    ("top-p-0", RUN, ["--top-p", "0"], ["--top-p 0", "(0, 1]"]),
    ("top-p-above-1", RUN, ["--top-p", "1.5"], ["--top-p 1.5", "(0, 1]"]),
    ("top-k-negative", RUN, ["--top-k", "-3"], ["--top-k -3", ">= 0"]),
    ("block-len-0", RUN, DD + ["--block-len", "0"], ["--block-len 0"]),
    ("seed-negative", RUN, ["--seed", "-1"], ["--seed -1"]),
    ("drafter-other-vocab", RUN, ["--model", "{d}/small.kdtr", "--drafter",
                                  "{d}/tiny_drafter.kdtr"] + DD,
     ["--drafter", "tiny_drafter.kdtr", "vocabulary 128", "1024", "--size"]),
    ("block-drafter-other-hidden", RUN, ["--model", "{d}/tiny.kdtr", "--drafter",
                                         "{d}/narrow_block.kdtr"] + DD,
     ["--drafter", "narrow_block.kdtr", "hidden size 32", "64"]),
    ("drafter-missing", RUN, DD + ["--drafter", "{d}/nope.kdtr"],
     ["--drafter", "nope.kdtr", "no such file"]),
    ("drafter-folder", RUN, DD + ["--drafter", "{d}/folder"], ["--drafter", "folder"]),
    ("drafter-not-a-bundle", RUN, DD + ["--drafter", "{d}/notes.txt"],
     ["--drafter", "notes.txt", "K001"]),
    ("ddtree-model-without-drafter", RUN, ["--model", "{d}/tiny.kdtr"] + DD, ["--drafter"]),
    ("oracle-abc", RUN, DD + ["--drafter", "oracle:abc"],
     ["--drafter oracle:abc", "oracle[:AGREEMENT]", "[0, 1]"]),
    ("oracle-above-1", RUN, DD + ["--drafter", "oracle:2"], ["--drafter oracle:2"]),
    ("model-missing", RUN, ["--model", "{d}/nope.kdtr"], ["--model", "nope.kdtr"]),
    ("model-folder", RUN, ["--model", "{d}/folder"], ["--model", "folder"]),
    ("model-not-a-bundle", RUN, ["--model", "{d}/notes.txt"], ["--model", "notes.txt"]),
    ("prompt-file-missing", RUN, ["--prompt-file", "{d}/nope.txt"],
     ["--prompt-file", "nope.txt"]),
    ("prompt-file-folder", RUN, ["--prompt-file", "{d}/folder"], ["--prompt-file", "folder"]),
    ("prompt-file-binary", RUN, ["--prompt-file", "{d}/binary.txt"],
     ["--prompt-file", "binary.txt", "0x89"]),
    ("prompt-file-blank", RUN, ["--prompt-file", "{d}/blank.txt"],
     ["--prompt-file", "blank.txt", "no prompts"]),
    ("eos-outside-vocab", RUN, ["--eos", "99999"], ["--eos 99999", "0 to 8191"]),
    ("context-exceeded", RUN, ["--max-new-tokens", "100000"],
     ["--max-new-tokens 100000", "the built-in prompt has 10 tokens", "context of 512", "502"]),
    ("context-exceeded-ids", RUN, ["--model", "{d}/tiny.kdtr", "--max-new-tokens", "100000"],
     ["--max-new-tokens 100000", "the built-in prompt has 4 tokens", "508"]),
    ("context-exceeded-text", RUN, ["--prompt", "x = 1\n" * 200, "--max-new-tokens", "64"],
     ["--max-new-tokens 64", "--prompt 'x = 1\\nx = 1", "...' has", "context of 512",
      "shorten the prompt"]),
    ("text-prompt-without-tokenizer", RUN, ["--model", "{d}/tiny.kdtr", "--prompt", "def f():"],
     ["--prompt 'def f():'", "--model", "tiny.kdtr has no tokenizer", "use --prompt-ids"]),
    ("text-file-without-tokenizer", RUN, ["--model", "{d}/tiny.kdtr", "--prompt-text-file",
                                          "{d}/notes.txt"],
     ["--prompt-text-file", "notes.txt", "has no tokenizer"]),
    ("prompt-text-file-missing", RUN, ["--prompt-text-file", "{d}/nope.py"],
     ["--prompt-text-file", "nope.py"]),
    ("prompt-text-file-binary", RUN, ["--prompt-text-file", "{d}/binary.txt"],
     ["--prompt-text-file", "binary.txt", "0x89"]),
    ("tokenizer-beyond-vocab", RUN, ["--model", "{d}/wide_tokenizer.kdtr", "--prompt", "a"],
     ["--model", "wide_tokenizer.kdtr", "tokenizer", "ids up to 500", "vocabulary of 128"]),
    ("empty-text-without-bos", RUN, ["--model", "{d}/words.kdtr", "--prompt", ""],
     ["--prompt ''", "no tokens"]),
    ("plot-with-ar", RUN, ["--plot", "{d}/run.png"], ["--plot", "run.png", "--method ar has no "
                                                     "rounds"]),
    ("plot-not-png", RUN, DD + ["--plot", "{d}/run.jpg"], ["--plot", "run.jpg", ".png"]),
    ("plot-missing-folder", RUN, DD + ["--plot", "{d}/nodir/run.png"],
     ["--plot", "nodir", "no such folder"]),
    ("plot-folder", RUN, DD + ["--plot", "{d}/folder"], ["--plot", "folder", "a folder"]),
    ("make-model-missing-folder", MAKE, ["{d}/nodir/x.kdtr"], ["nodir", "no such folder"]),
    ("make-model-h5-name", MAKE, ["{d}/x.h5"], ["x.h5", ".kdtr"]),
    ("make-model-folder", MAKE, ["{d}/folder"], ["folder"]),
    ("import-missing-folder", IMPORT, ["{d}/nohf", "{d}/o.kdtr"], ["nohf", "no such folder"]),
    ("import-not-a-folder", IMPORT, ["{d}/notes.txt", "{d}/o.kdtr"], ["notes.txt"]),
    ("import-no-config", IMPORT, ["{d}/hf_nocfg", "{d}/o.kdtr"],
     ["hf_nocfg/config.json", "missing"]),
    ("import-bad-json", IMPORT, ["{d}/hf_badjson", "{d}/o.kdtr"],
     ["hf_badjson/config.json", "JSON"]),
    ("import-unsupported-model-type", IMPORT, ["{d}/hf_llama", "{d}/o.kdtr"],
     ["hf_llama/config.json", "'llama'", "deepseek_v3"]),
    ("import-config-missing-field", IMPORT, ["{d}/hf_nofield", "{d}/o.kdtr"],
     ["hf_nofield/config.json", "num_attention_heads"]),
    ("import-config-not-an-object", IMPORT, ["{d}/hf_list", "{d}/o.kdtr"],
     ["hf_list/config.json"]),
    ("import-no-shards", IMPORT, ["{d}/hf_noshards", "{d}/o.kdtr"],
     ["hf_noshards", "safetensors"]),
    ("import-h5-name", IMPORT, ["{d}/hf_noshards", "{d}/o.h5"], ["o.h5", ".kdtr"]),
    ("import-bad-tokenizer", IMPORT, ["{d}/hf_badtok", "{d}/o.kdtr"],
     ["hf_badtok/tokenizer.json", "not an HF tokenizers JSON"]),
    ("import-tokenizer-beyond-vocab", IMPORT, ["{d}/hf_widetok", "{d}/o.kdtr"],
     ["hf_widetok/tokenizer.json", "ids up to 500", "vocabulary of 128"]),
]


def one_error_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


@pytest.mark.parametrize("main, argv, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(main, argv, words, files, capsys):
    prog = {RUN: "kdtree-run", MAKE: "kdtr-make-model", IMPORT: "kdtr-import-hf"}[main]
    assert main([a.format(d=files) for a in argv]) == 2
    line = one_error_line(capsys, prog)
    for w in words:
        assert w in line, line


def test_numba_backend_without_a_gpu_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(compat, "kernels_runnable", lambda: False)
    assert run_main(["--backend", "numba"]) == 2
    line = one_error_line(capsys, "kdtree-run")
    assert "--backend numba" in line and "--backend reference" in line


def test_tensor_cores_on_the_reference_backend_is_one_line(capsys):
    assert run_main(["--backend", "reference", "--gemm", "tensor-cores"]) == 2
    line = one_error_line(capsys, "kdtree-run")
    assert "--gemm tensor-cores" in line and "--backend numba" in line


@pytest.mark.skipif(not compat.kernels_runnable(), reason="the numba backend needs a GPU or "
                    "the CUDA simulator")
def test_budget_above_the_gpu_builder_is_refused_on_numba(capsys):
    assert run_main(DD + ["--backend", "numba", "--budget", "2000"]) == 2
    assert "1024" in one_error_line(capsys, "kdtree-run")


@pytest.mark.skipif(compat.gpu_available(), reason="the CPU default")
def test_without_a_gpu_kdtree_run_takes_the_float32_cpu_path_and_says_so(capsys):
    assert run_main(DD + ["--max-new-tokens", "3", "--json"]) == 0
    out = capsys.readouterr()
    assert "the float32 CPU path" in out.err and "--precision float64" in out.err
    assert json.loads(out.out)["stats"]["budget"] == 7          # cpu.DEFAULT_BUDGET
    assert run_main(["--max-new-tokens", "2", "--precision", "float64"]) == 0
    assert "float64, the exact NumPy reference" in capsys.readouterr().err


def test_top_p_at_temperature_0_is_a_warning(capsys):
    assert run_main(["--top-p", "0.5", "--max-new-tokens", "2"]) == 0
    warning = [l for l in capsys.readouterr().err.splitlines() if "warning" in l]
    assert len(warning) == 1 and "--temperature 0" in warning[0]


def test_precision_is_the_reference_backends_option(capsys):
    assert run_main(["--backend", "numba", "--precision", "float32"]) == 2
    assert "--precision float32" in one_error_line(capsys, "kdtree-run")


def test_budget_above_the_limit_warns_with_the_cost_on_reference(capsys):
    assert run_main(DD + ["--backend", "reference", "--budget", "1500", "--max-new-tokens",
                          "1"]) == 0
    warning = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert len(warning) == 1 and "--budget 1500" in warning[0] and " s per round" in warning[0]


def test_budget_auto_runs_and_reports_its_choices(capsys):
    import json
    assert run_main(DD + ["--budget", "auto", "--max-new-tokens", "12", "--json"]) == 0
    out = capsys.readouterr()
    stats = json.loads(out.out)["stats"]
    assert stats["budget"] == "auto" and len(stats["budgets"]) == stats["rounds"]
    assert "--budget auto: best" in out.err


def test_budget_auto_line_names_a_budget_without_a_steady_round(capsys, monkeypatch):
    """KDTREE_AUTO_V2 keeps no cost of a budget whose rounds all ran eagerly or captured
    (round_ms None): the line says so instead of failing to format it."""
    from kdtree_numba.budget import AutoBudget
    real = AutoBudget.summary

    def summary(self):
        out = real(self)
        for row in out["per_budget"].values():
            row["round_ms"] = row["tokens_per_s"] = None
        return out
    monkeypatch.setattr(AutoBudget, "summary", summary)
    assert run_main(DD + ["--budget", "auto", "--max-new-tokens", "6"]) == 0
    line = [ln for ln in capsys.readouterr().err.splitlines() if "--budget auto: best" in ln]
    assert len(line) == 1 and "(no steady round)" in line[0]


def test_drafter_with_method_ar_is_a_warning(files, capsys):
    assert run_main(["--drafter", str(files / "tiny_drafter.kdtr"), "--max-new-tokens",
                     "2"]) == 0
    err = capsys.readouterr().err
    assert "warning: --drafter" in err and "ignored with --method ar" in err


def test_debug_shows_the_traceback(files):
    with pytest.raises(UsageError, match="token id 9000"):
        run_main(["--prompt-ids", "1,9000", "--debug"])


def test_console_script_as_a_process():
    """What a shell sees: exit 2 and one line; --debug: the traceback (exit 1)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("KDTREE_DEBUG", None)
    cmd = [sys.executable, "-m", "kdtree_numba.cli", "--prompt-ids", "1,9000"]
    plain = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    assert plain.returncode == 2 and plain.stdout == ""
    assert plain.stderr.splitlines() == ["kdtree-run: error: --prompt-ids: token id 9000 is "
                                         "outside the model's vocabulary (ids 0 to 8191)"]
    debug = subprocess.run(cmd + ["--debug"], capture_output=True, text=True, env=env,
                           cwd=ROOT)
    assert debug.returncode == 1 and "Traceback" in debug.stderr


# ----------------------------------------------------------------------------- integrity

def flip_bit(src: Path, dst: Path, tensor: str) -> None:
    dst.write_bytes(src.read_bytes())
    with kdtr.File(str(src)) as f:
        offset = f[tensor].offset
    with open(dst, "r+b") as fh:
        fh.seek(offset + 5)
        byte = fh.read(1)[0]
        fh.seek(offset + 5)
        fh.write(bytes([byte ^ 0x10]))


def test_bit_flip_is_caught_at_load_naming_the_tensor(files, tmp_path, capsys):
    bad = tmp_path / "bad.kdtr"
    tensor = "model/layers/1/self_attn/kv_b_proj"
    flip_bit(files / "tiny.kdtr", bad, tensor)
    with pytest.raises(kdtr.KdtrError, match=f"K056.*{tensor}.*bad.kdtr"):
        Model.load(bad, "reference")
    assert run_main(["--model", str(bad), "--max-new-tokens", "2"]) == 2
    line = one_error_line(capsys, "kdtree-run")
    assert f"--model {bad}" in line and tensor in line and "K056" in line
    assert run_main(["--model", str(files / "tiny.kdtr"), "--drafter", str(bad)] + DD +
                    ["--max-new-tokens", "2"]) == 2
    line = one_error_line(capsys, "kdtree-run")
    assert f"--drafter {bad}" in line and tensor in line


def test_no_verify_loads_a_damaged_bundle_and_says_so(files, tmp_path, capsys):
    bad = tmp_path / "bad.kdtr"
    flip_bit(files / "tiny.kdtr", bad, "model/norm")
    _, weights = read_bundle(bad, verify=False)      # mapped views, nothing checked
    assert not weights["model/norm"].flags.writeable
    assert run_main(["--model", str(bad), "--max-new-tokens", "2", "--no-verify"]) == 0
    notices = [ln for ln in capsys.readouterr().err.splitlines() if "--no-verify" in ln]
    assert len(notices) == 1 and str(bad) in notices[0]


def test_verified_load_equals_mapped_load(files):
    _, verified = read_bundle(files / "tiny.kdtr")
    _, mapped = read_bundle(files / "tiny.kdtr", verify=False)
    assert verified.keys() == mapped.keys()
    for name in verified:
        np.testing.assert_array_equal(verified[name], mapped[name])


# ----------------------------------------------------------------------------- progress, help

def test_generate_reports_progress_as_rounds_commit():
    cfg = size_config("tiny")
    model = Model(cfg, dict(random_weights(cfg, 0)), "reference")
    calls = []
    result = generate(model, [[1, 2], [3]], 5, progress=lambda d, t: calls.append((d, t)))
    assert calls[0] == (2, 10) and calls[-1] == (10, 10)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert len(calls) == result.stats.rounds + 1


def test_progress_lines_only_when_asked_off_a_terminal(files, capsys):
    args = ["--model", str(files / "tiny.kdtr"), "--max-new-tokens", "3"]
    assert run_main(args) == 0
    assert "generate" not in capsys.readouterr().err           # piped: silent
    assert run_main(args + ["--progress"]) == 0
    err = capsys.readouterr().err
    assert "generate" in err and "load" in err
    assert run_main(args + ["--json"]) == 0
    assert "generate" not in capsys.readouterr().err


def test_make_model_progress_and_summary(tmp_path, capsys):
    assert make_model_main([str(tmp_path / "m.kdtr"), "--progress"]) == 0
    err = capsys.readouterr().err
    assert "write" in err and "wrote" in err


def test_help_shows_every_default_and_the_built_in_prompt(capsys):
    assert run_main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: 32)", "(default: ar)", "(default: 8;", "(default: auto)",
                  "(default: 0.0)", "(default: 0)", "1,2,3,4", "--no-verify", "--debug",
                  "(default: the shipped DFlash drafter", "(default: 'def fibonacci(n):')",
                  "the shipped demo target", "--prompt-text-file"):
        assert shown in text, shown
    assert make_model_main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: tiny)" in text and "(default: float32)" in text
    assert import_main(["--help"]) == 0
    assert "(default: auto)" in " ".join(capsys.readouterr().out.split())


def test_import_progress_bar(files, tmp_path, capsys):
    cfg = size_config("tiny", num_hidden_layers=1, first_k_dense_replace=1)
    export_hf_checkpoint(cfg, dict(random_weights(cfg, 0)), tmp_path / "hf")
    assert import_main([str(tmp_path / "hf"), str(tmp_path / "m.kdtr"), "--progress"]) == 0
    err = capsys.readouterr().err
    assert "import" in err and "wrote" in err
    assert import_main([str(tmp_path / "hf"), str(tmp_path / "n.kdtr")]) == 0
    assert capsys.readouterr().err.count("\n") == 1           # piped: only the summary


def test_gemm_auto_takes_tensor_cores_for_packed_experts_and_kimi_widths(tmp_path):
    """--gemm auto (the default): bf16 tensor cores for a target that stores int4-group
    experts (read from the bundle's layout) or is 4096 wide or more, CUDA cores for the
    demo's width and on the reference backend, which has only them."""
    import dataclasses

    from formats.int4_group import Int4GroupWeight
    from kdtree_numba.bundle import QUANTIZABLE, size_config, stores_packed_weights, write_bundle
    from kdtree_numba.cli_checks import ModelPlan, gemm_choice
    from kdtree_numba.demo import TARGET
    cfg = size_config("tiny")
    packed = tmp_path / "q.kdtr"
    write_bundle(packed, cfg, {k: Int4GroupWeight.quantize(v, 32) if k.endswith(QUANTIZABLE)
                               else v for k, v in random_weights(cfg, 0)}, dtype="bfloat16")
    assert stores_packed_weights(packed) and not stores_packed_weights(TARGET)
    plain = ModelPlan(str(TARGET), "the default model", cfg, None, False)
    assert gemm_choice("numba", plain)[0] == "cuda-cores"
    assert gemm_choice("numba", dataclasses.replace(plain, packed_experts=True)) == \
        ("tensor-cores", "int4-group experts")
    wide = dataclasses.replace(plain, config=dataclasses.replace(cfg, hidden_size=7168))
    assert gemm_choice("numba", wide) == ("tensor-cores", "hidden size 7168")
    assert gemm_choice("reference", wide)[0] == "cuda-cores"


@pytest.mark.gpu
def test_gpu_kdtree_run_names_gemm_autos_choice(tmp_path, capsys):
    """On the GPU kdtree-run's first line names the GEMM setting --gemm auto chose: tensor
    cores for a bundle with int4-group experts (group 32: the W4A16 tensor-core kernel's),
    CUDA cores for the demo target; either gives AR's tokens for DDTree."""
    from formats.int4_group import Int4GroupWeight
    from kdtree_numba.bundle import QUANTIZABLE, size_config, write_bundle
    cfg = size_config("tiny", hidden_size=64, moe_intermediate_size=32)
    packed = tmp_path / "q.kdtr"
    write_bundle(packed, cfg, {k: Int4GroupWeight.quantize(v, 32) if k.endswith(QUANTIZABLE)
                               else v for k, v in random_weights(cfg, 0)}, dtype="bfloat16")
    ids = ["--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "8", "--json"]
    tokens = {}
    for method in ("ar", "ddtree"):
        extra = ["--drafter", "oracle:0.7"] if method == "ddtree" else []
        assert run_main(["--model", str(packed), "--method", method, *extra, *ids]) == 0
        out = capsys.readouterr()
        assert "gemm tensor-cores, --gemm auto: int4-group experts" in out.err
        tokens[method] = json.loads(out.out)["tokens"]
    assert tokens["ddtree"] == tokens["ar"]
    assert run_main(["--max-new-tokens", "2"]) == 0
    assert "gemm cuda-cores, --gemm auto: hidden size" in capsys.readouterr().err
