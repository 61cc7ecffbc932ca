"""Train the demo target of issue 14: transformers' DeepseekV3ForCausalLM (MLA + MoE) on the
Python sources installed on the machine it runs on, resumable across device calls.

    python3 tools/train_target.py --out $OUT                      # first call
    python3 tools/train_target.py --out $OUT --resume CKPT_DIR    # each later call
    python3 tools/train_target.py --tiny --out /tmp/smoke         # CPU smoke test, ~1 minute

A call builds the corpus (stdlib + site-packages ``.py`` files, deduplicated, split by
directory), trains the byte-level BPE tokenizer (first call; later calls take it from the
checkpoint), tokenises the corpus into uint16 streams (``--work``, reused when the manifest and
the tokenizer are unchanged), then trains until either the planned training time
(``--total-minutes``, over all calls: the LR schedule's length) is spent or this call's budget
(``--minutes``, wall clock from the process start, ``--reserve`` seconds kept for the end) runs
out.  It then evaluates the whole held-out stream and writes into ``--out``:

    manifest.jsonl          path, size, sha256, split, group of every corpus file
    heldout_prompts.jsonl   prefixes of held-out files, the prompt set of the measurements
    metrics.json            corpus, model size, stage times, progress history, held-out results
    ckpt/                   if training is not finished: shards + state.json (--resume this)
    export/                 if it is: save_pretrained (bf16) + tokenizer.json

That is at most 8 files, each under 16 MiB: what one device call can bring back.  The recipe,
the sizes and the numbers are in docs/DEMO.md.  SIGTERM/SIGINT stop training early and still
write the checkpoint.
"""
from __future__ import annotations

import time

T_START = time.monotonic()       # --minutes counts from here, before the heavy imports

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

