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

``kimi-k2-slice`` (:data:`KIMI_K2_SLICE`) is Kimi-K2 as it ships: the same widths with all 384
routed experts, kept as int4-group (W4A16, group 32: ``experts="int4"``) like the checkpoint's;
384 bf16 experts would be 33.8 GB a layer.  Its experts are drawn as packed words directly
(:func:`random_int4_experts`: a hash of each word's index, never a float per weight and never
a wide copy), in seconds on the device: 9.5 GB a layer.
"""
from __future__ import annotations

from typing import Iterator

import ml_dtypes
import numpy as np

from formats.int4_group import Int4GroupWeight
from kdtree_numba.backends import bf16_bits, make_backend  # noqa: F401 (re-exported)
from kdtree_numba.bundle import QUANTIZABLE, init_spec
from kdtree_numba.config import ModelConfig, weight_shapes
from kdtree_numba.model import Model

from kdtree_numba.layers.workspace import Int4Experts

__all__ = ["KIMI_SLICE", "kimi_slice_config", "KIMI_K2_SLICE", "kimi_k2_slice_config",
           "bf16_bits", "random_device_weights", "random_int4_experts", "random_model",
           "DEVICE_DTYPES", "EXPERT_FORMATS"]

DEVICE_DTYPES = ("bfloat16", "float32")
EXPERT_FORMATS = ("same", "int4")      # the routed experts: the dtype of the rest, or int4-group
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


# Kimi-K2 as it ships (issue 39): all 384 routed experts, which a tree verify fans out over
# (17 nodes touch ~116 of them under uniform routing); run with int4 experts (random_model's
# experts="int4"), as the checkpoint stores them
KIMI_K2_SLICE = dict(KIMI_SLICE, n_routed_experts=384)


def kimi_k2_slice_config(**overrides) -> ModelConfig:
    """The ``kimi-k2-slice`` config (:data:`KIMI_K2_SLICE`), fields replaced by ``overrides``."""
    return ModelConfig(**dict(KIMI_K2_SLICE, **overrides))


# q uniform on [-7, 7] but 0 twice as likely (the nibble -8 folded onto 0, so the weights are
# symmetric): variance 2 * (1 + 4 + ... + 49) / 16 = 17.5
_Q_STD = float(np.sqrt(17.5))


def _hash32(xp, i, seed: int):
    """murmur3's 32-bit finaliser of ``i + seed * golden``: well-mixed uint32 bits of an index,
    the same in NumPy and CuPy (uint32 arithmetic wraps in both)."""
    h = i.astype(np.uint32) + np.uint32((seed * 0x9E3779B9) & 0xFFFFFFFF)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


def random_int4_experts(xp, shape, std: float, seed: int, group_size: int = 32,
                        chunk: int = CHUNK):
    """Random ``[E, N, K]`` int4-group experts of about ``std``'s spread, drawn by ``xp`` as
    packed words (never a value per weight): each word's 8 nibbles are hash bits (a nibble -8
    becomes 0, so q is symmetric on [-7, 7], std ~4.18), each group's scale ``std / 4.18 *
    U[0.75, 1.25]`` rounded to bf16.  CuPy gives :class:`Int4Experts` on the device (what the
    numba backend keeps), NumPy an :class:`Int4GroupWeight` (what a bundle reader gives).
    ``chunk``: words (and scales) hashed at once."""
    e, n, k = (int(v) for v in shape)
    if k % 8 or k % group_size:
        raise ValueError(f"int4 experts of shape {shape}: K must be a multiple of 8 and of "
                         f"the group size {group_size}")
    words = xp.empty(e * n * k // 8, np.uint32)
    for start in range(0, words.size, chunk):
        w = _hash32(xp, xp.arange(start, min(words.size, start + chunk), dtype=np.uint32),
                    seed)
        low_bits_set = ((w & np.uint32(0x77777777)) + np.uint32(0x77777777)) & \
            np.uint32(0x88888888)               # bit 3 of a nibble: its low 3 bits are not 0
        words[start:start + w.size] = w ^ (w & np.uint32(0x88888888) & ~low_bits_set)
        del w, low_bits_set
    scale = xp.empty(e * n * k // group_size, np.uint16)
    step = np.float32(std / _Q_STD)
    for start in range(0, scale.size, chunk):
        u = _hash32(xp, xp.arange(start, min(scale.size, start + chunk), dtype=np.uint32),
                    seed + 1) >> np.uint32(8)
        jitter = u.astype(np.float32) * np.float32(0.5 / (1 << 24)) + np.float32(0.75)
        scale[start:start + u.size] = bf16_bits(xp, jitter * step)
        del u, jitter
    words, scale = words.reshape(e, n, k // 8), scale.reshape(e, n, k // group_size)
    if xp is np:
        return Int4GroupWeight(words.view(np.uint8), scale.view(ml_dtypes.bfloat16), group_size)
    return Int4Experts(words, scale, group_size)


def _draw(rng, spec, n: int):
    """n float32 values of one ``init_spec`` distribution."""
    kind, a, b = spec
    if kind == "uniform":
        return rng.random(n, dtype=np.float32) * np.float32(b - a) + np.float32(a)
    x = rng.standard_normal(n, dtype=np.float32) * np.float32(b)
    return x + np.float32(a) if a else x


def random_device_weights(config: ModelConfig, xp=np, seed: int = 0, dtype: str = "bfloat16",
                          shapes=None, chunk: int = CHUNK, experts: str = "same",
                          group_size: int = 32) -> Iterator[tuple[str, object]]:
    """Deterministic random weights of ``config`` (module docstring), (name, array) one tensor
    at a time in ``weight_shapes`` order, made by ``xp`` (NumPy, or CuPy: on the device).
    ``dtype``: "bfloat16" (NumPy: ml_dtypes bfloat16; CuPy: uint16 bits) or "float32".
    ``shapes``: name -> shape instead of the config's.  At most ``chunk`` values are drawn at
    once, so the float32 scratch stays small next to a 2 GB bf16 tensor.  ``experts``:
    "same" (the routed experts in ``dtype``) or "int4" (int4-group of ``group_size``,
    :func:`random_int4_experts`)."""
    if dtype not in DEVICE_DTYPES:
        raise ValueError(f"dtype must be one of {DEVICE_DTYPES}, got {dtype!r}")
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts must be one of {EXPERT_FORMATS}, got {experts!r}")
    rng = xp.random.default_rng(seed)
    for i, (name, shape) in enumerate((shapes or weight_shapes(config)).items()):
        spec = init_spec(name, shape)
        if experts == "int4" and name.endswith(QUANTIZABLE):
            yield name, random_int4_experts(xp, shape, spec[2], 2 * (seed * 1009 + i),
                                            group_size, chunk)
            continue
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
                 dtype: str = "bfloat16", kv_cache: str = "float32",
                 experts: str = "same") -> Model:
    """A :class:`Model` of ``config`` on ``backend`` with :func:`random_device_weights`: drawn
    on the device by CuPy on a GPU backend, else by NumPy on the host.  The unfused weights are
    dropped once the model holds its own layouts (its fused gate/up copies).  ``kv_cache``:
    the Model's latent-cache dtype; ``experts``: "same" or "int4" (int4-group routed
    experts, group 32)."""
    be = make_backend(backend)
    xp = be.xp if be.on_gpu else np
    weights = dict(random_device_weights(config, xp, seed, dtype, experts=experts))
    model = Model(config, weights, be, kv_cache=kv_cache)
    del weights
    return model
