"""Host side of every layer function: the :class:`Workspace` of reused scratch buffers, result
arrays (``out=``), and turning inputs into device arrays of the dtype and layout a kernel takes.

No kernels here.  The references take NumPy arrays as they come (reference/layers/common.py
widens every dtype to float64); the conventions for devices, streams and bf16 weights are in
the package docstring (kdtree_numba/layers/__init__.py) and docs/LAYERS.md.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from kdtree_numba import compat
from kdtree_numba.compat import SIMULATOR, to_device
from formats.int4_group import Int4GroupWeight
from kdtree_numba.layers.common import CHUNK

__all__ = ["Workspace", "workspace_buffer", "device_empty", "result_array", "weight_kind",
           "device_weight", "device_f32", "launch_1d", "load_kind_for", "kernel_weight",
           "placeholder", "Int4Experts", "int4_experts", "int4_load_kind"]


class Workspace:
    """Scratch device buffers kept between calls, keyed by (name, shape, dtype): with one
    workspace per step (and ``out=`` for the results) a warmed-up call allocates nothing, which
    is what a CUDA-graph capture needs.  Results never live in the workspace."""

    def __init__(self):
        self._buffers = {}

    def get(self, name, shape, dtype, stream=0):
        key = (name, tuple(int(s) for s in shape), np.dtype(dtype).str)
        buf = self._buffers.get(key)
        if buf is None:
            buf = device_empty(shape, dtype, stream)
            self._buffers[key] = buf
        return buf


def workspace_buffer(workspace, name, shape, dtype, stream):
    """Scratch buffer ``name`` of ``workspace``, or a new array when there is none."""
    if workspace is None:
        return device_empty(shape, dtype, stream)
    return workspace.get(name, shape, dtype, stream)


def device_empty(shape, dtype, stream=0):
    """An uninitialised device array (numba; compat.device_empty)."""
    return compat.device_empty(shape, dtype, stream)


def result_array(out, shape, dtype, stream=0):
    """The result array: ``out`` (a numba or CuPy device array of that shape and dtype) or a
    new one."""
    if out is None:
        return device_empty(shape, dtype, stream)
    if isinstance(out, np.ndarray):
        raise TypeError("out must be a device array (numba or CuPy), not a NumPy array")
    o = to_device(out, stream=stream)
    if tuple(o.shape) != tuple(int(v) for v in shape) or np.dtype(o.dtype) != np.dtype(dtype):
        raise ValueError(f"out must be {np.dtype(dtype)} {tuple(shape)}, got {o.dtype} {o.shape}")
    return o


def weight_kind(dtype) -> str:
    """'f32' or 'bf16' (bfloat16, or uint16 holding bf16 bits) for a weight dtype."""
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return "f32"
    if dtype.name == "bfloat16" or dtype == np.uint16:
        return "bf16"
    raise TypeError(f"weights must be float32 or bfloat16 (uint16 = bf16 bits), got {dtype}")


def device_weight(w, stream=0):
    """(device array: float32, or uint16 bf16 bits; kind 'f32' | 'bf16')."""
    kind = weight_kind(w.dtype)
    if kind == "bf16" and w.dtype != np.uint16:
        w = (np.ascontiguousarray(w) if isinstance(w, np.ndarray) else w).view(np.uint16)
    return to_device(w, stream=stream), kind


def device_f32(a, name, ndim, stream=0):
    """``a`` on the device, checked to be a float32 array of ``ndim`` dimensions."""
    if np.dtype(a.dtype) != np.float32 or len(a.shape) != ndim:
        raise TypeError(f"{name} must be a {ndim}-d float32 array, got {a.dtype} {a.shape}")
    return to_device(a, stream=stream)


def _is_c_contiguous(a) -> bool:
    if isinstance(a, np.ndarray):
        return a.flags.c_contiguous
    return bool(getattr(a, "is_c_contiguous", lambda: True)())


def _aligned16(a) -> bool:
    """Base address 16-byte aligned (always true in the simulator, which has no addresses)."""
    if SIMULATOR:
        return True
    return a.device_ctypes_pointer.value % 16 == 0 if a.size else True


def launch_1d(n, threads):
    """(blocks, threads) of a 1-d launch covering n items."""
    return max(1, -(-n // threads)), threads


def load_kind_for(kind: str, k: int, *arrays) -> str:
    """kind itself when 16-byte vector loads are legal for every array, else its scalar twin."""
    vector = k % CHUNK == 0 and all(_is_c_contiguous(a) and _aligned16(a) for a in arrays)
    return kind if vector else kind + "s"


def kernel_weight(wd, load_kind: str):
    """How a kernel of that kind takes the weight: bf16 vector rows as uint32 words."""
    return wd.view(np.uint32) if load_kind == "bf16" else wd


@functools.cache
def placeholder():
    """A 1-element device array passed where a kernel ignores an argument."""
    return to_device(np.zeros(1, np.float32))



@dataclasses.dataclass(frozen=True, eq=False)
class Int4Experts:
    """Stacked int4-group expert weights (formats/int4_group.py) as the W4A16 kernels take
    them: ``words`` uint32 ``[E, N, K/8]``, the packed bytes viewed as little-endian words
    (weight k of a row is nibble k % 8 of word k // 8, a two's complement q), ``scale``
    uint16 ``[E, N, K/g]`` (bf16 bits), ``group_size`` g.  Host (NumPy) or device (CuPy,
    numba) arrays; the bytes are the packed weight's, no wider copy exists (``nbytes``)."""
    words: Any
    scale: Any
    group_size: int

    @property
    def shape(self) -> tuple:
        """The logical ``[E, N, K]``."""
        e, n, kw = self.words.shape
        return (int(e), int(n), 8 * int(kw))

    @property
    def nbytes(self) -> int:
        return int(self.words.nbytes + self.scale.nbytes)

    def on_device(self, stream=0) -> "Int4Experts":
        """The same weight with both arrays on the device (zero-copy for device arrays)."""
        return Int4Experts(to_device(self.words, stream=stream),
                           to_device(self.scale, stream=stream), self.group_size)


def int4_experts(weight: Int4GroupWeight, xp=np) -> Int4Experts:
    """An ``[E, N, K]`` int4-group weight as :class:`Int4Experts` made by ``xp`` (NumPy or
    CuPy: the packed bytes copied up as they are).  ValueError (one line) for what the
    kernels do not take: K % 8 (a row in whole words) or a group size that is not a multiple
    of 8 dividing 32 or a multiple of 32."""
    if not isinstance(weight, Int4GroupWeight) or weight.ndim != 3:
        raise ValueError("int4 experts must be an [E, N, K] int4-group weight")
    k, g = weight.shape[-1], weight.group_size
    if k % 8:
        raise ValueError(f"the W4A16 kernels read whole 32-bit words: K = {k} is not a "
                         f"multiple of 8")
    if g % 8 or (g % 32 and 32 % g):
        raise ValueError(f"the W4A16 kernels take group sizes 8, 16 and multiples of 32, "
                         f"not {g}")
    # little-endian words: the nibble order of the bytes (formats/int4_group.py)
    words = np.ascontiguousarray(weight.packed).view("<u4").astype(np.uint32, copy=False)
    scale = np.ascontiguousarray(weight.scale).view(np.uint16)
    return Int4Experts(xp.asarray(words), xp.asarray(scale), g)


def int4_load_kind(k: int, x, weight: Int4Experts) -> str:
    """"i4" (16-byte chunks of 32 weights: K % 32 == 0, C-contiguous 16-byte aligned words
    and x) or else "i4s" (word loads, zero past the row end: the same products in the same
    order)."""
    vector = k % 32 == 0 and load_kind_for("f32", k, x, weight.words) == "f32"
    return "i4" if vector else "i4s"