# Hyperparameters a checkpoint fixes (a resumed call takes them from it).  prompt_max_tokens:
# 512 - 160, room for 128 new tokens and a tree's depth inside the trained context.
PRESETS = {
    "full": dict(vocab=8192, seq=512, batch=64, lr=2e-3, warmup_steps=300, total_minutes=15.0,
                 max_files=None, max_file_kb=400, heldout_min_files=400,
                 tokenizer_sample_mb=32, eval_windows=64, eval_batch=64, n_prompts=128,
                 prompt_max_tokens=352),
    "tiny": dict(vocab=512, seq=128, batch=8, lr=3e-3, warmup_steps=10, total_minutes=0.5,
                 max_files=300, max_file_kb=32, heldout_min_files=20,
                 tokenizer_sample_mb=8, eval_windows=16, eval_batch=16, n_prompts=16,
                 prompt_max_tokens=1000),
}
COMMON = dict(min_lr_frac=0.1, weight_decay=0.1, beta2=0.95, clip=1.0, bias_gamma=1e-3,
              heldout_frac=0.01, max_group_files=40, max_line_chars=1000, skip_tests=False,
              seed=0, model_overrides={})


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (on the GPU machine: $OUT)")
    p.add_argument("--resume", metavar="CKPT_DIR", help="a ckpt/ folder an earlier call wrote")
    p.add_argument("--tiny", action="store_true",
                   help="smoke-test size: 300 files, vocab 512, 2 layers of width 64")
    p.add_argument("--minutes", type=float,
                   help="this call's wall-clock budget from the process start (default 9.5; "
                        "tiny 1)")
    p.add_argument("--reserve", type=float,
                   help="seconds of the budget kept for evaluation and writing (default 30; "
                        "tiny 10)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="threads for reading, tokenising and torch on the CPU")
    p.add_argument("--work", default="/tmp/kdtree-demo-work",
                   help="folder for the token streams (.npy), reused between calls")
    p.add_argument("--finish", action="store_true",
                   help="the last call: fit the rest of the schedule into this call's budget "
                        "and export whatever happens")
    p.add_argument("--experts-impl", default="auto", choices=["auto", "eager", "grouped_mm"],
                   help="transformers' expert kernel; auto: on a GPU time both, keep the faster")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer (not measured; off by default)")
    p.add_argument("--print-every", type=float, default=20.0, help="seconds between progress lines")
    p.add_argument("--eval-every", type=float, default=90.0,
                   help="seconds between quick held-out evaluations")
    g = p.add_argument_group("hyperparameters (first call only; a checkpoint fixes them)")
    g.add_argument("--total-minutes", type=float, help="planned training time over all calls")
    g.add_argument("--seq", type=int, help="context length")
    g.add_argument("--batch", type=int, help="sequences per step")
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--warmup-steps", type=int)
    g.add_argument("--vocab", type=int, help="BPE vocabulary size (specials included)")
    g.add_argument("--max-files", type=int, help="use this many source files (a hash sample)")
    g.add_argument("--heldout-min-files", type=int)
    g.add_argument("--bias-gamma", type=float,
                   help="aux-free router bias step per optimizer step (0: bias stays 0)")
    g.add_argument("--seed", type=int)
    g.add_argument("--skip-tests", action="store_true", default=None,
                   help="leave out test/tests/testing directories")
    g.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a DeepseekV3Config field of the preset (repeatable)")
    return p.parse_args(argv)


HP_FLAGS = ("total_minutes", "seq", "batch", "lr", "warmup_steps", "vocab", "max_files",
            "heldout_min_files", "bias_gamma", "seed", "skip_tests")


def hyperparameters(args, saved: dict | None) -> dict:
    """The run's fixed settings: the checkpoint's on resume, else preset + COMMON + flags."""
    given = [f for f in HP_FLAGS if getattr(args, f) is not None] + (["set"] if args.set else [])
    if saved is not None:
        if given:
            sys.exit(f"train_target: --resume takes the hyperparameters from the checkpoint; "
                     f"drop {', '.join('--' + f.replace('_', '-') for f in given)}")
        return saved
    preset = "tiny" if args.tiny else "full"
    hp = dict(COMMON, **PRESETS[preset], preset=preset, model_overrides={})
    for f in HP_FLAGS:
        if getattr(args, f) is not None:
            hp[f] = getattr(args, f)
    for item in args.set:
        key, _, value = item.partition("=")
        hp["model_overrides"][key] = json.loads(value)
    return hp


class Log:
    """print, prefixed with the seconds since the process started."""

    def __call__(self, msg: str) -> None:
        print(f"[{time.monotonic() - T_START:7.1f}s] {msg}", flush=True)


class Stages:
    """Wall time of each stage, for the report."""

    def __init__(self):
        self.times: dict[str, float] = {}

    def run(self, name, fn, *a, **kw):
        t = time.monotonic()
        out = fn(*a, **kw)
        self.times[name] = round(self.times.get(name, 0.0) + time.monotonic() - t, 2)
        return out


def check_transfer_limits(out: str, log) -> None:
    """Warn when --out holds more than the device call brings back (8 files, 16 MiB each,
    at most 2 folders down)."""
    found = []
    for dirpath, _, names in os.walk(out):
        for n in names:
            path = os.path.join(dirpath, n)
            found.append((os.path.relpath(path, out), os.path.getsize(path)))
    big = [f"{p} ({b / 2**20:.1f} MiB)" for p, b in found if b > 16 * 2**20]
    deep = [p for p, _ in found if p.count(os.sep) > 1]
    if len(found) > 8 or big or deep:
        log(f"WARNING: {out} holds {len(found)} files (a device call returns 8 of at most "
            f"16 MiB, 2 folders down); too large: {big}; too deep: {deep}")


def report_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k.ljust(width)} | {v} |" for k, v in rows)


# ----------------------------------------------------------------------------- main

def prepare_data(args, hp: dict, saved: dict | None, log, stages) -> SimpleNamespace:
    """Corpus, manifest, tokenizer, token streams and prompts.  On resume the corpus must be
    the checkpoint's (manifest digest) and the tokenizer is the checkpoint's: retraining it
    need not give the same merges."""
    from demo import bpe, corpus
    files, stats = stages.run("corpus", corpus.build, hp, args.workers, log)
    digest = stages.run("manifest", corpus.write_manifest, files,
                        os.path.join(args.out, "manifest.jsonl"))
    if saved and saved["manifest_sha256"] != digest:
        sys.exit("train_target: this machine's corpus differs from the checkpoint's "
                 "(manifest digest): the split and the token streams would not match")
    if saved:
        tok_json = saved["tokenizer_json"]
    else:
        tok_json = stages.run("tokenizer", bpe.train_on_files, files, hp["vocab"],
                              hp["tokenizer_sample_mb"]).to_str()
    tok = bpe.load_bpe(tok_json)
    log(f"tokenizer: byte-level BPE, {tok.get_vocab_size()} entries"
        + (" (the checkpoint's)" if saved else ""))
    if tok.get_vocab_size() > hp["vocab"]:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} entries > vocab {hp['vocab']}")
    key = hashlib.sha256((digest + tok_json).encode()).hexdigest()[:16]
    streams = stages.run("tokenise", bpe.cached_streams, files, tok, key, args.work, log)
    prompts = stages.run("prompts", corpus.heldout_prompts, files, hp["n_prompts"],
                         lambda text: 1 + len(tok.encode(text, add_special_tokens=False).ids),
                         hp["prompt_max_tokens"])
    corpus.write_jsonl(prompts, os.path.join(args.out, "heldout_prompts.jsonl"))
    return SimpleNamespace(stats=stats, digest=digest, tok_json=tok_json, streams=streams,
                           n_prompts=len(prompts))


