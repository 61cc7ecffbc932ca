"""The peers a user would try first on the same target, timed by tools/bench_demo.py beside
the engine: transformers' ``generate()`` greedy, and its prompt-lookup decoding
(``prompt_lookup_num_tokens``: drafts copied from n-gram matches in the prompt, verified by
the model; no drafter model).

The target is exported with tools/bundle_to_hf.py (config.json, a float32 model.safetensors:
the bundle's bf16 weights widen exactly, and tokenizer.json) and loaded with
``AutoModelForCausalLM.from_pretrained`` in ``dtype`` (float32 by default, the dtype the
export holds; bfloat16 rounds activations too), with transformers' default attention, on
``device`` (cuda where the engine runs on the GPU and torch sees one, else cpu).  The
checkpoint's ``eos_token_id`` is cleared from the generation config, so every call makes
exactly the requested tokens, as the engine's ``generate`` without ``eos`` does.

Timing: each call's wall time, the device synchronised before and after (cuda); before the
timed prompts each peer runs on the warm-up prompts (its own warm-up: cuBLAS handles,
kernel selection), reported apart.  Greedy only: their tokens are compared with the engine's
T = 0 AR tokens and the agreement is reported, never fatal (a float32 forward in another
order of operations can flip a near-tie argmax).
"""
from __future__ import annotations

import contextlib
import io
import time

__all__ = ["PEERS", "available", "export_target", "HFPeer", "peer_device", "time_peer"]

PEERS = (("hf generate", {}), ("hf prompt lookup", {"prompt_lookup_num_tokens": 10}))


def available() -> str | None:
    """None when torch and transformers import, else why not (one line)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return f"transformers/torch not importable ({e.name}): pip install -e '.[train]'"
    return None


def export_target(bundle: str, out_dir: str) -> str:
    """tools/bundle_to_hf.py on ``bundle`` into ``out_dir``; returns its one-line report."""
    import bundle_to_hf
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bundle_to_hf.main([str(bundle), out_dir])
    return out.getvalue().strip()


class HFPeer:
    """One transformers model of the exported target (module docstring)."""

    def __init__(self, hf_dir: str, dtype: str = "float32", device: str = "cpu"):
        import torch
        import transformers
        transformers.utils.logging.set_verbosity_error()
        self.torch, self.device, self.dtype = torch, device, dtype
        t0 = time.perf_counter()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=getattr(torch, dtype)).to(device).eval()
        self.load_seconds = time.perf_counter() - t0
        self.model.generation_config.eos_token_id = None     # exactly n tokens, as ours
        self.info = dict(transformers=transformers.__version__, torch=torch.__version__,
                         dtype=dtype, device=device,
                         attention=getattr(self.model.config, "_attn_implementation", None),
                         load_seconds=self.load_seconds)

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def generate(self, ids, n: int, extra: dict) -> tuple[list[int], float]:
        """Greedy ``generate`` of ``n`` tokens after ``ids``: (new tokens, wall seconds)."""
        torch = self.torch
        x = torch.tensor([list(ids)], device=self.device)
        with torch.no_grad():
            self._sync()
            t0 = time.perf_counter()
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                      do_sample=False, pad_token_id=0, **extra)
            self._sync()
            seconds = time.perf_counter() - t0
        return out[0, x.shape[1]:].tolist(), seconds

    def close(self) -> None:
        del self.model
        if self.device.startswith("cuda"):
            self.torch.cuda.empty_cache()


def peer_device(engine_on_gpu: bool) -> str:
    """cuda where the engine runs on the GPU and torch sees one, else cpu."""
    import torch
    return "cuda" if engine_on_gpu and torch.cuda.is_available() else "cpu"


def time_peer(peer: HFPeer, prompts, n: int, extra: dict, warm: list[int], busy,
              stop=None) -> tuple[list[dict], dict]:
    """``peer`` over every prompt with ``extra`` generate arguments, after its warm-up on
    the prompts at indices ``warm``; returns one record per prompt (key, id, tokens,
    seconds, new_tokens; stopping early after a signal or past the time limit: ``stop``,
    bench_demo's Stop) and the timing facts (the warm-up's
    seconds, the GPU's busy share while timed: ``busy``, a bench_demo_timing.GpuBusy)."""
    t0 = time.perf_counter()
    for i in warm:
        peer.generate(prompts[i]["ids"], n, extra)
    warmup = dict(seconds=time.perf_counter() - t0, generate_calls=len(warm))
    out = []
    with busy.sampling():
        for rec in prompts:
            tokens, seconds = peer.generate(rec["ids"], n, extra)
            out.append(dict(key=rec["key"], id=rec["label"], tokens=tokens, seconds=seconds,
                            new_tokens=len(tokens)))
            if stop is not None and stop.expired():      # a signal or the time limit
                break
    return out, dict(warmup=warmup, gpu_busy=busy.share, gpu_busy_samples=busy.samples)
