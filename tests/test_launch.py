"""kdtree_numba/gpu/launch.py: kernel launches that skip numba's per-call host work.

Anywhere: the argument signature tells apart what numba types apart (scalar types, array
layouts) and sends what it cannot pack (host arrays) to numba.  On the GPU (marker ``gpu``):
the fast path computes what numba's path computes for CuPy arrays (contiguous and strided
views, whose layouts numba compiles differently), numba arrays and every scalar kind, a
kernel past 48 KiB of dynamic shared memory launches, and compat wraps every kernel."""
from __future__ import annotations

from types import SimpleNamespace

import os

import numpy as np
import pytest

from kdtree_numba.gpu.launch import _dim3, _signature


class _FakeCupy:
    """Stands in for cupy.ndarray off the GPU: what _signature reads."""

    def __init__(self, a):
        self.dtype, self.ndim = a.dtype, a.ndim
        self.flags = SimpleNamespace(c_contiguous=a.flags.c_contiguous,
                                     f_contiguous=a.flags.f_contiguous)


def _rt():
    return SimpleNamespace(cupy_ndarray=_FakeCupy, DeviceNDArray=type(None))


def test_signature_separates_scalar_kinds_and_cupy_layouts():
    rt = _rt()
    a = np.zeros((4, 6), np.float32)
    keys = {
        "int": _signature((1,), rt), "bool": _signature((True,), rt),
        "uint64 int": _signature((2 ** 63,), rt),
        "float": _signature((1.0,), rt), "f32": _signature((np.float32(1),), rt),
        "i32": _signature((np.int32(1),), rt), "np bool": _signature((np.bool_(True),), rt),
        "C": _signature((_FakeCupy(a),), rt), "strided": _signature((_FakeCupy(a[:, ::2]),), rt),
        "F": _signature((_FakeCupy(a.T),), rt),
        "f64": _signature((_FakeCupy(a.astype(np.float64)),), rt),
        "1d": _signature((_FakeCupy(a.ravel()),), rt),
    }
    assert len(set(keys.values())) == len(keys), keys
    assert _signature((1, 2.0), rt) == _signature((5, -3.5), rt)     # values do not matter
    assert _signature((-2 ** 63,), rt) == _signature((0,), rt)       # both int64 to numba


def test_signature_leaves_host_arrays_and_objects_to_numba():
    rt = _rt()
    assert _signature((np.zeros(3, np.float32),), rt) is None     # numba copies it over
    assert _signature(((1, 2),), rt) is None                        # a tuple
    assert _signature((object(),), rt) is None
    assert _signature((2 ** 64,), rt) is None                       # numba refuses it


SIGNATURE_SCRIPT = """
import itertools
from types import SimpleNamespace
import numpy as np
from numba.cuda.cudadrv.devicearray import DeviceNDArray
from numba.cuda.typing.typeof import Purpose, typeof
from kdtree_numba.gpu.launch import _signature
class Memory:
    device_ctypes_pointer = None
rt = SimpleNamespace(cupy_ndarray=None, DeviceNDArray=DeviceNDArray)
args = [DeviceNDArray(shape, strides, dtype, gpu_data=Memory())
        for dtype in (np.float32, np.uint16)
        for shape in [(4,), (1, 4), (4, 1), (3, 4), (1, 1), (2, 1, 3)]
        for strides in itertools.product([0, 2, 4, 8, 12, 16, 48], repeat=len(shape))]
args += [0, 2 ** 63 - 1, 2 ** 63, -2 ** 63, 1.5, True, np.float32(1), np.int32(1),
         np.uint8(1), np.bool_(True), np.float64(2)]
seen, checked = {}, 0
for a in args:
    t = typeof(a, Purpose.argument)
    k = _signature((a,), rt)
    assert k is not None, a
    if k in seen:
        assert seen[k] == t, (k, t, seen[k])
        checked += 1
    seen[k] = t
print("ok", len(args), len(seen), checked)
"""


@pytest.mark.compile_check(SIGNATURE_SCRIPT, timeout=300)
def test_equal_signatures_mean_equal_numba_types():
    """Real numba device arrays (no GPU needed to build one over a dummy pointer, but not
    the simulator's) of every stride pattern of small shapes, scalars of every kind: two
    arguments with one signature always get one numba type, so a kernel compiled for one is
    right for the other.  Stride 0 on a length-1 axis is where numba and numpy disagree on
    contiguity (the w[None] case, which once slowed every launch)."""
    from ptx_check import run_without_simulator
    out = run_without_simulator(SIGNATURE_SCRIPT, timeout=300)
    words = out.split()
    assert words[-4] == "ok" and int(words[-3]) > 900 and int(words[-1]) > 500, out


def test_dim3():
    assert _dim3(5) == (5, 1, 1)
    assert _dim3((2, np.int64(3))) == (2, 3, 1)
    with pytest.raises(ValueError):
        _dim3((1, 2, 3, 4))


_FAST = pytest.mark.skipif(os.environ.get("KDTREE_FAST_LAUNCH", "1") == "0",
                           reason="KDTREE_FAST_LAUNCH=0: numba's own launch path")


@pytest.mark.gpu
@_FAST
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
@_FAST
def test_gpu_fast_path_raises_the_shared_memory_limit():
    import cupy

    from kdtree_numba import compat

    @compat.kernel
    def through_shared(x, y, nfloats):
        buf = compat.cuda.shared.array(0, np.float32)
        i = compat.cuda.threadIdx.x
        at = i * (nfloats // 128) + nfloats // 128 - 1     # up to the far end of the buffer
        buf[at] = x[0, i]
        compat.cuda.syncthreads()
        y[i] = buf[at] + 1

    # three signatures of one compiled kernel (numba arrays of shape (1, n) and (m, n) differ
    # in contiguity flags, a CuPy array in class, yet all are one C-layout type), sizes going
    # up and down: no launch may lower the limit another signature relies on
    want = np.arange(128, dtype=np.float32) + 1
    rows = cupy.tile(cupy.arange(128, dtype=np.float32), (3, 1))
    row, two = compat.to_device(rows[:1]), compat.to_device(rows[:2])
    for src, nbytes in ((row, 64 * 1024), (two, 100 * 1024), (row, 64 * 1024),
                        (two, 100 * 1024), (rows, 200 * 1024), (row, 64 * 1024)):
        y = cupy.zeros(128, np.float32)
        through_shared[1, 128, 0, nbytes](src, y, nbytes // 4)
        np.testing.assert_array_equal(cupy.asnumpy(y), want)
    assert len(through_shared._compiled) == 3
    assert len({int(c.cufunc.handle) for c in through_shared._compiled.values()}) == 1


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


@pytest.mark.gpu
def test_gpu_small_grids_print_no_low_occupancy_hint():
    """compat's job 6: a one-block launch through numba's own dispatcher (the first call of a
    kernel compiles there) raises no NumbaPerformanceWarning."""
    import warnings

    from numba.core.errors import NumbaPerformanceWarning

    from kdtree_numba import compat
    assert os.environ.get("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS") == "0"

    @compat.cuda.jit
    def plus_one(y):
        y[compat.cuda.threadIdx.x] += 1

    y = compat.cuda.to_device(np.zeros(32, np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumbaPerformanceWarning)
        plus_one[1, 32](y)
    np.testing.assert_array_equal(y.copy_to_host(), np.ones(32, np.float32))
