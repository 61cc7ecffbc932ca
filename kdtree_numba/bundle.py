"""Model bundles: a model's config and weights in one KDTR file.

Layout (docs/ENGINE.md has the full table)::

    /                       attrs  kdtree.bundle = "model" | "block_drafter" | "dflash_drafter",
                                   kdtree.version = 1
    /config                 attrs  the ModelConfig fields (None fields left out)
    /config/rope_scaling    attrs  the YaRN fields, present only with YaRN
    /model/embed_tokens     [V, D]          HF names, '.' -> '/', no '.weight' suffix
    /model/layers/{l}/self_attn/{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa,
                                 kv_a_layernorm, kv_b_proj, o_proj}
    /model/layers/{l}/mlp/{gate_proj, up_proj, down_proj}                      (dense layers)
    /model/layers/{l}/mlp/{gate [E,D], e_score_correction_bias [E],
                           experts/gate_up_proj [E,2Im,D], experts/down_proj [E,D,Im],
                           shared_experts/{gate_proj, up_proj, down_proj}}       (MoE layers)
    /model/norm, /lm_head   (lm_head absent when tie_word_embeddings)
    /block/...              the BlockDrafter's extra tensors (kdtree.bundle = "block_drafter")
    /tokenizer/json         optional: the HF ``tokenizers`` JSON as uint8 UTF-8 bytes (root attrs
                            tokenizer.format = "hf-tokenizers-json", tokenizer.bos_id)
    /dflash/...             a DFlash drafter's (kdtree.bundle = "dflash_drafter": no embedding
                            and no lm_head, it runs on its target's; :func:`dflash_shapes`)
    /dflash/vocab_rank      optional, int32 [V]: the target's token ids, most frequent first
                            (tools/draft_vocab.py; :func:`check_vocab_rank`)

Weights are float32, bfloat16 or float16; the routed experts (:data:`QUANTIZABLE`) may instead
be int4-group (formats/int4_group.py: a group of packed int4 and bf16 scales, read back as an
``Int4GroupWeight``).  ``read_bundle`` validates everything against the
config before the model sees it; any problem raises :class:`BundleError` naming the tensor.
A bundle may carry its tokenizer (:class:`BundleTokenizer`, read by
:func:`read_bundle_tokenizer`; kdtree_numba/text.py turns it into a codec), CRC-checked like
every tensor, so that a bundle is self-contained.  ``make_random_bundle`` writes
deterministic random models (tiny/small/medium) whose weights are O(0.1-1) (docs/ENGINE.md,
"Bundles"), so that routing and attention are not trivial.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
from typing import Any, Iterable, Iterator, Mapping

import ml_dtypes
import numpy as np

from formats import kdtr
from formats.console import UsageError
from formats.int4_group import (Int4GroupWeight, WeightFormatError, is_weight_group,
                                read_weight, stored_layout, write_weight)
from formats.paths import output_directory
from kdtree_numba.config import ModelConfig, weight_shapes

__all__ = ["BundleError", "read_bundle", "QUANTIZABLE", "open_bundle", "BundleWeights",
           "stores_packed_weights", "write_bundle",
           "read_bundle_config", "check_output_path", "SIZES",
           "size_config", "drafter_config", "init_spec", "random_weights", "make_random_bundle",
           "block_drafter_shapes", "BUNDLE_VERSION", "BundleTokenizer",
           "read_bundle_tokenizer", "TOKENIZER_DATASET", "TOKENIZER_FORMAT",
           "DFlashSpec", "DFLASH_BLOCK_SIZE", "DFLASH_SHARED", "default_target_layer_ids",
           "dflash_config", "dflash_shapes", "write_dflash_bundle", "read_dflash_spec",
           "open_dflash_bundle", "read_dflash_bundle", "DFLASH_VOCAB_RANK", "check_vocab_rank"]

BUNDLE_VERSION = 1
BUNDLE_KINDS = ("model", "block_drafter", "dflash_drafter")
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")
# The tensors that may be stored int4-group (formats/int4_group.py) instead of a float dtype:
# the routed experts, which Kimi-K2's checkpoints quantise; everything else stays float.
QUANTIZABLE = ("mlp/experts/gate_up_proj", "mlp/experts/down_proj")
# The tokenizer travels inside the bundle as the bytes of HF tokenizers' tokenizer.json (JSON:
# nothing is ever unpickled), under a group that is not part of the model's tensors.
TOKENIZER_DATASET = "tokenizer/json"
TOKENIZER_FORMAT = "hf-tokenizers-json"


@dataclasses.dataclass(frozen=True)
class BundleTokenizer:
    """A bundle's tokenizer: ``json``, the UTF-8 bytes of an HF ``tokenizers`` tokenizer.json,
    and ``bos_id``, the token id put in front of every text prompt (None: nothing; the demo
    target was trained on files that each began with ``<|endoftext|>``, id 0)."""
    json: bytes
    bos_id: int | None = None


class BundleError(ValueError):
    """A model bundle that is missing tensors, has wrong shapes or contradicts its config."""


# ----------------------------------------------------------------------------- configs

# YaRN with a small original context, so its ramp and its softmax factor both matter.
_TINY_YARN = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}

SIZES: dict[str, dict[str, Any]] = {
    # The tiny parity config (n_group > 1, a dense first layer), plus YaRN (docs/ENGINE.md).
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                 n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                 first_k_dense_replace=1, routed_scaling_factor=2.5, rope_theta=10000.0,
                 rope_scaling=_TINY_YARN, max_position_embeddings=512),
    "small": dict(vocab_size=1024, hidden_size=256, intermediate_size=512,
                  moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=8,
                  q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                  v_head_dim=32, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
                  n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                  rope_theta=10000.0, rope_scaling=dict(_TINY_YARN, factor=4.0,
                  original_max_position_embeddings=256), max_position_embeddings=2048),
    # Kimi-K2's attention geometry (r 512, dr 64, dn/dv 128) at a width a benchmark can afford.
    "medium": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                   moe_intermediate_size=256, num_hidden_layers=8, num_attention_heads=16,
                   q_lora_rank=512, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                   v_head_dim=128, n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=4,
                   n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.827,
                   rope_theta=50000.0, rope_scaling=dict(_TINY_YARN, factor=32.0,
                   original_max_position_embeddings=4096), max_position_embeddings=131072),
}


def size_config(size: str, **overrides) -> ModelConfig:
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    return ModelConfig(**dict(SIZES[size], **overrides))


def drafter_config(target: ModelConfig, **overrides) -> ModelConfig:
    """A one-layer dense drafter of the target's architecture and vocabulary."""
    base = dict(num_hidden_layers=1, first_k_dense_replace=1,
                hidden_size=max(32, target.hidden_size // 2),
                intermediate_size=max(32, target.intermediate_size // 2))
    return target.replace(**dict(base, **overrides))


# ----------------------------------------------------------------------------- random weights

def init_spec(name: str, shape: tuple[int, ...]) -> tuple[str, float, float]:
    """How a random tensor is drawn (docs/ENGINE.md, "Bundles"), so that every builder of random
    weights (:func:`random_weights` here, kdtree_numba/device_weights.py on the GPU) scales
    alike: ``("uniform", low, high)`` for norm weights (U[0.5, 1.5]), else ``("normal", 0,
    std)``: router bias 0.3, embeddings 1, matrices 1.2 / sqrt(fan_in) (0.15 at fan_in 64)."""
    leaf = name.rsplit("/", 1)[-1]
    if leaf.endswith("norm"):      # every *layernorm, model/norm, dflash/hidden_norm
        return "uniform", 0.5, 1.5
    if leaf == "e_score_correction_bias":
        return "normal", 0.0, 0.3
    if leaf == "embed_tokens":
        return "normal", 0.0, 1.0
    return "normal", 0.0, float(np.float32(1.2 / np.sqrt(shape[-1])))


def _init_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """O(0.1-1) weights by :func:`init_spec` (the draws are those of the first version, so
    every seed still gives the same bundle: the router bias drawn in float64, the rest in
    float32; an embedding's scale 1 changes no bit)."""
    kind, low, high = init_spec(name, shape)
    if kind == "uniform":
        return rng.uniform(low, high, shape).astype(np.float32)
    if name.endswith("e_score_correction_bias"):
        return (high * rng.standard_normal(shape)).astype(np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(high)


def random_weights(config: ModelConfig, seed: int = 0,
                   shapes: Mapping[str, tuple] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Deterministic random weights, (name, float32 array) one tensor at a time."""
    rng = np.random.default_rng(seed)
    for name, shape in (shapes or weight_shapes(config)).items():
        yield name, _init_tensor(rng, name, shape)


def block_drafter_shapes(config: ModelConfig, target_hidden: int) -> dict[str, tuple]:
    """The BlockDrafter's extra tensors: projection of the target's hidden state and the
    embedding of the MASK token."""
    return {"block/target_proj": (config.hidden_size, target_hidden),
            "block/mask_embedding": (config.hidden_size,)}


# ----------------------------------------------------------------------------- writing

def _cast(name: str, array: np.ndarray, dtype: str | None) -> np.ndarray:
    array = np.asarray(array)
    if dtype is None:
        dtype = array.dtype.name if array.dtype.name in WEIGHT_DTYPES else "float32"
    if dtype not in WEIGHT_DTYPES:
        raise BundleError(f"tensor {name}: dtype {dtype} is not one of {WEIGHT_DTYPES}")
    if dtype == "bfloat16":
        return array.astype(ml_dtypes.bfloat16, copy=False)
    return array.astype(dtype, copy=False)   # same dtype: no copy (a mapped source stays mapped)


def write_bundle(path, config: ModelConfig,
                 weights: Mapping[str, Any] | Iterable[tuple[str, Any]], *,
                 dtype: str | None = None, kind: str = "model",
                 extra_shapes: Mapping[str, tuple] | None = None,
                 extra_attrs: Mapping[str, Any] | None = None, progress=None,
                 tokenizer: BundleTokenizer | None = None,
                 shapes: Mapping[str, tuple] | None = None,
                 optional: Mapping[str, tuple] | None = None) -> None:
    """Write a bundle atomically, one tensor at a time (an iterable of (name, array) is
    consumed lazily, so peak memory is about one tensor).  Names and shapes are checked
    against the config as they arrive; a missing or extra tensor raises BundleError and leaves
    no file.  ``dtype``: float32/bfloat16/float16 for every tensor (default: as given).
    ``progress(done_bytes, total_bytes)`` is called after each tensor (the total counts
    ``dtype``'s bytes per element, float32's when it is None).  ``tokenizer``: stored as
    ``tokenizer/json`` with its root attributes (:class:`BundleTokenizer`).  ``shapes``: the
    tensors the bundle holds, name -> shape, instead of the config's ``weight_shapes`` (a
    DFlash drafter's: :func:`dflash_shapes`).  ``optional``: integer datasets that may be
    given besides them, name -> shape (stored int32; a DFlash drafter's token ranking)."""
    if kind not in BUNDLE_KINDS:
        raise BundleError(f"bundle kind must be one of {BUNDLE_KINDS}, got {kind!r}")
    expected = dict(weight_shapes(config) if shapes is None else shapes,
                    **(extra_shapes or {}))
    items = weights.items() if isinstance(weights, Mapping) else weights
    seen = set()
    itemsize = {"bfloat16": 2, "float16": 2}.get(dtype, 4)
    total = sum(int(np.prod(shape)) for shape in expected.values()) * itemsize
    done = 0
    with kdtr.File(os.fspath(path), "w") as f:
        f.attrs["kdtree.bundle"] = kind
        f.attrs["kdtree.version"] = BUNDLE_VERSION
        for key, value in (extra_attrs or {}).items():
            f.attrs[key] = value
        if tokenizer is not None:
            f.attrs["tokenizer.format"] = TOKENIZER_FORMAT
            if tokenizer.bos_id is not None:
                f.attrs["tokenizer.bos_id"] = int(tokenizer.bos_id)
            f.create_dataset(TOKENIZER_DATASET,
                             data=np.frombuffer(bytes(tokenizer.json), np.uint8))
        flat, rope_scaling = config.to_attrs()
        group = f.create_group("config")
        for key, value in flat.items():
            group.attrs[key] = value
        if rope_scaling is not None:
            sub = f.create_group("config/rope_scaling")
            for key, value in rope_scaling.items():
                sub.attrs[key] = value
        for name, array in items:
            if not isinstance(array, Int4GroupWeight):
                array = np.asarray(array)
            if name in seen:
                raise BundleError(f"tensor {name} given twice")
            seen.add(name)
            if name in (optional or {}):
                f.create_dataset(name, data=_index_array(name, array, optional[name]))
                continue
            _check_tensor(name, tuple(array.shape), expected, config)
            if isinstance(array, Int4GroupWeight):   # stored as it is, whatever ``dtype``
                _check_quantizable(name)
                parent, leaf = name.rsplit("/", 1)
                write_weight(f.require_group(parent), leaf, array)
            else:
                f.create_dataset(name, data=_cast(name, array, dtype))
            done = min(done + array.size * itemsize, total)
            del array   # else the loop variable keeps it alive while the next one is made
            if progress is not None:
                progress(done, total)
        missing = [n for n in expected if n not in seen]
        if missing:
            raise BundleError(f"missing tensor {missing[0]} (expected shape "
                              f"{expected[missing[0]]}; {len(missing)} missing in all)")


def _config_summary(cfg: ModelConfig) -> str:
    return (f"num_hidden_layers={cfg.num_hidden_layers}, first_k_dense_replace="
            f"{cfg.first_k_dense_replace}, q_lora_rank={cfg.q_lora_rank}, n_shared_experts="
            f"{cfg.n_shared_experts}, tie_word_embeddings={cfg.tie_word_embeddings}")


def _check_tensor(name: str, shape: tuple, expected: Mapping[str, tuple], cfg: ModelConfig):
    if name not in expected:
        raise BundleError(f"tensor {name} is not part of a model with this config "
                          f"({_config_summary(cfg)})")
    if shape != tuple(expected[name]):
        raise BundleError(f"tensor {name} has shape {shape}, but the config implies "
                          f"{tuple(expected[name])} (vocab_size={cfg.vocab_size}, hidden_size="
                          f"{cfg.hidden_size}, heads={cfg.num_attention_heads}, kv_lora_rank="
                          f"{cfg.kv_lora_rank}, n_routed_experts={cfg.n_routed_experts})")


def _check_index(name: str, array, shape: tuple) -> None:
    """An optional integer dataset (``optional`` of :func:`write_bundle` / :func:`open_bundle`)
    has an integer dtype and ``shape`` (metadata only), else BundleError naming it."""
    dtype = np.dtype(array.dtype)
    if dtype.kind not in "iu":
        raise BundleError(f"{name} has dtype {dtype}; it must hold integers")
    if tuple(array.shape) != tuple(shape):
        raise BundleError(f"{name} has shape {tuple(array.shape)}, expected {tuple(shape)}")


def _index_array(name: str, array, shape: tuple) -> np.ndarray:
    """:func:`_check_index`, then the values as int32 (BundleError where one does not fit)."""
    _check_index(name, array, shape)
    lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    if array.size and (array.min() < lo or array.max() > hi):
        raise BundleError(f"{name} holds values beyond int32")
    return np.asarray(array, np.int32)


def _check_quantizable(name: str) -> None:
    if not name.endswith(QUANTIZABLE):
        raise BundleError(f"tensor {name}: only the routed experts ({', '.join(QUANTIZABLE)}) "
                          f"may be int4-group; this tensor must be one of {WEIGHT_DTYPES}")


def check_output_path(path) -> None:
    """For the console scripts, before any work: a bundle about to be written is a ``.kdtr``
    name (``UsageError`` otherwise) in an existing folder (an OSError naming the folder, not
    the temporary file a write would make in it), and not a folder itself."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "a folder; give a file name ending in .kdtr",
                                path)
    root, ext = os.path.splitext(path)
    if ext.lower() != ".kdtr":
        raise UsageError(f"{path}: a bundle is a KDTR file and its name ends in .kdtr (e.g. "
                         f"{os.path.basename(root) or 'model'}.kdtr); kdtr-dump convert turns "
                         f"one into .h5")
    output_directory(path)


# ----------------------------------------------------------------------------- reading

def _open(path):
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, "no such bundle file", os.fspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "a folder, not a bundle file", os.fspath(path))
    try:
        return kdtr.File(os.fspath(path))
    except ValueError as e:
        raise BundleError(f"{os.fspath(path)}: not a readable KDTR file: {e}") from e


def _read_config(f, path) -> ModelConfig:
    if "config" not in f:
        raise BundleError(f"{path}: no 'config' group (not a model bundle)")
    try:
        rope = dict(f["config/rope_scaling"].attrs) if "config/rope_scaling" in f else None
        return ModelConfig.from_attrs(dict(f["config"].attrs), rope)
    except (TypeError, ValueError) as e:
        raise BundleError(f"{path}: bad config: {e}") from e


def read_bundle_config(path) -> tuple[ModelConfig, dict]:
    """(config, root attributes) of a bundle, without touching the weights."""
    with _open(path) as f:
        return _read_config(f, path), dict(f.attrs)


def stores_packed_weights(path) -> bool:
    """Whether a bundle keeps any tensor in a packed weight format (int4-group routed experts:
    Kimi-K2 as it ships), from its layout alone: nothing is read or checked."""
    found = []
    with _open(path) as f:
        f.visititems(lambda name, node: found.append(name) if is_weight_group(node) else None)
    return bool(found)


class BundleWeights(Mapping):
    """The validated tensors of an open bundle (:func:`open_bundle`), read when asked for.

    With ``verify`` (the default) ``weights[name]`` is a new array whose CRC32C was checked
    on the bytes as they were copied (``formats.kdtr.Dataset.read``): a damaged tensor raises
    ``KdtrError`` K056 naming the file and the tensor.  Without it, a read-only view of the
    memory map (nothing read until used, nothing checked).  The bytes have to be read once to
    reach a GPU or to be computed on anyway, so checking them as they are copied costs little
    (docs/BENCHMARKS.md, "Bundle load verification").  ``progress(done_bytes, total_bytes)`` is
    called after each tensor.  Read each tensor once: a reader that keeps the arrays it needs
    (``Model``) then holds one copy, and a GPU loader only one tensor at a time."""

    def __init__(self, path: str, datasets: Mapping[str, Any], verify: bool, progress=None):
        self.path, self.verify, self.progress = path, verify, progress
        self._datasets = dict(datasets)
        self.total_bytes = sum(self._nbytes(ds) for ds in self._datasets.values())
        self.done_bytes = 0

    @staticmethod
    def _nbytes(node) -> int:
        return stored_layout(node).nbytes if is_weight_group(node) else int(node.nbytes)

    def __getitem__(self, name: str) -> np.ndarray | Int4GroupWeight:
        """The tensor; an int4-group expert tensor (its layout checked at open) comes as an
        ``Int4GroupWeight``, packed (formats/int4_group.py)."""
        ds = self._datasets[name]
        if is_weight_group(ds):
            array = read_weight(ds, verify=self.verify, where=name)
        else:
            array = ds.read(verify=True) if self.verify else ds[...]
        self.done_bytes = min(self.done_bytes + self._nbytes(ds), self.total_bytes)
        if self.progress is not None:
            self.progress(self.done_bytes, self.total_bytes)
        return array

    def __iter__(self) -> Iterator[str]:
        return iter(self._datasets)

    def __contains__(self, name) -> bool:      # without reading it (Mapping's would)
        return name in self._datasets

    def __len__(self) -> int:
        return len(self._datasets)


@contextlib.contextmanager
def open_bundle(path, *, extra_shapes=None, verify: bool = True, progress=None,
                shapes=None, optional=None) -> Iterator[tuple[ModelConfig, dict, BundleWeights]]:
    """``(config, root attributes, weights)`` of a validated bundle, open for the ``with``
    block; ``weights`` is a :class:`BundleWeights` (read on access, CRC32C-checked unless
    ``verify=False``).  Every tensor the config implies must be present with its shape and a
    float dtype, and no other tensor may be present (``extra_shapes`` adds allowed ones, e.g.
    a BlockDrafter's; ``shapes`` replaces the config's ``weight_shapes``, as in
    :func:`write_bundle`; ``optional``: integer datasets that may be present, name -> shape);
    the first problem raises :class:`BundleError` naming the file and the tensor, before any
    weight is read."""
    path = os.fspath(path)
    with _open(path) as f:
        kind = f.attrs.get("kdtree.bundle", "model")
        if kind not in BUNDLE_KINDS:
            raise BundleError(f"{path}: kdtree.bundle attribute {kind!r} is not one of "
                              f"{BUNDLE_KINDS}")
        config = _read_config(f, path)
        expected = dict(weight_shapes(config) if shapes is None else shapes,
                        **(extra_shapes or {}))
        present: dict[str, Any] = {}

        weight_groups: set[str] = set()

        def collect(name, node):
            # the tokenizer's bytes are not a tensor (any other name under tokenizer/ is); a
            # weight format's group is one tensor, its members are not (visited after it)
            if is_weight_group(node):
                weight_groups.add(name)
                present[name] = node
            elif hasattr(node, "shape") and not name.startswith("config") and \
                    name != TOKENIZER_DATASET and name.rsplit("/", 1)[0] not in weight_groups:
                present[name] = node
        f.visititems(collect)

        def shape_of(name):
            node = present[name]
            if is_weight_group(node):
                _check_quantizable(name)
                return stored_layout(node, name).shape   # validated, nothing read
            return tuple(node.shape)
        try:
            for name in expected:   # in model order, so the first problem reported is the first
                if name not in present:
                    raise BundleError(f"missing tensor {name} (expected shape "
                                      f"{tuple(expected[name])} for {_config_summary(config)})")
                _check_tensor(name, shape_of(name), expected, config)
            ordered = {}
            for name in list(expected) + sorted(set(present) - set(expected)):
                ds = present[name]
                if name in (optional or {}) and not is_weight_group(ds):
                    _check_index(name, ds, optional[name])     # nothing read
                    ordered[name] = ds
                    continue
                _check_tensor(name, shape_of(name), expected, config)
                if not is_weight_group(ds) and np.dtype(ds.dtype).name not in WEIGHT_DTYPES:
                    raise BundleError(f"tensor {name} has dtype {ds.dtype}; weights must be one "
                                      f"of {WEIGHT_DTYPES}")
                ordered[name] = ds
        except (BundleError, WeightFormatError) as e:
            raise BundleError(f"{path}: {e}") from None
        yield config, dict(f.attrs), BundleWeights(path, ordered, verify, progress)


def read_bundle_tokenizer(path, *, verify: bool = True) -> BundleTokenizer | None:
    """The bundle's tokenizer (its JSON bytes CRC32C-checked unless ``verify=False``), or None
    when it carries none.  A tokenizer attribute without its dataset, or the reverse, an
    unknown format or a bad ``tokenizer.bos_id`` is a BundleError naming the file."""
    path = os.fspath(path)
    with _open(path) as f:
        fmt = f.attrs.get("tokenizer.format")
        if TOKENIZER_DATASET not in f:
            if fmt is not None:
                raise BundleError(f"{path}: tokenizer.format is set but {TOKENIZER_DATASET} "
                                  f"is missing")
            return None
        if fmt != TOKENIZER_FORMAT:
            raise BundleError(f"{path}: {TOKENIZER_DATASET} has tokenizer.format {fmt!r}; "
                              f"this version reads {TOKENIZER_FORMAT!r}")
        ds = f[TOKENIZER_DATASET]
        if not hasattr(ds, "shape") or np.dtype(ds.dtype) != np.uint8 or len(ds.shape) != 1:
            raise BundleError(f"{path}: {TOKENIZER_DATASET} must be a 1-D uint8 dataset "
                              f"(the tokenizer.json bytes)")
        data = ds.read(verify=True) if verify else ds[...]
        bos = f.attrs.get("tokenizer.bos_id")
        if bos is not None and (isinstance(bos, bool) or not isinstance(bos, (int, np.integer))
                                or bos < 0):
            raise BundleError(f"{path}: tokenizer.bos_id {bos!r} is not a token id")
        return BundleTokenizer(bytes(data), None if bos is None else int(bos))


def read_bundle(path, *, extra_shapes=None, verify: bool = True,
                progress=None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and every weight of a validated bundle (:func:`open_bundle`): verified copies,
    or with ``verify=False`` read-only memory-mapped views."""
    with open_bundle(path, extra_shapes=extra_shapes, verify=verify,
                     progress=progress) as (config, _, weights):
        return config, {name: weights[name] for name in weights}


# ----------------------------------------------------------------------------- random bundles

def make_random_bundle(path, size: str = "tiny", seed: int = 0, dtype: str = "float32", *,
                       role: str = "target", progress=None, **config_overrides) -> ModelConfig:
    """Write a deterministic random bundle and return its config.

    role "target": the ``size`` config; "drafter": a one-layer dense model with the target's
    vocabulary (for ModelDrafter); "block_drafter": that plus the BlockDrafter tensors;
    "dflash_drafter": a DFlash drafter for that target (:func:`dflash_config`, features of
    :func:`default_target_layer_ids`, B = 8; untrained).
    ``progress(done_bytes, total_bytes)``: as in :func:`write_bundle`.
    """
    config = size_config(size, **config_overrides)
    if role == "target":
        write_bundle(path, config, random_weights(config, seed), dtype=dtype, progress=progress)
        return config
    draft = drafter_config(config)
    if role == "drafter":
        write_bundle(path, draft, random_weights(draft, seed + 1), dtype=dtype,
                     progress=progress)
        return draft
    if role == "block_drafter":
        extra = block_drafter_shapes(draft, config.hidden_size)
        shapes = dict(weight_shapes(draft), **extra)
        write_bundle(path, draft, random_weights(draft, seed + 2, shapes), dtype=dtype,
                     kind="block_drafter", extra_shapes=extra,
                     extra_attrs={"block.target_hidden_size": config.hidden_size,
                                  "block.block_len": 7}, progress=progress)
        return draft
    if role == "dflash_drafter":
        draft = dflash_config(config)
        ids = default_target_layer_ids(config.num_hidden_layers)
        weights = random_weights(draft, seed + 3, dflash_shapes(draft, len(ids)))
        write_dflash_bundle(path, draft, weights, target_layer_ids=ids,
                            block_size=DFLASH_BLOCK_SIZE, target_hidden_size=config.hidden_size,
                            target_vocab_size=config.vocab_size,
                            target_num_layers=config.num_hidden_layers, dtype=dtype,
                            progress=progress)
        return draft
    raise ValueError(f"role must be target, drafter, block_drafter or dflash_drafter, got "
                     f"{role!r}")


# ----------------------------------------------------------------------------- DFlash drafters
# The spec of the drafter and its bundle: docs/ENGINE.md, "DFlash block drafter"; the
# drafter itself is kdtree_numba/dflash.py.

DFLASH_BLOCK_SIZE = 8
# the target's tensors a DFlash drafter runs on and never stores
DFLASH_SHARED = ("model/embed_tokens", "lm_head")
# optional: the target's token ids by frequency, most frequent first (tools/draft_vocab.py), so
# a drafter can rank only the N most frequent (kdtree_numba/dflash.py, ``draft_vocab``)
DFLASH_VOCAB_RANK = "dflash/vocab_rank"


def check_vocab_rank(rank, vocab: int) -> np.ndarray:
    """A token ranking as int32 [vocab], or BundleError saying what is wrong: it must be
    integers of shape [vocab], each id of 0..vocab - 1 exactly once."""
    rank = _index_array(DFLASH_VOCAB_RANK, np.asarray(rank), (vocab,))
    if rank.size and (rank.min() < 0 or rank.max() >= vocab):
        bad = rank[(rank < 0) | (rank >= vocab)][0]
        raise BundleError(f"{DFLASH_VOCAB_RANK} holds {bad}, not a token id of the "
                          f"vocabulary of {vocab} (0..{vocab - 1})")
    counts = np.bincount(rank, minlength=vocab)
    if (counts != 1).any():
        twice = int(np.argmax(counts > 1))
        raise BundleError(f"{DFLASH_VOCAB_RANK} is not a permutation of 0..{vocab - 1}: token "
                          f"{twice} appears {counts[twice]} times")
    return rank


@dataclasses.dataclass(frozen=True)
class DFlashSpec:
    """The root attributes of a ``dflash_drafter`` bundle (``dflash.<field>``): the target
    decoder layers whose outputs are the features (0-based), the block size B (the root and
    B - 1 MASK slots), and the target the drafter was trained for.  Inconsistent values (no
    layer, a layer outside the target, B < 2) raise :class:`BundleError`."""
    target_layer_ids: tuple
    block_size: int
    target_hidden_size: int
    target_vocab_size: int
    target_num_layers: int

    def __post_init__(self):
        ids = tuple(int(j) for j in np.asarray(self.target_layer_ids).reshape(-1))
        object.__setattr__(self, "target_layer_ids", ids)
        for name in ("block_size", "target_hidden_size", "target_vocab_size",
                     "target_num_layers"):
            object.__setattr__(self, name, int(getattr(self, name)))
        if not ids:
            raise BundleError("dflash.target_layer_ids is empty: a DFlash drafter reads at "
                              "least one target layer")
        if min(self.target_hidden_size, self.target_vocab_size, self.target_num_layers) < 1:
            raise BundleError(f"dflash target sizes must be >= 1, got {self}")
        bad = [j for j in ids if not 0 <= j < self.target_num_layers]
        if bad:
            raise BundleError(f"dflash.target_layer_ids {list(ids)}: layer {bad[0]} is not a "
                              f"layer of its {self.target_num_layers}-layer target")
        if self.block_size < 2:
            raise BundleError(f"dflash.block_size {self.block_size}: must be >= 2 (the root "
                              f"and at least one MASK slot)")

    def to_attrs(self) -> dict:
        return {f"dflash.{f.name}": (list(getattr(self, f.name)) if f.name == "target_layer_ids"
                                     else getattr(self, f.name))
                for f in dataclasses.fields(self)}

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any]) -> "DFlashSpec":
        values = {}
        for f in dataclasses.fields(cls):
            if f"dflash.{f.name}" not in attrs:
                raise BundleError(f"no dflash.{f.name} attribute (not a DFlash drafter "
                                  f"bundle?)")
            values[f.name] = attrs[f"dflash.{f.name}"]
        return cls(**values)

    def config_problem(self, config: ModelConfig) -> str | None:
        """Why the drafter's own ``config`` cannot go with this spec (it runs on the target's
        embedding and head, so it has the target's width and vocabulary), or None."""
        if config.hidden_size != self.target_hidden_size:
            return (f"the drafter's hidden_size {config.hidden_size} differs from "
                    f"dflash.target_hidden_size {self.target_hidden_size}")
        if config.vocab_size != self.target_vocab_size:
            return (f"the drafter's vocab_size {config.vocab_size} differs from "
                    f"dflash.target_vocab_size {self.target_vocab_size}")
        return None

    def target_problem(self, target: ModelConfig) -> str | None:
        """Why this drafter was not trained for ``target`` (the first mismatch: hidden size,
        vocabulary, a feature layer the target lacks, its number of layers), or None."""
        if target.hidden_size != self.target_hidden_size:
            return (f"a DFlash drafter for a target of hidden size {self.target_hidden_size}; "
                    f"this target's is {target.hidden_size}")
        if target.vocab_size != self.target_vocab_size:
            return (f"a DFlash drafter for a target vocabulary of {self.target_vocab_size}; "
                    f"this target's is {target.vocab_size}")
        n = target.num_hidden_layers
        beyond = [j for j in self.target_layer_ids if j >= n]
        if beyond:
            return (f"dflash.target_layer_ids {list(self.target_layer_ids)} read target layer "
                    f"{beyond[0]}, but this target has {n} layers (0..{n - 1})")
        if n != self.target_num_layers:
            return (f"a DFlash drafter for a {self.target_num_layers}-layer target; this "
                    f"target has {n} layers")
        return None


def default_target_layer_ids(num_layers: int, k: int = 3) -> tuple[int, ...]:
    """Every other target layer, ending at the last, at most ``k``: (1, 3, 5) of 6 layers
    (the demo's), (1, 3) of 4, (0, 2) of 3, (1,) of 2."""
    return tuple(sorted(j for j in range(num_layers - 1, -1, -2)[:k]))


def dflash_config(target: ModelConfig, **overrides) -> ModelConfig:
    """A DFlash drafter's config for ``target``: its width, vocabulary, context and attention
    geometry, 2 dense layers, a plain q_proj, NeoX-halves RoPE without scaling
    (docs/ENGINE.md, "DFlash block drafter")."""
    n = overrides.get("num_hidden_layers", 2)
    base = dict(num_hidden_layers=n, first_k_dense_replace=n, q_lora_rank=None,
                rope_interleave=False, rope_scaling=None)
    return target.replace(**dict(base, **overrides))


def dflash_shapes(config: ModelConfig, n_features: int) -> dict[str, tuple]:
    """Every tensor of a ``dflash_drafter`` bundle, name -> shape: the config's
    ``weight_shapes`` without the target's embedding and head (:data:`DFLASH_SHARED`), then
    ``dflash/fc`` [D, k D] (``n_features`` = k target layers), ``dflash/hidden_norm`` [D] and
    ``dflash/mask_embedding`` [D]."""
    D = config.hidden_size
    shapes = {n: s for n, s in weight_shapes(config).items() if n not in DFLASH_SHARED}
    shapes.update({"dflash/fc": (D, n_features * D), "dflash/hidden_norm": (D,),
                   "dflash/mask_embedding": (D,)})
    return shapes


def write_dflash_bundle(path, config: ModelConfig, weights, *, target_layer_ids,
                        block_size: int, target_hidden_size: int, target_vocab_size: int,
                        target_num_layers: int, dtype: str | None = None,
                        progress=None) -> DFlashSpec:
    """Write a ``dflash_drafter`` bundle (atomic, streamed as :func:`write_bundle`):
    ``weights`` (a mapping or (name, array) pairs) holds exactly :func:`dflash_shapes`, and
    optionally :data:`DFLASH_VOCAB_RANK` (checked: :func:`check_vocab_rank`);
    the :class:`DFlashSpec` goes to the root attributes.  Returns the spec."""
    spec = DFlashSpec(tuple(target_layer_ids), block_size, target_hidden_size,
                      target_vocab_size, target_num_layers)
    problem = spec.config_problem(config)
    if problem:
        raise BundleError(f"{os.fspath(path)}: {problem}")
    items = weights.items() if isinstance(weights, Mapping) else weights
    checked = ((name, check_vocab_rank(array, config.vocab_size)
                if name == DFLASH_VOCAB_RANK else array) for name, array in items)
    write_bundle(path, config, checked, dtype=dtype, kind="dflash_drafter",
                 shapes=dflash_shapes(config, len(spec.target_layer_ids)),
                 optional={DFLASH_VOCAB_RANK: (config.vocab_size,)},
                 extra_attrs=spec.to_attrs(), progress=progress)
    return spec


def read_dflash_spec(path) -> tuple[ModelConfig, DFlashSpec]:
    """(config, spec) of a ``dflash_drafter`` bundle, without touching the weights."""
    config, attrs = read_bundle_config(path)
    if attrs.get("kdtree.bundle") != "dflash_drafter":
        raise BundleError(f"{os.fspath(path)}: a {attrs.get('kdtree.bundle', 'model')!r} "
                          f"bundle, not a dflash_drafter")
    try:
        spec = DFlashSpec.from_attrs(attrs)
    except BundleError as e:
        raise BundleError(f"{os.fspath(path)}: {e}") from None
    problem = spec.config_problem(config)
    if problem:
        raise BundleError(f"{os.fspath(path)}: {problem}")
    return config, spec


@contextlib.contextmanager
def open_dflash_bundle(path, *, verify: bool = True, progress=None):
    """``(config, weights, spec)`` of a validated ``dflash_drafter`` bundle, open for the
    ``with`` block (weights read on access, as :func:`open_bundle`).  ``weights`` holds
    :data:`DFLASH_VOCAB_RANK` where the bundle has one, checked here (read once)."""
    config, spec = read_dflash_spec(path)
    with open_bundle(path, verify=verify, progress=progress,
                     shapes=dflash_shapes(config, len(spec.target_layer_ids)),
                     optional={DFLASH_VOCAB_RANK: (config.vocab_size,)}) \
            as (config, _, weights):
        if DFLASH_VOCAB_RANK in weights:
            try:
                check_vocab_rank(weights[DFLASH_VOCAB_RANK], config.vocab_size)
            except BundleError as e:
                raise BundleError(f"{os.fspath(path)}: {e}") from None
        yield config, weights, spec


def read_dflash_bundle(path, *, verify: bool = True) -> tuple[ModelConfig, dict, DFlashSpec]:
    """(config, every weight, :class:`DFlashSpec`) of a ``dflash_drafter`` bundle, validated
    (verified copies, or read-only mapped views with ``verify=False``)."""
    with open_dflash_bundle(path, verify=verify) as (config, weights, spec):
        return config, {name: weights[name] for name in weights}, spec
