"""compressed-tensors ``pack-quantized`` checkpoints (Kimi-K2's INT4 routed experts) for
``kdtr-import-hf``: the scheme read from config.json and checked, and each layer's experts
stacked into one int4-group weight without dequantising (formats/int4_group.py).

Supported: ``quant_method: "compressed-tensors"``, ``format: "pack-quantized"``, config groups
whose ``weights`` are ``num_bits: 4``, ``type: "int"``, ``symmetric: true``, ``strategy:
"group"``, an even ``group_size`` (Kimi-K2: 32), no activation ordering, no quantised
activations (W4A16).  Anything else is a :class:`BundleError` naming the field (the CLI prints
it as one line and exits 2, nothing written).  Which tensors are packed is read from the
tensors themselves (``<module>.weight_packed``), not by matching ``targets`` / ``ignore`` (their
``re:`` patterns come from an untrusted file and are not run); only the routed experts may be
packed.  Per expert linear of logical shape [out, in] the checkpoint holds ``weight_packed``
int32 [out, in / 8], ``weight_scale`` bf16 [out, in / g] and ``weight_shape`` [2]; every shape
is checked against the config before a byte is converted.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from formats.int4_group import (MAX_GROUP_SIZE, Int4GroupWeight, WeightFormatError,
                                check_group_size, check_layout, packed_from_offset8_words)
from kdtree_numba.bundle import BundleError

__all__ = ["PackQuantScheme", "read_scheme", "stack_int4_experts", "packed_module"]

QUANT_METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
# weights.<field>: the only value this version reads, and what the field means when it differs
_REQUIRED = {"num_bits": (4, "other bit widths"), "type": ("int", "float formats"),
             "symmetric": (True, "asymmetric schemes (zero points)"),
             "strategy": ("group", "other strategies")}
# weights.<field> that must be absent, null or false
_ABSENT = {"actorder": "activation ordering", "dynamic": "dynamic weight scales",
           "block_structure": "block strategies"}


@dataclasses.dataclass(frozen=True)
class PackQuantScheme:
    """The checked scheme: symmetric int4, one scale per ``group_size`` inputs."""
    group_size: int


def _bad(field: str, value: Any, why: str) -> BundleError:
    return BundleError(f"config.json: quantization_config.{field} = {value!r}: {why}")


def read_scheme(qc: Any) -> PackQuantScheme | None:
    """The pack-quantized scheme of a ``quantization_config``, or None when the checkpoint is
    not compressed-tensors (no config, or FP8 block scaling, read elsewhere).  An unsupported or
    malformed scheme raises :class:`BundleError` naming the field."""
    if not isinstance(qc, Mapping) or qc.get("quant_method") != QUANT_METHOD:
        return None
    fmt = qc.get("format")
    if fmt != FORMAT:
        raise _bad("format", fmt, f"kdtr-import-hf reads {FORMAT!r} only")
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _bad("config_groups", groups, "must be a non-empty object of schemes")
    ignore = qc.get("ignore")
    if ignore is not None and not (isinstance(ignore, list) and
                                   all(isinstance(v, str) for v in ignore)):
        raise _bad("ignore", ignore, "must be a list of strings")
    sizes = {}
    for name, group in groups.items():
        sizes[name] = _group_size(f"config_groups.{name}", group)
    if len(set(sizes.values())) != 1:
        raise _bad("config_groups", sizes, "the groups' group_size values differ; "
                   "kdtr-import-hf reads one group size a checkpoint")
    return PackQuantScheme(next(iter(sizes.values())))


def _group_size(where: str, group: Any) -> int:
    if not isinstance(group, Mapping):
        raise _bad(where, group, "must be an object")
    if group.get("format") not in (None, FORMAT):
        raise _bad(f"{where}.format", group.get("format"), f"kdtr-import-hf reads {FORMAT!r} "
                   f"only")
    targets = group.get("targets")
    if not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise _bad(f"{where}.targets", targets, "must be a list of strings")
    for act in ("input_activations", "output_activations"):
        if group.get(act) is not None:
            raise _bad(f"{where}.{act}", group.get(act), "quantised activations are not "
                       "supported (W4A16: weights only)")
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        raise _bad(f"{where}.weights", weights, "must be an object")
    for field, (want, what) in _REQUIRED.items():
        value = weights.get(field)
        if value != want or type(value) is not type(want):
            raise _bad(f"{where}.weights.{field}", value, f"{what} are not supported (want "
                       f"{want!r})")
    for field, what in _ABSENT.items():
        if weights.get(field) not in (None, False):
            raise _bad(f"{where}.weights.{field}", weights.get(field), f"{what} is not "
                       f"supported")
    g = weights.get("group_size")
    try:
        return check_group_size(g)   # the input dimension is checked per tensor
    except WeightFormatError:
        raise _bad(f"{where}.weights.group_size", g, f"must be an even integer in "
                   f"[2, {MAX_GROUP_SIZE}]") from None


def packed_module(ck, module: str) -> bool:
    """Whether the checkpoint stores ``module`` (an HF module path) pack-quantized."""
    return f"{module}.weight_packed" in ck


def _expert(ck, module: str, rows: int, cols: int, g: int):
    """``(words, scale)`` of one expert linear [rows, cols], every shape and dtype checked."""
    for extra, what in (("weight_zero_point", "asymmetric quantisation (a zero point)"),
                        ("weight_g_idx", "activation ordering (g_idx)"),
                        ("weight", "a float weight beside the packed one")):
        if f"{module}.{extra}" in ck:
            raise BundleError(f"tensor {module}.{extra}: {what} is not supported")
    words = ck.get(f"{module}.weight_packed")
    scale = ck.get(f"{module}.weight_scale")
    shape = ck.get(f"{module}.weight_shape")
    if words.dtype != np.int32 or words.shape != (rows, -(-cols // 8)):
        raise BundleError(f"tensor {module}.weight_packed: {words.dtype} {words.shape}, "
                          f"expected int32 {(rows, -(-cols // 8))} for a [{rows}, {cols}] "
                          f"weight (8 values a word)")
    if shape.dtype.kind not in "iu" or shape.shape != (2,) or \
            tuple(int(v) for v in shape) != (rows, cols):
        raise BundleError(f"tensor {module}.weight_shape: {shape.dtype} {shape.shape} "
                          f"{shape.reshape(-1)[:4].tolist()}, expected integers [{rows}, {cols}] "
                          f"(config.json's shape of this expert)")
    if scale.dtype != ml_dtypes.bfloat16:
        raise BundleError(f"tensor {module}.weight_scale: dtype {scale.dtype}; int4-group "
                          f"scales are bfloat16 (converting would round them)")
    try:
        check_layout((rows, cols), scale.shape, g, f"tensor {module}.weight_scale")
    except WeightFormatError as e:
        raise BundleError(str(e)) from None
    return words, scale


def stack_int4_experts(ck, prefix: str, which: str, shape,
                       scheme: PackQuantScheme) -> Int4GroupWeight:
    """A layer's routed experts as one int4-group weight: ``gate_up_proj`` [E, 2Im, D] (gate
    rows first) or ``down_proj`` [E, D, Im].  The output's packed bytes and scales are the only
    allocation: each expert's words are converted into their slice (``byte ^ 0x88``), so no
    expert is ever unpacked or dequantised."""
    E, rows, cols = (int(d) for d in shape)
    g = scheme.group_size
    if cols % g:
        raise BundleError(f"{prefix}mlp.experts.*.{which}: input dimension {cols} "
                          f"(config.json) is not a multiple of quantization_config's "
                          f"group_size {g}")
    packed = np.empty((E, rows, cols // 2), np.uint8)
    scales = np.empty((E, rows, cols // g), ml_dtypes.bfloat16)
    parts = (("gate_proj", 0), ("up_proj", rows // 2)) if which == "gate_up_proj" else \
        (("down_proj", 0),)
    part_rows = rows // len(parts)
    for e in range(E):
        for proj, r0 in parts:
            module = f"{prefix}mlp.experts.{e}.{proj}"
            words, scale = _expert(ck, module, part_rows, cols, g)
            packed_from_offset8_words(words, cols, out=packed[e, r0:r0 + part_rows])
            scales[e, r0:r0 + part_rows] = scale
    return Int4GroupWeight(packed, scales, g)
