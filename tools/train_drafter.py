"""Train the DFlash block drafter of the demo target (issue 14) by distillation, in one call.

    python3 tools/train_drafter.py --target .train/export --out $OUT --minutes 5   # the H200
    python3 tools/train_drafter.py --tiny --target EXPORT_DIR --out /tmp/dft          # CPU smoke
    python3 tools/train_drafter.py --sampled --target EXPORT_DIR --out $OUT --minutes 8  # T > 0

The target is the trained HF export (``config.json``, safetensors, ``tokenizer.json``),
frozen.  A call rebuilds the corpus exactly as the target's trainer did (``tools/demo/
corpus.py``, the settings of the target's ``metrics.json``: deterministic, so the held-out
files are the target's), loads the target's tokenizer (never retrained), tokenises only
``--train-mb`` MB of train files and ``--heldout-mb`` MB of held-out files, then trains until
``--minutes`` (wall clock from the process start) minus ``--reserve`` seconds:

  each step: ``--batch`` windows of ``--seq`` tokens; the target (bf16 autocast) gives the
  features of layers ``--target-layers`` and its greedy choice g(t) at every position;
  ``--anchors`` random blocks per window, all in one drafter forward with a block-sparse
  mask; cross-entropy to g weighted exp(-(k-1)/gamma) over the block's slots 1..B-1; AdamW,
  warm-up then cosine over the call's training time, grad-clip 1.0, bf16 autocast.

Then it measures the drafter on held-out windows (tools/demo/distill.py ``evaluate``:
per-slot top-1 and top-4 agreement with the target, and the chain's acceptance length tau
against the target's own greedy continuations) and writes into ``--out``:

    drafter.safetensors    the drafter's tensors under the bundle's names, bf16
    drafter_config.json    ModelConfig fields + the dflash attributes (tools/export_drafter.py
                           turns these two files into the KDTR bundle)
    drafter.kdtr           the bundle, when kdtree_numba.bundle has write_dflash_bundle
    metrics.json           settings, sizes, stage times, progress history, held-out results
    ckpt/                  weights + AdamW moments (bf16 safetensors) and state.json: --resume

``--sampled`` (issue 37) fine-tunes a drafter (``--init``: the shipped bundle by default, or
``--resume`` a previous call's ``ckpt/``) on the target's greedy *and sampled* continuations
(``--gen-mix``: T = 0, 0.7 and 1), the sampled rows with soft targets (``--soft``: KL to the
target's distribution at the row's temperature), and measures the drafter before and after on
held-out windows the target generated at each of ``--eval-temps`` (``distill.evaluate_sampled``:
the chain's expected tokens per round at that temperature).  Every call also writes ``ckpt/``
(weights and AdamW moments, safetensors + JSON) for ``--resume``.

The recipe and the numbers: docs/DEMO.md.  The spec of the drafter: docs/DEMO.md, "The DFlash
drafter".  SIGTERM/SIGINT end training early; evaluation and export still run.
"""
from __future__ import annotations

import time

T_START = time.monotonic()       # --minutes counts from here, before the heavy imports

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