def prepare_model(args, hp: dict, saved: dict | None, saved_tensors, data, device, amp_dtype,
                  log, stages) -> SimpleNamespace:
    """Model, optimizer, router balancer, data position and the device streams; restored
    from the checkpoint on resume."""
    import numpy as np
    import torch
    from demo import checkpoint, target, trainer
    torch.manual_seed(hp["seed"])
    hf_cfg = saved["hf_config"] if saved else target.hf_config(
        target.TINY if hp["preset"] == "tiny" else target.FULL, hp["vocab"], hp["seq"],
        eot_id=0, overrides=hp["model_overrides"])
    model = stages.run("model", target.build_model, hf_cfg, device)
    opt = trainer.make_optimizer(model, hp["lr"], hp["weight_decay"], hp["beta2"])
    sizes = target.param_counts(model)
    log(f"model: {sizes['params'] / 1e6:.2f} M parameters ({sizes['active_per_token'] / 1e6:.2f}"
        f" M per token), export {sizes['export_mib']} MiB in bf16")
    balancer = target.RouterBalancer(model, hp["bias_gamma"])
    log(f"router balancer: {len(balancer.routers)} routers, bias step {hp['bias_gamma']}")
    streams = {s: torch.from_numpy(np.asarray(a, np.int32)).to(device)
               for s, a in data.streams.items()}
    st = trainer.TrainState(**saved["train"]) if saved else trainer.TrainState()
    sampler = trainer.WindowSampler(streams["train"].numel(), hp["seq"], hp["seed"], st.epoch,
                                    st.cursor)

    def probe_step():        # forward + backward, weights untouched: for timing kernels
        balancer.enabled = False
        try:
            b = trainer.gather(streams["train"], sampler.perm[:hp["batch"]] * hp["seq"],
                               hp["seq"])
            logits = trainer.next_token_logits(model, b[:, :-1], amp_dtype)
            torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                              b[:, 1:].flatten()).backward()
        finally:
            model.zero_grad(set_to_none=True)
            balancer.enabled = True
    experts_impl = stages.run("experts_probe", target.pick_experts_impl, model, probe_step,
                              args.experts_impl, device, log)
    if saved:                                  # after the probe: it must not see old grads
        checkpoint.restore(model, opt, saved, saved_tensors)
        log(f"resumed at step {st.step}, {st.trained_s / 60:.2f} min trained, epoch "
            f"{st.epoch}")
    if args.compile:
        for layer in model.model.layers:
            layer.compile()
    return SimpleNamespace(hf_cfg=hf_cfg, model=model, opt=opt, balancer=balancer, st=st,
                           sampler=sampler, streams=streams, sizes=sizes,
                           experts_impl=experts_impl)


