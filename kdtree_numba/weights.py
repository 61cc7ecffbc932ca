"""Weight formats: what a bundle tensor is stored as, and what each backend's kernels take of it.

A weight is its data plus its **format**.  :data:`FORMATS` is the one table the model loads
through (``Model._load`` calls :func:`load_weight` for every tensor): each
:class:`WeightFormat` says which stored tensors are its own (``recognises``), what the model
keeps of one on a backend, prepared once at load (``prepare``: a device array in the layout
the kernels take, or the packed weight itself), and which of the model's uses each backend's
kernels take in it (``runs_on``).  A weight whose format a backend cannot run in that use is
refused at load with one line naming the tensor (:class:`WeightFormatUnsupported`, a
``BundleError``), never deep inside a forward.

* ``f32``, ``bf16``, ``f16``: float tensors (bf16 travels to a GPU as uint16 bits, the
  numba kernels' bf16 convention: kdtree_numba/layers/workspace.py); every use on both
  backends.
* ``int4-group``: packed int4 with a bf16 scale per group of inputs (formats/int4_group.py,
  Kimi-K2's routed experts); the reference backend's ops take it as it is and dequantise
  exactly (reference/layers/common.py); the numba backend keeps it as
  :class:`~kdtree_numba.layers.workspace.Int4Experts` (the packed bytes as uint32 words and
  the bf16 scales, on the device: never a wider copy) for its W4A16 expert kernels
  (kdtree_numba/layers/moe.py).  Random device weights (device_weights.py) may already be
  ``Int4Experts``.

Adding a format (docs/ARCHITECTURE.md, "Adding a weight format"): its module (layout,
pack/unpack, the float64 reference dequantiser, the bundle round trip), one
:class:`WeightFormat` entry here, and the kernels that take it, listed in ``runs_on``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from formats.int4_group import Int4GroupWeight
from kdtree_numba.bundle import BundleError
from kdtree_numba.layers.workspace import Int4Experts, int4_experts

__all__ = ["WeightFormat", "FORMATS", "USES", "format_of", "load_weight",
           "WeightFormatUnsupported"]

# what the model does with a weight (Model._load): the projections of attention and the
# dense or shared FFN, the routed experts, the embedding (and a tied lm_head), norm scales,
# and the weights that run in float32 whatever their storage (the router, kv_b_proj)
USES = ("linear", "experts", "embedding", "norm", "float32")
ALL_USES = frozenset(USES)


class WeightFormatUnsupported(BundleError):
    """A weight's format that the chosen backend's kernels do not take in that use."""


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """One storage format of a weight (module docstring)."""
    name: str
    recognises: Callable[[Any], bool]
    prepare: Callable[[Any, Any, Any], Any]      # (backend, tensor, dtype or None) -> kept
    runs_on: Mapping[str, frozenset]             # backend name -> uses its kernels take


def _dtype_name(tensor) -> str | None:
    dtype = getattr(tensor, "dtype", None)
    return None if dtype is None else np.dtype(dtype).name


def _float(names):
    return lambda tensor: _dtype_name(tensor) in names


def _as_backend_keeps_it(backend, tensor, dtype):
    return backend.weight(tensor, dtype)


def _packed_as_it_is(backend, tensor, dtype):
    # the reference ops dequantise an expert at a time (float64, exact): no wide copy
    if backend.name != "numba":
        if isinstance(tensor, Int4Experts):
            raise WeightFormatUnsupported("int4 experts drawn for the numba kernels "
                                          "(Int4Experts) run on the numba backend only")
        return tensor
    # the numba kernels read the packed bytes as words beside the scales: the bytes go up as
    # they are (a device-drawn Int4Experts is there already)
    if isinstance(tensor, Int4Experts):
        on_device = all(hasattr(a, "__cuda_array_interface__")
                        for a in (tensor.words, tensor.scale))
        return tensor if on_device or not backend.on_gpu else Int4Experts(
            backend.xp.asarray(tensor.words), backend.xp.asarray(tensor.scale),
            tensor.group_size)
    try:
        return int4_experts(tensor, backend.xp if backend.on_gpu else np)
    except ValueError as e:
        raise WeightFormatUnsupported(str(e)) from None


# a device array given to the model may already be bf16 bits (device_weights.py draws them)
FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("f32", _float(("float32", "float64")), _as_backend_keeps_it,
                 {"reference": ALL_USES, "numba": ALL_USES}),
    WeightFormat("bf16", _float(("bfloat16", "uint16")), _as_backend_keeps_it,
                 {"reference": ALL_USES, "numba": ALL_USES}),
    WeightFormat("f16", _float(("float16",)), _as_backend_keeps_it,
                 {"reference": ALL_USES, "numba": ALL_USES}),
    WeightFormat("int4-group",
                 lambda tensor: isinstance(tensor, (Int4GroupWeight, Int4Experts)),
                 _packed_as_it_is, {"reference": frozenset({"experts"}),
                                    "numba": frozenset({"experts"})}),
)}


def format_of(tensor) -> WeightFormat:
    """The registered format of a stored (or device) tensor; TypeError for none."""
    for fmt in FORMATS.values():
        if fmt.recognises(tensor):
            return fmt
    raise TypeError(f"no weight format stores a {type(tensor).__name__} of dtype "
                    f"{_dtype_name(tensor)}; known formats: {', '.join(FORMATS)}")


def load_weight(backend, name: str, tensor, use: str, dtype=None):
    """What the model keeps of bundle tensor ``name`` for ``use`` (:data:`USES`) on
    ``backend``: its format's preparation (``dtype``: widened to it first, for the float32
    uses).  A format the backend's kernels do not take in that use is refused here with one
    line (:class:`WeightFormatUnsupported`)."""
    if use not in USES:
        raise ValueError(f"weight use must be one of {USES}, got {use!r}")
    try:
        fmt = format_of(tensor)
    except TypeError as e:
        raise WeightFormatUnsupported(f"{name}: {e}") from None
    uses = fmt.runs_on.get(backend.name, frozenset())
    if use not in uses:
        where = ", ".join(f"{b}: {', '.join(sorted(u))}" for b, u in fmt.runs_on.items())
        raise WeightFormatUnsupported(
            f"{name} is {fmt.name}: the {backend.name} backend's kernels take no {fmt.name} "
            f"weight as {use} (where {fmt.name} runs: {where or 'nowhere yet'})")
    try:
        return fmt.prepare(backend, tensor, dtype)
    except WeightFormatUnsupported as e:     # a layout this backend's kernels do not take
        raise WeightFormatUnsupported(f"{name}: {e}") from None