TOOLS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TOOLS)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the target's HF export folder")
    p.add_argument("--out", required=True, help="output folder (on the GPU machine: $OUT)")
    p.add_argument("--metrics", help="the target's metrics.json (its corpus settings; default: "
                                     "TARGET/../metrics.json if present, else train_target's "
                                     "full preset)")
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke test: 300 files, windows of 128, batch 4, 8 anchors")
    p.add_argument("--sampled", action="store_true",
                   help="fine-tune on greedy + sampled text with soft targets (issue 37): the "
                        "defaults of --gen-mix, --soft, --eval-temps, --lr, --init change")
    p.add_argument("--minutes", type=float, help="wall-clock budget from the process start "
                                                 "(default 5; tiny 1.5)")
    p.add_argument("--reserve", type=float, help="seconds kept for evaluation and export "
                                                 "(default 25; tiny 20)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--print-every", type=float, default=15.0, help="seconds between log lines")
    g = p.add_argument_group("data")
    g.add_argument("--seq", type=int, help="window length T (default 512; tiny 128)")
    g.add_argument("--train-mb", type=float, help="MB of train text to tokenise (default 64)")
    g.add_argument("--heldout-mb", type=float, help="MB of held-out text (default 2)")
    g = p.add_argument_group("drafter")
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--block-size", type=int, default=16,
                   help="B: the root and B-1 drafted slots (DFlash's 16: a tree at budget 32+ "
                        "reaches past depth 7 on repetitive code)")
    g.add_argument("--target-layers", default="1,3,5", help="0-based target layer ids")
    g.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a drafter ModelConfig size (heads, kv_lora_rank, ...)")
    g = p.add_argument_group("self-generated data (the target's own greedy text)")
    g.add_argument("--gen-seconds", type=float,
                   help="seconds spent generating greedy windows before training (default "
                        "150; tiny 8; 0 trains on corpus windows only)")
    g.add_argument("--gen-rows", type=int, help="windows per generation chunk (default 1024; "
                                                "tiny 4)")
    g.add_argument("--prefix", help="corpus prefix lengths LO,HI of a greedy window (default "
                                    "16,192; tiny 8,48)")
    g.add_argument("--self-frac", type=float, default=0.75,
                   help="share of each batch taken from the greedy windows (the rest from the "
                        "corpus, teacher forced)")
    g.add_argument("--gen-mix", help="TEMP:SHARE,... temperatures of the generated windows "
                                     "and their shares (default 0:1; --sampled "
                                     "0:0.4,0.7:0.3,1:0.3)")
    g.add_argument("--soft", action=argparse.BooleanOptionalAction, default=None,
                   help="sampled rows: KL to the target's distribution at the row's "
                        "temperature (default with --sampled) instead of the sampled token")
    g.add_argument("--init", help="a drafter to start from: a previous call's "
                                  "drafter.safetensors or a drafter bundle .kdtr (--sampled: "
                                  "the shipped kdtree_numba/demo/demo-drafter.kdtr)")
    g.add_argument("--resume", help="a previous call's ckpt/ folder: weights, AdamW moments, "
                                    "step (instead of --init)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--batch", type=int, help="windows per step (default 64; tiny 4)")
    g.add_argument("--anchors", type=int, help="blocks per window (default 64; tiny 8)")
    g.add_argument("--lr", type=float, help="peak (default 1e-3; --sampled 5e-4)")
    g.add_argument("--warmup", type=float, default=0.03, help="share of the training time")
    g.add_argument("--min-lr-frac", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip", type=float, default=1.0)
    g.add_argument("--gamma", type=float, default=7.0,
                   help="loss weights exp(-(k-1)/gamma) (DFlash: 7 for B 16, 4 for B 8)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-windows", type=int, help="teacher-forced windows (default 64)")
    g.add_argument("--eval-rows", type=int, help="free-running rows (default 512)")
    g.add_argument("--eval-temps", help="temperatures of the held-out generated windows the "
                                        "drafter is measured on before and after (default "
                                        "none; --sampled 0,0.7,1)")
    g.add_argument("--eval-budgets", help="DDTree budgets of the tree measure on those windows "
                                          "(default 7,32; tiny none)")
    g.add_argument("--eval-sampled-rows", type=int,
                   help="held-out generated windows, split over --eval-temps (default 384; "
                        "tiny 6)")
    return p.parse_args(argv)


EXPORT_S = 6.0     # of the reserve, kept for the export and metrics.json after evaluation
GREEDY_EVAL_S = 20.0   # of the reserve, kept for the held-out greedy windows and their measure
DEFAULTS = {"full": dict(minutes=5.0, reserve=50.0, seq=512, train_mb=64.0, heldout_mb=2.0,
                         batch=64, anchors=64, eval_windows=64, eval_rows=512, eval_chunk=64,
                         gen_seconds=150.0, gen_rows=1024, prefix="16,192"),
            "tiny": dict(minutes=1.5, reserve=20.0, seq=128, train_mb=0.3, heldout_mb=0.2,
                         batch=4, anchors=8, eval_windows=8, eval_rows=32, eval_chunk=8,
                         gen_seconds=8.0, gen_rows=4, prefix="8,48")}
for _p, _n in (("full", 384), ("tiny", 6)):
    DEFAULTS[_p].update(lr=1e-3, gen_mix="0:1", soft=False, eval_temps="",
                        eval_sampled_rows=_n, init=None,
                        # the tree's walk decodes step by step: too slow for the CPU smoke
                        eval_budgets="7,32" if _p == "full" else "",
                        # the smoke test trains a few steps however loaded the machine is
                        min_steps=3 if _p == "tiny" else 0)
# --sampled (issue 37): a fine-tune of the shipped drafter, so a lower peak; greedy rows keep
# T = 0 acceptance, the T = 0.7 and 1 rows teach the spread the sampled walk meets
SHIPPED_DRAFTER = os.path.join(REPO, "kdtree_numba", "demo", "demo-drafter.kdtr")
SAMPLED = dict(lr=5e-4, gen_mix="0:0.4,0.7:0.3,1:0.3", soft=True, eval_temps="0,0.7,1",
               init=SHIPPED_DRAFTER, minutes=8.0, reserve=40.0, gen_seconds=120.0)
SAMPLED_TINY = dict(SAMPLED, minutes=1.25, reserve=15.0, gen_seconds=6.0)


def settings(args) -> dict:
    preset = "tiny" if args.tiny else "full"
    s = dict(DEFAULTS[preset], preset=preset, sampled=args.sampled)
    if args.sampled:
        s.update(SAMPLED_TINY if args.tiny else SAMPLED)
    for k in s:
        if getattr(args, k, None) is not None:
            s[k] = getattr(args, k)
    if args.resume:
        s["init"] = None                  # the checkpoint's weights, not a bundle's
    s.update(warmup=args.warmup, min_lr_frac=args.min_lr_frac, resume=args.resume,
             weight_decay=args.weight_decay, clip=args.clip, gamma=args.gamma, seed=args.seed,
             layers=args.layers, block_size=args.block_size, self_frac=args.self_frac,
             target_layer_ids=[int(j) for j in args.target_layers.split(",")],
             overrides={k: json.loads(v) for k, v in (a.split("=", 1) for a in args.set)})
    s["gen_mix"] = parse_mix(s["gen_mix"])
    s["eval_temps"] = [float(t) for t in s["eval_temps"].split(",") if t.strip()]
    s["eval_budgets"] = [int(b) for b in s["eval_budgets"].split(",") if b.strip()]
    if any(t < 0 for t in s["eval_temps"]):
        sys.exit(f"train_drafter: --eval-temps {s['eval_temps']}: temperatures must be >= 0")
    return s


def parse_mix(text: str) -> list[tuple[float, float]]:
    """``0:0.4,1:0.6`` -> [(0.0, 0.4), (1.0, 0.6)], shares normalised to sum 1."""
    try:
        mix = [(float(t), float(w)) for t, w in (part.split(":") for part in text.split(","))]
    except ValueError:
        sys.exit(f"train_drafter: --gen-mix {text!r}: expected TEMP:SHARE,... (e.g. 0:0.5,1:0.5)")
    if any(t < 0 or w < 0 for t, w in mix) or sum(w for _, w in mix) <= 0 \
            or len({t for t, _ in mix}) != len(mix):
        sys.exit(f"train_drafter: --gen-mix {text!r}: temperatures >= 0, each once, shares "
                 f">= 0 with a positive sum")
    total = sum(w for _, w in mix)
    return sorted((t, w / total) for t, w in mix if w > 0)


def corpus_hp(args, tiny: bool, log) -> tuple[dict, dict | None]:
    """The corpus settings the target was trained with (and its corpus statistics, to check
    the rebuild against)."""
    path = args.metrics or os.path.join(os.path.dirname(os.path.abspath(args.target)),
                                        "metrics.json")
    if os.path.exists(path):
        with open(path) as fh:
            m = json.load(fh)
        hp, stats = dict(m["hp"]), m.get("corpus")
        log(f"corpus settings from {path}")
    else:
        import train_target
        hp, stats = dict(train_target.COMMON, **train_target.PRESETS["full"]), None
        log("corpus settings: train_target's full preset (no metrics.json given)")
    if tiny:
        hp.update(max_files=300, max_file_kb=32, heldout_min_files=20)
        stats = None
    return hp, stats


def lr_at(progress: float, peak: float, warmup: float, floor: float) -> float:
    """Linear warm-up over the first ``warmup`` of the training time, cosine to floor * peak."""
    warm = min(1.0, progress / warmup) if warmup > 0 else 1.0
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    return peak * max(warm, 1e-3) * (floor + (1.0 - floor) * cos)


def take_text(files, split: str, mb: float) -> list[str]:
    """Texts of ``split`` files in sha256 order (a spread over packages) up to ``mb`` MB."""
    out, used = [], 0
    for f in sorted((f for f in files if f.split == split), key=lambda f: f.sha256):
        if used >= mb * 1e6:
            break
        out.append(f.text)
        used += len(f.text)
    return out


def prepare_data(args, s, log, stages):
    import numpy as np
    from demo import bpe, corpus
    hp, want = corpus_hp(args, s["preset"] == "tiny", log)
    files, stats = stages.run("corpus", corpus.build, hp, args.workers, log)
    if want is not None:
        got = {k: (stats[k]["files"], stats[k]["bytes"]) for k in ("train", "heldout")}
        exp = {k: (want[k]["files"], want[k]["bytes"]) for k in ("train", "heldout")}
        log("corpus matches the target's" if got == exp else
            f"WARNING: corpus differs from the target's: {got} vs {exp}")
    with open(os.path.join(args.target, "tokenizer.json")) as fh:
        tok = bpe.load_bpe(fh.read())

    def tokenise():
        return {split: bpe.token_stream(bpe.encode_texts(tok, take_text(files, split, mb)))
                for split, mb in (("train", s["train_mb"]), ("heldout", s["heldout_mb"]))}
    streams = stages.run("tokenise", tokenise)
    log(f"tokens: {streams['train'].size / 1e6:.2f} M train ({s['train_mb']} MB), "
        f"{streams['heldout'].size / 1e6:.3f} M held-out; tokenizer "
        f"{tok.get_vocab_size()} entries (the target's)")
    return stats, {k: np.asarray(v, np.int32) for k, v in streams.items()}, tok.get_vocab_size()


def build_drafter(args, s, model, device, log):
    from demo import dflash, distill
    with open(os.path.join(args.target, "config.json")) as fh:
        target_hf = json.load(fh)
    L = target_hf["num_hidden_layers"]
    if not all(0 <= j < L for j in s["target_layer_ids"]):
        sys.exit(f"train_drafter: --target-layers {s['target_layer_ids']} outside 0..{L - 1}")
    cfg = dflash.drafter_config(target_hf, num_hidden_layers=s["layers"], **s["overrides"])
    embed, head = distill.target_head(model)
    drafter = dflash.DFlashDrafter(cfg, s["target_layer_ids"], s["block_size"], embed, head)
    drafter.init_weights(seed=s["seed"])
    drafter.check_names()                 # fail now, not after training
    drafter.to(device)
    dspec = {"target_layer_ids": list(s["target_layer_ids"]), "block_size": s["block_size"],
             "target_hidden_size": target_hf["hidden_size"],
             "target_vocab_size": target_hf["vocab_size"], "target_num_layers": L}
    log(f"drafter: {dflash.param_count(drafter):,} parameters ({dflash.bf16_mib(drafter)} MiB "
        f"bf16), {cfg['num_hidden_layers']} layers, B {s['block_size']}, features of target "
        f"layers {s['target_layer_ids']}, lm_head {'tied (embedding)' if head is None else 'own'}")
    return drafter, cfg, dspec


def batch_plan(pools: dict, s: dict) -> list[tuple[float, int]]:
    """[(temperature, rows per batch)] of the generated pools: round(self_frac * batch) rows
    split over the temperatures by their --gen-mix shares, greedy first (the rest of a batch
    comes from the corpus).  Fixed per batch, so a step slices without asking the device."""
    if not pools:
        return []
    n_self = min(s["batch"], round(s["batch"] * s["self_frac"]))
    shares = dict(s["gen_mix"])
    plan, used = [], 0
    temps = sorted(pools)
    for i, t in enumerate(temps):
        n = n_self - used if i == len(temps) - 1 else min(n_self - used,
                                                          round(n_self * shares[t]))
        plan.append((t, n))
        used += n
    return [(t, n) for t, n in plan if n > 0]


def train(drafter, opt, model, tap, streams, pools, s, device, amp_dtype, stop_at,
          should_stop, log, print_every: float, step0: int = 0) -> dict:
    """``pools``: {temperature: generated windows [N, T]} (distill.generate_pool; may be
    empty); each batch takes rows of each pool at random as ``batch_plan`` says, the rest
    from the corpus stream.  Corpus and greedy rows learn the target's teacher-forced argmax
    (cross-entropy); sampled rows the target's distribution at their temperature
    (``--soft``: KL) or the sampled token itself."""
    import torch
    from demo import dflash, distill, trainer
    T, B, A, bs = s["seq"], s["block_size"], s["anchors"], s["batch"]
    sampler = trainer.WindowSampler(streams.numel(), T - 1, s["seed"] + step0)
    plan = batch_plan(pools, s)
    n_self = sum(n for _, n in plan)
    n_greedy = sum(n for t, n in plan if t == 0)
    n_hard = bs - n_self + n_greedy                 # rows whose labels are argmaxes
    hot_temps = torch.tensor([t for t, n in plan if t > 0 for _ in range(n)],
                             dtype=torch.float32, device=device)
    w = dflash.position_weights(B, s["gamma"], device)
    gen = torch.Generator(device=device).manual_seed(s["seed"] + step0)
    t0 = time.monotonic()
    total = max(1.0, stop_at - t0)
    st = {"step": step0, "seqs": 0, "history": [], "rows": {"corpus": bs - n_self,
                                                            **{f"{t:g}": n for t, n in plan}}}
    acc = {"loss": torch.zeros((), device=device), "kl": torch.zeros((), device=device),
           "top1": torch.zeros(B - 1, device=device), "n": 0, "blocks": 0, "seqs": 0, "t": t0}
    drafter.train()

    def report(lr):
        now = time.monotonic()
        dt = max(1e-9, now - acc["t"])
        top1 = (acc["top1"] / max(1, acc["blocks"])).tolist()
        row = {"step": st["step"], "trained_s": round(now - t0, 1),
               "loss": round(acc["loss"].item() / max(1, acc["n"]), 4), "lr": lr,
               "tok_s": round(acc["seqs"] * T / dt), "blocks_s": round(acc["blocks"] / dt),
               "top1": [round(v, 3) for v in top1], "epoch": sampler.epoch}
        if len(hot_temps) and s["soft"]:
            row["kl_sampled"] = round(acc["kl"].item() / max(1, acc["n"]), 4)
        st["history"].append(row)
        log(f"step {row['step']:5d} | {row['tok_s'] / 1e3:6.1f}k tok/s "
            f"{row['blocks_s'] / 1e3:6.1f}k blocks/s | loss {row['loss']:.4f}"
            + (f" (KL of sampled rows {row['kl_sampled']:.4f})" if "kl_sampled" in row else "")
            + f" | lr {lr:.2e} | top-1 by slot {' '.join(f'{v:.2f}' for v in top1)} | "
            f"epoch {sampler.epoch}")
        acc["loss"].zero_()
        acc["kl"].zero_()
        acc["top1"].zero_()
        acc.update(n=0, blocks=0, seqs=0, t=now)

    t_report = t0
    lr = 0.0
    soft = bool(s["soft"]) and len(hot_temps) > 0
    while True:
        now = time.monotonic()
        if should_stop() or (now >= stop_at and st["step"] - step0 >= s["min_steps"]):
            break
        lr = lr_at(min(1.0, (now - t0) / total), s["lr"], s["warmup"], s["min_lr_frac"])
        for grp in opt.param_groups:
            grp["lr"] = lr
        parts = [] if n_self == bs else [trainer.gather(streams, sampler.next_starts_on(
            bs - n_self, device), T - 1)]
        for t, n in plan:
            pool = pools[t]
            parts.append(pool[torch.randint(0, pool.shape[0], (n,), device=device,
                                            generator=gen)])
        ids = torch.cat(parts) if len(parts) > 1 else parts[0]
        out = distill.target_pass(model, tap, ids, amp_dtype, keep_logits=soft)
        feats, greedy = out[0], out[1]
        anchors = distill.random_anchors(bs, A, T, B, device, gen)
        labels = distill.block_labels(greedy, anchors, B)
        if len(hot_temps) and not soft:         # the sampled token: DFlash's hard labels
            labels[n_hard:] = distill.block_labels(ids[n_hard:, 1:], anchors[n_hard:], B)
        with trainer.autocast(device.type, amp_dtype):
            logits = drafter(feats, distill.block_roots(ids, anchors), anchors)
        if soft:
            pos = (anchors[n_hard:, :, None] + torch.arange(B - 1, device=device)).flatten(1)
            tl = out[2][n_hard:].gather(1, pos[..., None].expand(-1, -1, out[2].shape[-1]))
            probs = distill.target_probs(tl.view(*labels[n_hard:].shape, -1), hot_temps)
            kl = dflash.weighted_kl(logits[n_hard:], probs, w)
            loss = kl * (bs - n_hard) / bs
            if n_hard:
                loss = loss + dflash.weighted_ce(logits[:n_hard], labels[:n_hard], w) \
                    * n_hard / bs
        else:
            loss = dflash.weighted_ce(logits, labels, w)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), s["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            acc["loss"] += loss.detach()
            if soft:
                acc["kl"] += kl.detach()
            acc["top1"] += (logits.argmax(-1) == labels).flatten(0, 1).sum(0)
        acc["n"] += 1
        acc["blocks"] += bs * A
        acc["seqs"] += bs
        st["step"] += 1
        st["seqs"] += bs
        if time.monotonic() - t_report >= print_every:
            report(lr)
            t_report = time.monotonic()
    if acc["n"]:
        report(lr)
    st["trained_s"] = round(time.monotonic() - t0, 1)
    st["epochs"] = round(st["seqs"] * (bs - n_self) / bs * (T - 1) / streams.numel(), 3)
    st["pool_passes"] = (round(st["seqs"] * n_self / bs / sum(p.shape[0] for p in
                                                              pools.values()), 3)
                         if n_self else 0.0)
    return st


def measure_sampled(drafter, model, tap, heldout, amp_dtype, s) -> dict:
    """The chain's expected tau (distill.evaluate_sampled) and DDTree's tau at each of
    --eval-budgets (distill.evaluate_tree) on the held-out generated windows, by temperature."""
    from demo import distill
    out = {"chain": distill.evaluate_sampled(drafter, model, tap, *heldout, amp_dtype,
                                             chunk=s["eval_chunk"])}
    for b in s["eval_budgets"]:
        out[f"tree_{b}"] = distill.evaluate_tree(drafter, model, tap, *heldout, amp_dtype,
                                                 budget=b, chunk=s["eval_chunk"])
    return out


def load_init(drafter, path: str, cfg: dict, dspec: dict, log) -> None:
    """Start from ``path``: a drafter bundle (.kdtr: its config and dflash attributes must be
    this call's) or a drafter.safetensors under the bundle's names."""
    if path.endswith(".kdtr"):
        import numpy as np
        from kdtree_numba.bundle import DFLASH_VOCAB_RANK, read_dflash_bundle
        from kdtree_numba.config import ModelConfig
        config, weights, spec = read_dflash_bundle(path)
        want = (ModelConfig(**cfg), tuple(dspec["target_layer_ids"]), dspec["block_size"])
        have = (config, tuple(spec.target_layer_ids), spec.block_size)
        if have != want:
            sys.exit(f"train_drafter: --init {path}: its drafter (layers {config.num_hidden_layers}"
                     f", target layers {have[1]}, B {have[2]}) is not this call's (layers "
                     f"{cfg['num_hidden_layers']}, target layers {want[1]}, B {want[2]}); "
                     f"pass matching --layers/--target-layers/--block-size/--set")
        # the token ranking (tools/draft_vocab.py) is no weight: rerun the tool on the export
        weights = {k: np.asarray(v, np.float32) for k, v in weights.items()
                   if k != DFLASH_VOCAB_RANK}
    else:
        from safetensors.torch import load_file
        weights = load_file(path)
    drafter.load_bundle_tensors(weights)
    log(f"drafter initialised from {path}")


CKPT_KIND = "dflash_drafter"


def save_ckpt(ckpt_dir: str, drafter, opt, cfg: dict, dspec: dict, st: dict, s: dict):
    """``ckpt/``: weights and AdamW moments (bf16 safetensors, demo/checkpoint.py) and
    state.json (step, drafter config); what ``--resume`` reads."""
    from demo import checkpoint
    names = checkpoint.save_checkpoint(ckpt_dir, drafter, opt, {
        "kind": CKPT_KIND, "step": st["step"], "config": cfg, "dflash": dspec,
        "settings": {k: v for k, v in s.items() if k != "overrides"}})
    return [os.path.join("ckpt", n) for n in names]


def resume(ckpt_dir: str, drafter, opt, cfg: dict, dspec: dict, log) -> int:
    """Restore ``--resume``'s weights, moments and RNG states; returns its step."""
    from demo import checkpoint
    try:
        state, tensors = checkpoint.read_checkpoint(ckpt_dir)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"train_drafter: --resume {e}")
    if state.get("kind") != CKPT_KIND:
        sys.exit(f"train_drafter: --resume {ckpt_dir}: a {state.get('kind', 'target')!r} "
                 f"checkpoint, not a drafter's")
    if state["config"] != json.loads(json.dumps(cfg)) or state["dflash"] != dspec:
        sys.exit(f"train_drafter: --resume {ckpt_dir}: its drafter config differs from this "
                 f"call's (layers, sizes, target layers or block size)")
    checkpoint.restore(drafter, opt, state, tensors)
    log(f"resumed from {ckpt_dir} at step {state['step']}")
    return int(state["step"])


