"""kdtree_numba.gpu.tensorcore: the TF32 mma building blocks against NumPy oracles.

On the GPU (marker ``gpu``): a one-warp kernel loads a 16 x 8 x 8 tile into the documented
fragments and multiplies it with ``mma.sync`` (plain TF32, and 3xTF32); its output must equal
the product of the TF32-rounded inputs (plain) or the fp32 inputs (3xTF32) within the fp32
accumulation bound, and a wrong fragment layout fails by O(1).  Anywhere: the kernel compiles to
PTX for sm_90 and ptxas assembles it; the TF32 rounding oracle is checked on the simulator's
bit-level fallback.
"""
from __future__ import annotations

import numpy as np
import pytest
from ptx_check import HOPPER_PRELUDE


def tf32_round(x: np.ndarray) -> np.ndarray:
    """The oracle: float32 rounded to TF32 (10 mantissa bits), to nearest, ties away from 0."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    finite = ((bits >> 23) & 0xFF) != 0xFF
    rounded = np.where(finite, (bits + 0x1000) & 0xFFFFE000, bits)
    return rounded.astype(np.uint32).view(np.float32)


def test_tf32_oracle_on_known_values():
    one_ulp = np.float32(2.0 ** -10)            # TF32's ulp at 1.0
    x = np.array([1.0, 1.0 + one_ulp / 2, 1.0 + one_ulp / 4, -(1.0 + one_ulp / 2),
                  1.0 + 3 * one_ulp / 4, np.inf, 3.0], np.float32)
    want = np.array([1.0, 1.0 + one_ulp, 1.0, -(1.0 + one_ulp), 1.0 + one_ulp, np.inf, 3.0],
                    np.float32)
    assert tf32_round(x).tobytes() == want.tobytes()


def test_simulator_fallback_rounds_like_the_oracle(needs_kernels):
    from kdtree_numba import compat
    from kdtree_numba.gpu import tensorcore
    if not compat.SIMULATOR:
        pytest.skip("the bit-level fallback exists only under the simulator")
    x = np.random.default_rng(0).standard_normal(2000).astype(np.float32) * 100
    got = np.array([tensorcore.tf32_value(tensorcore.to_tf32(v)) for v in x], np.float32)
    assert got.tobytes() == tf32_round(x).tobytes()
    hi_lo = [tensorcore.split_tf32(v) for v in x[:200]]
    recon = np.array([np.float64(tensorcore.tf32_value(h)) + np.float64(tensorcore.tf32_value(lo))
                      for h, lo in hi_lo])
    assert np.all(np.abs(recon - x[:200]) <= 2.0 ** -21 * np.abs(x[:200]))


def test_simulator_fast_split_is_exact_with_a_tf32_high_part(needs_kernels):
    """split_tf32_fast: hi is a TF32 value within half a TF32 ulp of x (so |lo| <= 2^-11 |x|)
    and hi + lo == x exactly (lo keeps full precision; the tensor core truncates it)."""
    from kdtree_numba import compat
    from kdtree_numba.gpu import tensorcore
    if not compat.SIMULATOR:
        pytest.skip("the bit-level fallback exists only under the simulator")
    x = np.random.default_rng(2).standard_normal(2000).astype(np.float32) * 100
    x[:3] = [1.0 + 2.0 ** -11, -(1.0 + 2.0 ** -11), 0.0]
    for v in x:
        hi, lo = tensorcore.split_tf32_fast(v)
        assert int(hi) & 0x1FFF == 0
        h, low = np.uint32(hi).view(np.float32), np.uint32(lo).view(np.float32)
        assert np.float64(h) + np.float64(low) == np.float64(v)
        assert abs(np.float64(low)) <= 2.0 ** -11 * abs(np.float64(v))


def _tile_kernel():
    from kdtree_numba.compat import cuda, kernel
    from kdtree_numba.gpu.tensorcore import mma_tf32_m16n8k8, split_tf32, split_tf32_fast, to_tf32

    @kernel
    def tile(a, b, c, d, mode):
        """d = a @ b + c for a [16, 8], b [8, 8], c [16, 8], on one warp: plain TF32 (mode
        0), 3xTF32 with the cvt.rna split (1) or with split_tf32_fast (2)."""
        lane = cuda.threadIdx.x
        g = lane // 4
        t = lane % 4
        x0, x1, x2, x3 = a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4]
        y0, y1 = b[t, g], b[t + 4, g]
        c0, c1, c2, c3 = c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]
        if mode:
            if mode == 1:
                h0, l0, h1, l1 = split_tf32(x0) + split_tf32(x1)
                h2, l2, h3, l3 = split_tf32(x2) + split_tf32(x3)
                hy0, ly0, hy1, ly1 = split_tf32(y0) + split_tf32(y1)
            else:
                h0, l0, h1, l1 = split_tf32_fast(x0) + split_tf32_fast(x1)
                h2, l2, h3, l3 = split_tf32_fast(x2) + split_tf32_fast(x3)
                hy0, ly0, hy1, ly1 = split_tf32_fast(y0) + split_tf32_fast(y1)
            c0, c1, c2, c3 = mma_tf32_m16n8k8(l0, l1, l2, l3, hy0, hy1, c0, c1, c2, c3)
            c0, c1, c2, c3 = mma_tf32_m16n8k8(h0, h1, h2, h3, ly0, ly1, c0, c1, c2, c3)
            c0, c1, c2, c3 = mma_tf32_m16n8k8(h0, h1, h2, h3, hy0, hy1, c0, c1, c2, c3)
        else:
            c0, c1, c2, c3 = mma_tf32_m16n8k8(to_tf32(x0), to_tf32(x1), to_tf32(x2),
                                              to_tf32(x3), to_tf32(y0), to_tf32(y1),
                                              c0, c1, c2, c3)
        d[g, 2 * t] = c0
        d[g, 2 * t + 1] = c1
        d[g + 8, 2 * t] = c2
        d[g + 8, 2 * t + 1] = c3

    return tile


def _run_tile(a, b, c, mode):
    from numba import cuda
    d = cuda.device_array((16, 8), np.float32)
    _tile_kernel()[1, 32](cuda.to_device(a), cuda.to_device(b), cuda.to_device(c), d,
                          np.int64(mode))
    return d.copy_to_host()


def _inputs(seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((16, 8)).astype(np.float32)
    b = rng.standard_normal((8, 8)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    return a, b, c


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_gpu_tf32_tile_equals_the_product_of_rounded_inputs(seed):
    a, b, c = _inputs(seed)
    got = _run_tile(a, b, c, 0)
    ra, rb = tf32_round(a).astype(np.float64), tf32_round(b).astype(np.float64)
    want = ra @ rb + c
    # TF32 products are exact in fp32; 8 fp32 additions (in the hardware's order) remain.
    bound = 16 * 2.0 ** -24 * (np.abs(ra) @ np.abs(rb) + np.abs(c))
    assert np.all(np.abs(got - want) <= bound)
    # ... and the rounding really happened: the exact fp32 product is further off somewhere.
    exact = a.astype(np.float64) @ b.astype(np.float64) + c
    assert np.max(np.abs(got - exact)) > 10 * np.max(bound)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_gpu_3xtf32_tile_is_fp32_accurate(seed):
    a, b, c = _inputs(seed)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    # cvt.rna split: the dropped lo * lo terms are <= 2^-22 of each product; plus fp32
    # accumulation.  Fast split: lo enters truncated to TF32 (<= 2^-21 of x, in two of the
    # three products) and lo * lo is dropped (<= 2^-22).
    for mode, split_error in ((1, 2.0 ** -21), (2, 2.0 ** -19)):
        got = _run_tile(a, b, c, mode)
        bound = (split_error + 16 * 2.0 ** -24) * (np.abs(a) @ np.abs(b) + np.abs(c))
        assert np.all(np.abs(got - want) <= bound), mode


@pytest.mark.gpu
def test_gpu_to_tf32_rounds_like_the_oracle():
    from numba import cuda
    from kdtree_numba.compat import kernel
    from kdtree_numba.gpu.tensorcore import tf32_value, to_tf32

    @kernel
    def round_all(x, out):
        i = cuda.grid(1)
        if i < x.size:
            out[i] = tf32_value(to_tf32(x[i]))

    x = np.random.default_rng(1).standard_normal(1 << 16).astype(np.float32) * 1000
    x[:4] = [1.0 + 2.0 ** -11, -(1.0 + 2.0 ** -11), 1.0 + 2.0 ** -12, np.inf]
    out = cuda.device_array_like(x)
    round_all[(x.size + 255) // 256, 256](cuda.to_device(x), out)
    assert out.copy_to_host().tobytes() == tf32_round(x).tobytes()


PTX_SCRIPT = HOPPER_PRELUDE + """
sys.path.insert(0, "tests")
import test_tensorcore as tc
f2 = T.float32[:, ::1]
ptx, _ = cuda.compile_ptx(tc._tile_kernel().py_func, (f2, f2, f2, f2, T.int64), cc=(9, 0))
assert ptx.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") == 4, "mma count"
assert "cvt.rna.tf32.f32" in ptx, "no TF32 conversion"   # LLVM may merge the shared ones
ptxas(ptx)
print("assembled")
"""


@pytest.mark.compile_check(PTX_SCRIPT, timeout=300)
def test_tile_kernel_assembles_for_hopper():
    from ptx_check import run_without_simulator
    assert "assembled" in run_without_simulator(PTX_SCRIPT, timeout=300)


WGMMA_SCRIPT = HOPPER_PRELUDE + r"""
from numba.cuda import codegen
from numba.cuda.cudadrv import devices
from kdtree_numba.gpu.llvm import asm_statement
# what a launch on the H200 compiles for: numba-cuda adds the arch-specific "a" from 9.0 on
hopper = types.SimpleNamespace(device=types.SimpleNamespace(compute_capability=(9, 0)))
devices.get_context = lambda: hopper
assert codegen.CUDACodeLibrary._ensure_cc(None, None) == (9, 0, "a")
fence = asm_statement("wgmma.fence.sync.aligned;")
commit = asm_statement("wgmma.commit_group.sync.aligned;")
wait = asm_statement("wgmma.wait_group.sync.aligned 0;")

def kernel(a):
    fence()
    commit()
    wait()
    a[0] = 1.0

ptx, _ = cuda.compile_ptx(kernel, (T.float32[::1],), cc=(9, 0, "a"))
assert ".target sm_90a" in ptx, "no arch-specific target"
ptxas(ptx, arch="sm_90a")
print("assembled")
"""


@pytest.mark.compile_check(WGMMA_SCRIPT, timeout=300)
def test_hopper_launches_compile_for_sm_90a_where_wgmma_assembles():
    """wgmma (and setmaxnreg) exist only on the arch-specific target sm_90a.  numba-cuda 0.30
    compiles a kernel launched on a 9.0 device for compute_90a (its codegen appends "a"),
    and NVVM passes inline wgmma through to ptxas, which takes it there: the bf16 GEMM and
    attention can use warpgroup mma from numba (docs/ATTENTION.md, "How numba reaches the
    tensor cores").  A numba-cuda that stops doing so fails here, not in a kernel."""
    from ptx_check import run_without_simulator
    assert "assembled" in run_without_simulator(WGMMA_SCRIPT, timeout=300)