def write_results(args, hp, data, m, lc, ev, finished: bool, call_tok_s: float, device,
                  log, stages) -> None:
    """Export (finished) or checkpoint (not), metrics.json and the printed table."""
    import torch
    import transformers
    from demo import checkpoint
    st = m.st
    if finished:
        written = stages.run("export", checkpoint.export_pretrained, m.model, m.hf_cfg,
                             os.path.join(args.out, "export"), data.tok_json)
        log(f"training finished: export/ {written}")
    else:
        state = {"hp": hp, "hf_config": m.hf_cfg, "train": st.to_dict(),
                 "manifest_sha256": data.digest, "tokenizer_json": data.tok_json}
        written = stages.run("checkpoint", checkpoint.save_checkpoint,
                             os.path.join(args.out, "ckpt"), m.model, m.opt, state)
        log(f"checkpoint: ckpt/ {written}; next call: --resume <that folder>")
    epochs = round(st.tokens / max(1, m.streams["train"].numel()), 3)
    metrics = {"finished": finished, "hp": hp, "hf_config": m.hf_cfg, "corpus": data.stats,
               "model": m.sizes, "experts_impl": m.experts_impl, "device": str(device),
               "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
               "train": {"step": st.step, "tokens": st.tokens, "trained_s": round(st.trained_s, 1),
                         "planned_s": round(lc.total_s, 1), "epochs": epochs,
                         "this_call_tokens_per_s": round(call_tok_s)},
               "heldout": ev, "prompts": data.n_prompts, "stages_s": stages.times,
               "wall_s": round(time.monotonic() - T_START, 1), "history": st.history}
    with open(os.path.join(args.out, "metrics.json"), "w") as fh:
        json.dump(metrics, fh, indent=1)
    check_transfer_limits(args.out, log)
    last_loss = next((h["loss"] for h in reversed(st.history) if "loss" in h), float("nan"))
    rows = [("finished", str(finished)),
            ("parameters", f"{m.sizes['params']:,} ({m.sizes['export_mib']} MiB bf16)"),
            ("steps / tokens", f"{st.step} / {st.tokens / 1e6:.1f} M ({epochs} epochs)"),
            ("trained", f"{st.trained_s / 60:.2f} of {lc.total_s / 60:.2f} min"),
            ("tokens/s (this call)", f"{call_tok_s / 1e3:.1f}k"),
            ("train loss (last report)", f"{last_loss:.4f}")]
    if ev is not None:
        rows += [("held-out loss", f"{ev['loss']:.4f} nats/token"),
                 ("held-out top-1", f"{ev['top1']:.4f}"),
                 ("held-out bits/byte", f"{ev['bits_per_byte']:.4f}"),
                 ("held-out tokens", f"{ev['tokens']:,}")]
    rows += [(f"stage {k}", f"{v:.1f} s") for k, v in stages.times.items()]
    rows.append(("wall", f"{metrics['wall_s']:.1f} s"))
    print(report_table(rows), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    # the tokenizer's Rust pool and torch's CPU threads follow --workers (set before import)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.workers))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    import transformers
    from demo import checkpoint, trainer

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(max(1, args.workers))
    log, stages = Log(), Stages()
    stop = {"asked": False}

    def on_signal(signum, frame):
        stop["asked"] = True
        log(f"signal {signum}: stopping after this step, the checkpoint follows")
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    saved, saved_tensors = (checkpoint.read_checkpoint(args.resume) if args.resume
                            else (None, None))
    hp = hyperparameters(args, saved["hp"] if saved else None)
    tiny = hp["preset"] == "tiny"
    minutes = args.minutes if args.minutes is not None else (1.0 if tiny else 9.5)
    reserve = args.reserve if args.reserve is not None else (10.0 if tiny else 30.0)
    stop_at = T_START + 60 * minutes - reserve
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp_dtype = torch.bfloat16 if device.type == "cuda" else None   # CPU: plain fp32
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    log(f"{'resume from ' + args.resume if args.resume else 'new run'}: preset {hp['preset']}, "
        f"device {device}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"budget {minutes} min")

    data = prepare_data(args, hp, saved, log, stages)
    m = prepare_model(args, hp, saved, saved_tensors, data, device, amp_dtype, log, stages)
    del saved_tensors
    heldout_bytes = data.stats["heldout"]["bytes"]
    data.streams = None                        # host copies: the device holds the streams

    lc = trainer.LoopConfig(seq=hp["seq"], batch=hp["batch"], lr=hp["lr"],
                            min_lr_frac=hp["min_lr_frac"], warmup_steps=hp["warmup_steps"],
                            clip=hp["clip"], total_s=60 * hp["total_minutes"],
                            print_every_s=args.print_every, eval_every_s=args.eval_every,
                            eval_windows=hp["eval_windows"], eval_batch=hp["eval_batch"])
    if args.finish:
        trainer.fit_schedule(lc, m.st, stop_at, log)
    st = m.st
    tokens0, trained0 = st.tokens, st.trained_s
    finished = stages.run("train", trainer.train, m.model, m.opt, m.balancer, m.sampler,
                          m.streams["train"], m.streams["heldout"], st, lc, amp_dtype, stop_at,
                          lambda: stop["asked"], log)
    call_tok_s = (st.tokens - tokens0) / max(1e-9, st.trained_s - trained0)
    if args.finish and not finished:
        log(f"--finish: exporting at {st.trained_s / lc.total_s:.1%} of the schedule")
        finished = True

    ev = stages.run("evaluate", trainer.evaluate, m.model, m.streams["heldout"], hp["seq"],
                    hp["eval_batch"], amp_dtype)
    if ev is not None:
        ev["bits_per_byte"] = (ev["loss"] / math.log(2) * m.streams["heldout"].numel()
                               / heldout_bytes)
        st.history.append({"step": st.step, "heldout_loss": round(ev["loss"], 4),
                           "heldout_top1": round(ev["top1"], 4), "heldout_tokens": ev["tokens"],
                           "final": True})
    write_results(args, hp, data, m, lc, ev, finished, call_tok_s, device, log, stages)
    return 0


if __name__ == "__main__":
    sys.exit(main())