def export(drafter, cfg, dspec, s, out: str, log) -> list[str]:
    """drafter.safetensors + drafter_config.json, then the bundle if the engine can write it."""
    import export_drafter
    import torch
    from safetensors.torch import save_file
    tensors = {k: v.to("cpu", torch.bfloat16).contiguous()
               for k, v in drafter.bundle_tensors().items()}
    save_file(tensors, os.path.join(out, "drafter.safetensors"),
              metadata={"format": export_drafter.FORMAT})
    with open(os.path.join(out, "drafter_config.json"), "w") as fh:
        json.dump({"format": export_drafter.FORMAT, "config": cfg, "dflash": dspec,
                   "training": {"gamma": s["gamma"], "seq": s["seq"]}}, fh, indent=1)
    written = ["drafter.safetensors", "drafter_config.json"]
    try:
        export_drafter.write(out, os.path.join(out, "drafter.kdtr"))
        written.append("drafter.kdtr")
    except Exception as e:     # noqa: BLE001 -- the two files above are the result
        log(f"bundle not written here ({type(e).__name__}: {e}); on the CPU: python3 "
            f"tools/export_drafter.py <files_at> drafter.kdtr")
    return written


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.workers))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    sys.path[:0] = [TOOLS, REPO]
    import torch
    import transformers
    from demo import dflash, distill
    from train_target import Stages, check_transfer_limits, report_table

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(max(1, args.workers))
    stages = Stages()

    def log(msg: str) -> None:          # seconds since this process started
        print(f"[{time.monotonic() - T_START:7.1f}s] {msg}", flush=True)
    stop = {"asked": False}

    def on_signal(signum, frame):
        stop["asked"] = True
        log(f"signal {signum}: stopping training; evaluation and export follow")
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    s = settings(args)
    stop_at = T_START + 60 * s["minutes"] - s["reserve"]
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp_dtype = torch.bfloat16 if device.type == "cuda" else None     # CPU: plain fp32
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    log(f"drafter training: preset {s['preset']}, device {device}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, budget {s['minutes']} min")

    corpus_stats, streams, n_tok = prepare_data(args, s, log, stages)
    model, experts_impl = stages.run("target", distill.load_target, args.target, device, log)
    if n_tok > model.config.vocab_size:
        sys.exit(f"train_drafter: tokenizer has {n_tok} entries > target vocab "
                 f"{model.config.vocab_size}")
    tap = distill.FeatureTap(model, s["target_layer_ids"])
    drafter, cfg, dspec = stages.run("drafter", build_drafter, args, s, model, device, log)
    dev_streams = {k: torch.from_numpy(v).to(device) for k, v in streams.items()}
    from demo import trainer
    opt = trainer.make_optimizer(drafter, s["lr"], s["weight_decay"], 0.95)
    step0 = 0
    if s["resume"]:
        step0 = stages.run("resume", resume, s["resume"], drafter, opt, cfg, dspec, log)
    elif s["init"]:
        load_init(drafter, s["init"], cfg, dspec, log)
    pools, lo, hi = {}, *(int(v) for v in s["prefix"].split(","))
    if s["gen_seconds"] > 0 and s["self_frac"] > 0:
        # a resumed call draws other windows (the seed moves with the step)
        pool, _, temps = stages.run("generate", distill.generate_pool, model,
                                    dev_streams["train"], s["seq"], s["gen_rows"], (lo, hi),
                                    amp_dtype, s["gen_seconds"], s["seed"] + step0, log,
                                    mix=s["gen_mix"])
        pools = {t: pool[(temps - t).abs() < 1e-6] for t, _ in s["gen_mix"]}
        pools = {t: p for t, p in pools.items() if p.shape[0]}
        log("generated windows by temperature: "
            + ", ".join(f"T {t:g}: {p.shape[0]}" for t, p in pools.items()))
    sampled_eval = None
    if s["eval_temps"]:
        t0 = time.monotonic()
        n_t = len(s["eval_temps"])
        rows = max(n_t, s["eval_sampled_rows"] // n_t * n_t)
        ho = stages.run("generate_heldout", distill.generate_pool, model,
                        dev_streams["heldout"], s["seq"], rows, (lo, hi), amp_dtype, 0.0,
                        s["seed"] + 1, log, mix=[(t, 1.0 / n_t) for t in s["eval_temps"]])
        sampled_eval = {"init": s["init"] or s["resume"], "rows": rows}
        sampled_eval["before"] = stages.run("evaluate_before", measure_sampled, drafter, model,
                                            tap, ho, amp_dtype, s)
        # the same measure after training costs about as much again
        stop_at -= stages.times["evaluate_before"]
        log("before: tau " + "; ".join(
            f"{m} " + ", ".join(f"T {t}: {v.get('chain_tau', v.get('tau')):.3f}"
                                for t, v in r.items())
            for m, r in sampled_eval["before"].items())
            + f" ({time.monotonic() - t0:.1f} s with the held-out generation)")
    log(f"target: {sum(p.numel() for p in model.parameters()):,} parameters, experts "
        f"{experts_impl}; training until {stop_at - T_START:.0f} s")

    st = stages.run("train", train, drafter, opt, model, tap, dev_streams["train"], pools, s,
                    device, amp_dtype, stop_at, lambda: stop["asked"], log, args.print_every,
                    step0)
    if sampled_eval is not None:
        sampled_eval["after"] = stages.run("evaluate_after", measure_sampled, drafter, model,
                                           tap, ho, amp_dtype, s)
    greedy_pool = sampled_eval is None and 0.0 in pools
    ev = stages.run("evaluate", distill.evaluate, drafter, model, tap, dev_streams["heldout"],
                    s["seq"], amp_dtype, windows=s["eval_windows"], anchors=s["anchors"],
                    free_rows=s["eval_rows"], gamma=s["gamma"], chunk=s["eval_chunk"],
                    deadline=T_START + 60 * s["minutes"] - EXPORT_S
                    - (GREEDY_EVAL_S if greedy_pool else 0.0))
    ev["greedy"] = None
    ev["sampled"] = sampled_eval
    if greedy_pool:
        hp_pool, hp_pre, _ = stages.run("generate_heldout", distill.generate_pool, model,
                                        dev_streams["heldout"], s["seq"],
                                        min(s["gen_rows"], 128), (lo, hi), amp_dtype, 0.0,
                                        s["seed"] + 1, log)
        ev["greedy"] = stages.run("evaluate_greedy", distill.evaluate_greedy, drafter, model,
                                  tap, hp_pool, hp_pre, amp_dtype, anchors=s["anchors"],
                                  chunk=s["eval_chunk"])
    written = stages.run("export", export, drafter, cfg, dspec, s, args.out, log)
    written += stages.run("checkpoint", save_ckpt, os.path.join(args.out, "ckpt"), drafter, opt,
                          cfg, dspec, st, s)

    metrics = {"settings": s, "target": os.path.abspath(args.target), "device": str(device),
               "versions": {"torch": torch.__version__,
                            "transformers": transformers.__version__},
               "experts_impl": experts_impl, "corpus": corpus_stats,
               "tokens": {k: int(v.size) for k, v in streams.items()},
               "drafter": {"params": dflash.param_count(drafter),
                           "bf16_mib": dflash.bf16_mib(drafter), "config": cfg, "dflash": dspec},
               "train": {k: st[k] for k in ("step", "seqs", "trained_s", "epochs",
                                            "pool_passes")},
               "pool_windows": {f"{t:g}": int(p.shape[0]) for t, p in pools.items()},
               "batch_rows": st["rows"],
               "heldout": ev, "written": written, "stages_s": stages.times,
               # the headline: expected chain tokens per round on held-out generated text
               "tau": None if sampled_eval is None else {
                   k: {m: {t: v.get("chain_tau", v.get("tau")) for t, v in r.items()}
                       for m, r in sampled_eval[k].items()}
                   for k in ("before", "after")},
               "wall_s": round(time.monotonic() - T_START, 1), "history": st["history"]}
    with open(os.path.join(args.out, "metrics.json"), "w") as fh:
        json.dump(metrics, fh, indent=1)
    check_transfer_limits(args.out, log)

    tf, fr = ev["teacher_forced"], ev["free_running"]
    rows = [("parameters", f"{metrics['drafter']['params']:,} ({metrics['drafter']['bf16_mib']}"
                           f" MiB bf16)"),
            ("steps / windows / corpus epochs / pool passes",
             f"{st['step']} / {st['seqs']} / {st['epochs']} / {st['pool_passes']}"),
            ("trained", f"{st['trained_s']:.1f} s")]
    if tf:
        rows += [("held-out loss (weighted CE)", f"{tf['loss']:.4f}"),
                 ("top-1 by slot (teacher forced)", " ".join(f"{v:.3f}" for v in tf["top1"])),
                 ("top-4 by slot (teacher forced)", " ".join(f"{v:.3f}" for v in tf["top4"]))]
    if fr:
        rows += [("top-1 by depth (free running)", " ".join(f"{v:.3f}" for v in fr["top1"])),
                 ("top-4 by depth (free running)", " ".join(f"{v:.3f}" for v in fr["top4"])),
                 ("chain tau measured / from top-1", f"{fr['tau']:.3f} / "
                                                     f"{fr['tau_from_top1']:.3f}"),
                 ("accepted histogram 0..B-1", str(fr["accepted_hist"]))]
    gr = ev["greedy"]
    if sampled_eval:
        for t in sampled_eval["before"]["chain"]:
            for m, name in [("chain", "chain"), *((f"tree_{b}", f"DDTree budget {b}")
                                                  for b in s["eval_budgets"])]:
                b, a = sampled_eval["before"][m][t], sampled_eval["after"][m][t]
                rows.append((f"held-out T {t}: {name} tau before -> after",
                             f"{b.get('chain_tau', b.get('tau')):.3f} -> "
                             f"{a.get('chain_tau', a.get('tau')):.3f} ({a['blocks']} blocks)"))
            b, a = sampled_eval["before"]["chain"][t], sampled_eval["after"]["chain"][t]
            rows.append((f"held-out T {t}: top-4 mass depth 1..3 before -> after",
                         " ".join(f"{v:.3f}" for v in b["top4_mass"][:3]) + " -> "
                         + " ".join(f"{v:.3f}" for v in a["top4_mass"][:3])))
    if gr:
        rows += [("top-1 by depth (held-out greedy text)",
                  " ".join(f"{v:.3f}" for v in gr["top1"])),
                 ("top-4 by depth (held-out greedy text)",
                  " ".join(f"{v:.3f}" for v in gr["top4"])),
                 ("chain tau on held-out greedy text", f"{gr['tau']:.3f} ({gr['blocks']} blocks)")]
    rows += [(f"stage {k}", f"{v:.1f} s") for k, v in stages.times.items()]
    rows += [("written", ", ".join(written)), ("wall", f"{metrics['wall_s']:.1f} s")]
    print(report_table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
