"""kdtree_numba/gpu/launch.py: kernel launches that skip numba's per-call host work.

Anywhere: the argument signature tells apart what numba types apart (scalar types, array
layouts) and sends what it cannot pack (host arrays) to numba.  On the GPU (marker ``gpu``):
the fast path computes what numba's path computes for CuPy arrays (contiguous and strided
views, whose layouts numba compiles differently), numba arrays and every scalar kind, a
kernel past 48 KiB of dynamic shared memory launches, and compat wraps every kernel."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kdtree_numba.gpu.launch import _dim3, _signature


class _FakeCupy:
    """Stands in for cupy.ndarray off the GPU: what _signature reads."""

    def __init__(self, a):
        self.dtype, self.ndim = a.dtype, a.ndim
        self.flags = SimpleNamespace(c_contiguous=a.flags.c_contiguous,
                                     f_contiguous=a.flags.f_contiguous)


class _FakeNumba:
    """Stands in for numba's DeviceNDArray (the simulator has none): what _signature reads."""

    def __init__(self, a):
        self.dtype, self.ndim, self.size, self.strides = a.dtype, a.ndim, a.size, a.strides
        self.flags = {"C_CONTIGUOUS": a.flags.c_contiguous, "F_CONTIGUOUS": a.flags.f_contiguous}


def _rt():
    return SimpleNamespace(cupy_ndarray=_FakeCupy, DeviceNDArray=_FakeNumba)


def test_signature_separates_what_numba_types_apart():
    rt = _rt()
    a = np.zeros((4, 6), np.float32)
    keys = {
        "int": _signature((1,), rt), "bool": _signature((True,), rt),
        "float": _signature((1.0,), rt), "f32": _signature((np.float32(1),), rt),
        "i32": _signature((np.int32(1),), rt),
        "C": _signature((_FakeCupy(a),), rt), "strided": _signature((_FakeCupy(a[:, ::2]),), rt),
        "F": _signature((_FakeCupy(a.T),), rt),
        "f64": _signature((_FakeCupy(a.astype(np.float64)),), rt),
        "1d": _signature((_FakeCupy(a.ravel()),), rt),
        "numba C": _signature((_FakeNumba(a),), rt),
        "numba A": _signature((_FakeNumba(a[:, ::2]),), rt),
        "numba broadcast": _signature((_FakeNumba(np.broadcast_to(a[:1], a.shape)),), rt),
    }
    assert len(set(keys.values())) == len(keys), keys
    assert _signature((1, 2.0), rt) == _signature((5, -3.5), rt)     # values do not matter


def test_signature_leaves_host_arrays_and_objects_to_numba():
    rt = _rt()
    assert _signature((np.zeros(3, np.float32),), rt) is None     # numba copies it over
    assert _signature(((1, 2),), rt) is None                        # a tuple
    assert _signature((object(),), rt) is None


def test_dim3():
    assert _dim3(5) == (5, 1, 1)
    assert _dim3((2, np.int64(3))) == (2, 3, 1)
    with pytest.raises(ValueError):
        _dim3((1, 2, 3, 4))


@pytest.mark.gpu
def test_gpu_fast_path_matches_numba_for_every_argument_kind():
    import cupy

    from kdtree_numba import compat
    from kdtree_numba.gpu.launch import FastKernel

    @compat.kernel
    def scale_rows(x, y, a, b, flip):
        i, j = compat.cuda.grid(2)
        if i < x.shape[0] and j < x.shape[1]:
            v = x[i, j] * a + b
            y[i, j] = -v if flip else v

    assert isinstance(scale_rows, FastKernel)
    rng = np.random.default_rng(0)
    host = rng.standard_normal((37, 50)).astype(np.float32)
    wide = cupy.asarray(rng.standard_normal((37, 100)).astype(np.float32))
    cases = [
        (cupy.asarray(host), host),                          # C layout
        (wide[:, ::2], cupy.asnumpy(wide)[:, ::2]),           # strided: numba's "A" layout
        (cupy.asfortranarray(cupy.asarray(host)), host),      # F-contiguous
        (compat.to_device(cupy.asarray(host)), host),         # a numba device array
    ]
    scalars = [(2, 1, False), (0.5, -1.0, True), (np.float32(3), np.float32(0.25), False),
               (np.int32(-2), np.int64(7), True)]
    # every case with two scalar kinds: 8 signatures, each compiled once
    for (x, want_x), (a, b, flip) in zip(cases * 2, scalars + scalars[::-1]):
        for _ in range(2):                 # the first launch goes through numba, then fast
            y = cupy.full(want_x.shape, np.nan, np.float32)
            scale_rows[(5, 7), (8, 8)](x, y, a, b, flip)
            want = want_x.astype(np.float64) * float(a) + float(b)
            np.testing.assert_allclose(cupy.asnumpy(y), -want if flip else want, rtol=1e-6,
                                       atol=1e-6)
    assert len(scale_rows._compiled) == 8
    assert all(hasattr(c, "packers") for c in scale_rows._compiled.values())   # all packed


@pytest.mark.gpu
def test_gpu_fast_path_raises_the_shared_memory_limit():
    import cupy

    from kdtree_numba import compat

    @compat.kernel
    def through_shared(x, y):
        buf = compat.cuda.shared.array(0, np.float32)
        i = compat.cuda.threadIdx.x
        buf[i * 16384 // 128] = x[i]            # touches the far end of 64 KiB
        compat.cuda.syncthreads()
        y[i] = buf[i * 16384 // 128] + 1

    x = cupy.arange(128, dtype=np.float32)
    for _ in range(2):
        y = cupy.zeros(128, np.float32)
        through_shared[1, 128, 0, 64 * 1024](x, y)
        np.testing.assert_array_equal(cupy.asnumpy(y), np.arange(128, dtype=np.float32) + 1)


@pytest.mark.gpu
def test_gpu_to_device_and_device_empty_share_cupys_memory():
    import cupy

    from kdtree_numba import compat
    x = cupy.arange(24, dtype=np.float32).reshape(4, 6)[:, 1::2]
    d = compat.to_device(x)
    assert d.shape == x.shape and d.strides == x.strides
    assert d.device_ctypes_pointer.value == x.data.ptr
    np.testing.assert_array_equal(d.copy_to_host(), cupy.asnumpy(x))
    # a C-contiguous array with stride 0 on a length-1 axis (``w[None]``: how the model holds
    # a dense layer's FFN as one expert) stays contiguous for numba, or its kernels would
    # leave the tensor cores and vector loads
    row = cupy.arange(4, dtype=np.float32)[None]
    assert row.flags.c_contiguous
    v = compat.to_device(row)
    assert v.is_c_contiguous() and v.strides == (16, 4)
    np.testing.assert_array_equal(v.copy_to_host(), [[0, 1, 2, 3]])
    e = compat.device_empty((3, 5), np.int32)
    assert e.strides == (20, 4) and e.shape == (3, 5)
    e.copy_to_device(np.arange(15, dtype=np.int32).reshape(3, 5))
    np.testing.assert_array_equal(e.copy_to_host(), np.arange(15).reshape(3, 5))
