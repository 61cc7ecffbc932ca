"""Random model weights built where the model runs: on a GPU with CuPy, in seconds and never on
the host; elsewhere with NumPy.  One code path; the array module is the switch.

Why: the ``kimi-slice`` benchmark target (:data:`KIMI_SLICE`: Kimi-K2's widths, 4 layers, 64
routed experts; 11.7 B parameters, 23.5 GB in bf16) would take minutes to draw with NumPy, as
much host memory and disk again as a bundle, and an HF export and import on top
(tools/bench_engine.py does that for the small sizes).  A benchmark only needs weights of the
right shapes, dtype and scale.

What the model gets is what a loaded bundle of that dtype gives it (``Model(config, weights,
backend)``, kdtree_numba/model.py): with CuPy a bf16 tensor is a uint16 array of bf16 bit
patterns on the device, the form ``Backend.asarray`` gives a bf16 host array and the kernels
read as bf16; with NumPy it is an ml_dtypes bfloat16 array, as a bf16 bundle's reader returns.
The model then widens its float32-only weights (router, its bias, kv_b_proj) exactly as for a
bundle (``Backend.weight``).  Values: drawn in float32 by ``bundle.init_spec``'s rules (the
scales of ``bundle.random_weights``: matrices N(0, (1.2/sqrt(fan_in))^2), norms U[0.5, 1.5],
router bias N(0, 0.3^2), embeddings N(0, 1), so routing and attention are not trivial), then
rounded to the nearest bf16 (ties to even, as ml_dtypes rounds).  The random stream is not
``random_weights``': a seed gives other numbers here than in a bundle.

``kimi-slice`` is not one of ``bundle.SIZES``: those are what ``kdtr-make-model --size``
offers, and it would write this one as a 24 GB bundle drawn on the host.
"""
from __future__ import annotations

from typing import Iterator

import ml_dtypes
import numpy as np

from kdtree_numba.backends import bf16_bits, make_backend  # noqa: F401 (re-exported)
from kdtree_numba.bundle import init_spec
from kdtree_numba.config import ModelConfig, weight_shapes
from kdtree_numba.model import Model

__all__ = ["KIMI_SLICE", "kimi_slice_config", "bf16_bits", "random_device_weights",
           "random_model", "DEVICE_DTYPES"]

DEVICE_DTYPES = ("bfloat16", "float32")
CHUNK = 1 << 26            # values drawn at once: 256 MiB of float32 scratch on the device

# Kimi-K2-Instruct's widths (the config.json of moonshotai/Kimi-K2-Instruct) with 4 layers
# (the first dense, as in Kimi-K2) and 64 routed experts instead of 61 layers and 384: issue
# 15's benchmark target.
KIMI_SLICE = dict(vocab_size=163840, hidden_size=7168, intermediate_size=18432,
                  moe_intermediate_size=2048, num_hidden_layers=4, num_attention_heads=64,
                  q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                  qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
                  n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
                  first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.827,
                  scoring_func="sigmoid", rms_norm_eps=1e-6, rope_theta=50000.0,
                  rope_scaling={"type": "yarn", "factor": 32.0,
                                "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                  rope_interleave=True, max_position_embeddings=131072,
                  tie_word_embeddings=False)


def kimi_slice_config(**overrides) -> ModelConfig:
    """The ``kimi-slice`` config (:data:`KIMI_SLICE`), fields replaced by ``overrides`` (the
    tests shrink its widths)."""
    return ModelConfig(**dict(KIMI_SLICE, **overrides))


def _draw(rng, spec, n: int):
    """n float32 values of one ``init_spec`` distribution."""
    kind, a, b = spec
    if kind == "uniform":
        return rng.random(n, dtype=np.float32) * np.float32(b - a) + np.float32(a)
    x = rng.standard_normal(n, dtype=np.float32) * np.float32(b)
    return x + np.float32(a) if a else x


def random_device_weights(config: ModelConfig, xp=np, seed: int = 0, dtype: str = "bfloat16",
                          shapes=None, chunk: int = CHUNK) -> Iterator[tuple[str, object]]:
    """Deterministic random weights of ``config`` (module docstring), (name, array) one tensor
    at a time in ``weight_shapes`` order, made by ``xp`` (NumPy, or CuPy: on the device).
    ``dtype``: "bfloat16" (NumPy: ml_dtypes bfloat16; CuPy: uint16 bits) or "float32".
    ``shapes``: name -> shape instead of the config's.  At most ``chunk`` values are drawn at
    once, so the float32 scratch stays small next to a 2 GB bf16 tensor."""
    if dtype not in DEVICE_DTYPES:
        raise ValueError(f"dtype must be one of {DEVICE_DTYPES}, got {dtype!r}")
    rng = xp.random.default_rng(seed)
    for name, shape in (shapes or weight_shapes(config)).items():
        spec = init_spec(name, shape)
        out = xp.empty(shape, np.uint16 if dtype == "bfloat16" else np.float32)
        flat = out.reshape(-1)
        for start in range(0, flat.size, chunk):
            n = min(chunk, flat.size - start)
            values = _draw(rng, spec, n)
            flat[start:start + n] = bf16_bits(xp, values) if dtype == "bfloat16" else values
            del values
        if dtype == "bfloat16" and xp is np:
            out = out.view(ml_dtypes.bfloat16)
        yield name, out


def random_model(config: ModelConfig, backend="auto", seed: int = 0,
                 dtype: str = "bfloat16", kv_cache: str = "float32") -> Model:
    """A :class:`Model` of ``config`` on ``backend`` with :func:`random_device_weights`: drawn
    on the device by CuPy on a GPU backend, else by NumPy on the host.  The unfused weights are
    dropped once the model holds its own layouts (its fused gate/up copies).  ``kv_cache``:
    the Model's latent-cache dtype."""
    be = make_backend(backend)
    xp = be.xp if be.on_gpu else np
    weights = dict(random_device_weights(config, xp, seed, dtype))
    model = Model(config, weights, be, kv_cache=kv_cache)
    del weights
    return model
