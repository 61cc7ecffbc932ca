"""One-off: the first training call's tokenizer.json did not come back (9 files > 8).
Retrain it from the same corpus twice (determinism), check it against the shipped prompt token
counts and the export's held-out loss, and write it to $OUT."""
import json, os, sys, time
import numpy as np, torch
sys.path.insert(0, "tools")
from demo import bpe, corpus, trainer
from transformers import DeepseekV3ForCausalLM
out = os.environ["OUT"]
m = json.load(open(".train/metrics.json"))
hp = m["hp"]
t0 = time.time()
files, stats = corpus.build(hp, 8, print)
digest = corpus.manifest_digest(files)
import hashlib; print("manifest matches the first call:", digest == hashlib.sha256(open(".train/manifest.jsonl", "rb").read()).hexdigest())
a = bpe.train_on_files(files, hp["vocab"], hp["tokenizer_sample_mb"]).to_str()
b = bpe.train_on_files(files, hp["vocab"], hp["tokenizer_sample_mb"]).to_str()
print("tokenizer deterministic:", a == b, time.time() - t0)
tok = bpe.load_bpe(a)
bad = 0
rows = [json.loads(l) for l in open(".train/heldout_prompts.jsonl")]
for r in rows:
    n = 1 + len(tok.encode(r["text"], add_special_tokens=False).ids)
    bad += n != r["n_tokens"]
print(f"prompt token counts: {len(rows) - bad}/{len(rows)} match")
held = bpe.token_stream(bpe.encode_texts(tok, [f.text for f in files if f.split == "heldout"]))
print("held-out tokens", held.size, "metrics", m["heldout"])
model = DeepseekV3ForCausalLM.from_pretrained(".train/export", torch_dtype=torch.bfloat16).cuda()
ev = trainer.evaluate(model, torch.from_numpy(held.astype(np.int64)).cuda(), hp["seq"], 64,
                      torch.bfloat16)
print("export held-out:", ev)
open(os.path.join(out, "tokenizer.json"), "w").write(a)
json.dump({"deterministic": a == b, "prompt_mismatches": bad, "eval": ev,
           "heldout_tokens": int(held.size)}, open(os.path.join(out, "recover.json"), "w"))
