"""Check an exported demo target (tools/train_target.py's export/) on this repository's engine.

    python3 tools/check_export.py EXPORT_DIR [--bundle OUT.kdtr] [--prompts PROMPTS.jsonl]
                                  [--n 4] [--new-tokens 24]

1. ``kdtr-import-hf EXPORT_DIR BUNDLE``: the path a real checkpoint takes (skipped with
   ``--no-import`` when BUNDLE exists).
2. For ``--n`` prompts (``<|endoftext|>`` + a held-out prefix; without ``--prompts``, two fixed
   snippets): transformers (float32, eager attention, the export's bf16 weights widened) and
   the reference backend score the same ids; the largest logit difference must stay within
   1e-4 of the largest logit (tests/test_hf_parity.py's bound).
3. The engine's greedy continuation (reference backend, AR) must be transformers' argmax at
   every position of one teacher-forced forward over prompt + continuation (a position whose
   top-2 logits lie within the tolerance is a tie, counted apart); the decoded text is printed.

Exit status 1 on a mismatch.  The tokenizer is read with ``tokenizers.Tokenizer.from_file``
(JSON; nothing is unpickled).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings

import numpy as np

FIXED_PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(argv):\n"]
REL_TOL = 1e-4


def load_prompts(path: str | None, n: int) -> list[str]:
    if path is None:
        return FIXED_PROMPTS[:n]
    with open(path) as fh:
        return [json.loads(line)["text"] for line in fh][:n]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("export_dir")
    p.add_argument("--bundle", help="where the imported bundle goes (default: a temp file)")
    p.add_argument("--no-import", action="store_true", help="use an existing --bundle")
    p.add_argument("--prompts", help="heldout_prompts.jsonl (default: two fixed snippets)")
    p.add_argument("--n", type=int, default=4, help="prompts to check")
    p.add_argument("--new-tokens", type=int, default=24)
    args = p.parse_args(argv)

    import torch
    import transformers
    from tokenizers import Tokenizer

    from kdtree_numba.engine import generate
    from kdtree_numba.hf_import import main as import_main
    from kdtree_numba.model import Model

    bundle = args.bundle or os.path.join(tempfile.mkdtemp(), "target.kdtr")
    if not args.no_import:
        rc = import_main([args.export_dir, bundle, "--quiet", "--force"])  # --bundle: rewritten
        if rc:
            return rc
    ours = Model.load(bundle, backend="reference")
    transformers.utils.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
            args.export_dir, dtype=torch.float32, attn_implementation="eager").eval()
    tok = Tokenizer.from_file(os.path.join(args.export_dir, "tokenizer.json"))
    tok.encode_special_tokens = True
    eot = tok.token_to_id("<|endoftext|>")
    cfg = ours.config
    print(f"bundle {bundle}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab "
          f"{cfg.vocab_size}, tied {cfg.tie_word_embeddings}, bos/eos {cfg.bos_token_id}/"
          f"{cfg.eos_token_id}")

    ok, worst = True, (0.0, 0.0, 0.0)
    for text in load_prompts(args.prompts, args.n):
        ids = np.array([eot] + tok.encode(text, add_special_tokens=False).ids, np.int64)
        with torch.no_grad():
            want = hf(torch.tensor(ids[None])).logits[0].double().numpy()
        got = ours.score(ids)
        diff, top = float(np.abs(got - want).max()), float(np.abs(want).max())
        rel = diff / top
        worst = max(worst, (rel, diff, top))
        cont = generate(ours, [ids], args.new_tokens).tokens[0]
        full = np.concatenate([ids, np.asarray(cont, np.int64)])
        with torch.no_grad():
            ref = hf(torch.tensor(full[None])).logits[0].double().numpy()[ids.size - 1:-1]
        top2 = np.sort(ref, axis=1)[:, -2:]
        tie = (top2[:, 1] - top2[:, 0]) <= REL_TOL * np.abs(ref).max()
        agree = ref.argmax(1) == np.asarray(cont)
        good = rel <= REL_TOL and bool(np.all(agree | tie))
        ok &= good
        print(f"{'ok ' if good else 'BAD'} prompt {ids.size} tokens: logits max|diff| {diff:.2e}"
              f" / max|logit| {top:.2f} = {rel:.2e}; greedy {int(agree.sum())}/{agree.size} = "
              f"transformers' argmax ({int((tie & ~agree).sum())} ties)")
        print("    " + repr(text[-60:]) + " -> " + repr(tok.decode(list(cont))))
    print(f"worst: max|diff| {worst[1]:.2e} / max|logit| {worst[2]:.2f} = {worst[0]:.2e}")
    print("all match" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
