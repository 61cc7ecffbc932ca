"""moe_ffn(method="mma") with int4 experts: the grouped W4A16 MoE on bf16 tensor cores
(kdtree_numba/layers/moe_int4_mma.py; docs/LAYERS.md, "W4A16 on tensor cores").

Anywhere (CI): the simulator runs both W4A16 launches and the bf16 shared expert's, the warp's
mma emulated by the PTX ISA fragment layout (tests/test_layers_mma.py's emulation; on a GPU
the same tiny cases run on the real mma), against
reference.layers.moe_ffn (the int4 weights dequantised exactly) within the grouped MoE's bound
(tests/test_moe_mma.py's, the weights' float64 values exact): routings with experts of many
(> BM), one and zero tokens, K ragged against the stage, groups of 32 and of 128 across
stages, two warps along N with two m16 tiles, the work list's bits, a row alone its batch's;
the bound fails a kernel whose nibble order or scale is wrong; the selection (KDTREE_INT4_MMA)
and the refusals.  On the GPU (marker ``gpu``): Kimi-K2 widths at M = 1, 33, 65 against the
float64 reference and the CUDA-core W4A16 kernels, rows batch invariant, the work list's bits.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from ptx_check import HOPPER_PRELUDE

import reference.layers as ref
from formats.int4_group import Int4GroupWeight
from kdtree_numba.layers import mma as mm
from test_layers_gpu import cp, layers  # noqa: F401,F811 (the GPU test's fixtures)
from test_layers_mma import _warp_mma_emulation, bf16_bits
from test_moe_mma import _record_work_lists, _routing_many_one_zero, moe_mma_bound
from test_w4a16_gpu import D, E, TOP_K, expert_loader, kimi_experts, reference  # noqa: F401
from w4a16_cases import bench_layers

BF16 = ml_dtypes.bfloat16


@pytest.fixture
def emulated(needs_kernels, monkeypatch):
    """Under the simulator, the warp's mma emulated in both kernels: the W4A16 one and the
    bf16 one that runs the shared expert (mma.py's stage_compute).  On a GPU the tiny cases
    run as they are, on the real mma (and under compute-sanitizer)."""
    from kdtree_numba import compat
    from kdtree_numba.layers import moe_int4_mma
    if compat.SIMULATOR:
        emulation = _warp_mma_emulation()
        monkeypatch.setattr(mm, "mma_bf16_m16n8k16", emulation)
        monkeypatch.setattr(moe_int4_mma, "mma_bf16_m16n8k16", emulation)
    return moe_int4_mma


def _case(seed, m, d, n_experts, inter, idx, s_inter=0, group=32):
    """h, routing, int4 experts (q uniform on [-8, 7], bf16 scales U[0.02, 0.06]) and a bf16
    shared expert of width ``s_inter`` (0: none)."""
    rng = np.random.default_rng(seed)
    idx = np.asarray(idx, np.int32)
    h = rng.standard_normal((m, d)).astype(np.float32)
    wt = rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)

    def weight(shape):
        q = rng.integers(-8, 8, shape).astype(np.int8)
        s = rng.uniform(0.02, 0.06, shape[:-1] + (shape[-1] // group,)).astype(BF16)
        return Int4GroupWeight.from_values(q, s, group)
    shared = (None, None)
    if s_inter:
        shared = (bf16_bits(rng.standard_normal((2 * s_inter, d)) * 0.2),
                  bf16_bits(rng.standard_normal((d, s_inter)) * 0.2))
    return (h, idx, wt, weight((n_experts, 2 * inter, d)),
            weight((n_experts, d, inter)), *shared)


def _run(args, **kw):
    from kdtree_numba.layers import moe_ffn
    from kdtree_numba.layers.workspace import int4_experts
    h, idx, wt, gu, dn, sgu, sdn = args
    kw.setdefault("method", "mma")
    return moe_ffn(h, idx, wt, int4_experts(gu), int4_experts(dn), sgu, sdn,
                   **kw).copy_to_host()


def _check(args, **kw):
    """moe_ffn(method="mma") with the int4 experts against ref.moe_ffn (exact dequantisation)
    within moe_mma_bound."""
    h, idx, wt, gu, dn, sgu, sdn = args
    got = _run(args, **kw).astype(np.float64)
    shared = [None if a is None else a.view(BF16) for a in (sgu, sdn)]
    want = ref.moe_ffn(h, idx, wt, gu, dn, *shared).astype(np.float64)
    bound = moe_mma_bound(h, idx, wt, None, None, sgu, sdn,
                          expert=lambda e: (gu[e].dequantize(), dn[e].dequantize()))
    err = np.abs(got - want)
    assert np.all(err <= bound), np.max(err / bound)
    assert np.abs(want).max() > 0.1                  # not a vacuous comparison
    return got


def _config(**kw):
    from kdtree_numba.layers.moe_int4_mma import Int4MmaConfig
    return Int4MmaConfig(**{**dict(wm=1, wn=1, tm=1, tn=2, bk=64, stages=3), **kw})


# The K and group cases route to two experts only: every expert runs the same blocks (the
# simulator's cost is their threads), and experts of many, one and zero tokens are the first
# case's (and the batch-invariance test's)
TINY_CASES = [   # (name, M, D, I, Is, routing (None: many/one/zero), group, Int4MmaConfig)
    ("many/one/zero, 2 M tiles, shared", 20, 64, 32, 32, None, 32, {}),
    ("K ragged against the stage", 3, 160, 96, 0, [[0, 2], [2, 0], [0, 2]], 32, {}),
    ("groups of 128 across 4 stages round a 3-ring", 2, 256, 128, 0, [[1, 3], [1, 3]], 128,
     {}),
    ("two warps along N, tm 2, 2-ring", 20, 64, 64, 16, None, 32,
     dict(wn=2, tm=2, stages=2)),
]


# rings the bench's variants use (tools/bench_layers.py, INT4_MMA_TILES) at simulator sizes:
# 5 and 6 buffers wrapped (stages of one panel over K = 256: 8 stages), stages of 128 (the
# default's) over a ragged K, 4 n8 tiles a warp, dead x rows zeroed once
RING_CASES = [("6-ring of one-panel stages", dict(tn=4, bk=32, stages=6)),
              ("5-ring, dead rows zeroed once", dict(tn=4, bk=32, stages=5,
                                                     skip_dead_rows=True)),
              ("stages of 128, 4 n8 tiles", dict(tn=4, bk=128, stages=4)),
              ("dead rows zeroed once", dict(skip_dead_rows=True))]


_RING_BASE = {}


@pytest.mark.parametrize("name, cfg", RING_CASES, ids=[c[0] for c in RING_CASES])
def test_tiny_rings_and_dead_rows_give_the_default_bits(name, cfg, emulated):
    """Each variant ring within the bound and bit for bit the 3-ring of stages of 64 (every
    output one chain in K order, whatever the tile and ring; a live row never skipped):
    experts of 3 and 1 tokens (13 and 15 dead rows of 16), K = 224 (7 stages of one panel:
    both rings wrap)."""
    args = _case(31, 3, 224, 3, 32, [[0, 2], [2, 0], [2, 0]])
    if "base" not in _RING_BASE:
        _RING_BASE["base"] = _check(args, configs=_config()).tobytes()
    assert _check(args, configs=_config(**cfg)).tobytes() == _RING_BASE["base"]


@pytest.mark.parametrize("name, m, d, inter, s_inter, routing, group, cfg", [
    # "many/one/zero, 2 M tiles, shared": the batch-invariance test's full grid (below) runs
    # this check (the same shapes, routing, group and config; another seed), in CI
    pytest.param(*c, marks=pytest.mark.slow) if c is TINY_CASES[0] else c for c in TINY_CASES],
                         ids=[c[0] for c in TINY_CASES])
def test_tiny_w4a16_moe_within_the_bound(name, m, d, inter, s_inter, routing, group, cfg,
                                         emulated):
    idx = _routing_many_one_zero(m) if routing is None else routing
    _check(_case(m + d, m, d, 5, inter, idx, s_inter, group), configs=_config(**cfg))


def test_tiny_rows_are_batch_invariant_and_the_work_list_gives_the_grid_bits(
        emulated, monkeypatch):
    """A token's row alone gives its batch's bits (one chain per output in K order, the same
    in every tile); the work list (KDTREE_MOE_WORK_LIST=1) gives the full grid's bits (an
    expert of 20 tokens in two 16-row tiles, one of one, one of none, the shared expert)."""
    args = _case(5, 20, 64, 5, 32, _routing_many_one_zero(20), 32)
    lists = _record_work_lists(monkeypatch, "grouped_int4_mma")
    monkeypatch.setenv("KDTREE_MOE_WORK_LIST", "0")
    full = _check(args, configs=_config())
    monkeypatch.setenv("KDTREE_MOE_WORK_LIST", "1")
    listed = _run(args, configs=_config())
    assert lists[0] is None and int(lists[1][2].copy_to_host()[0]) == 2 + 1 + 1 + 1
    assert listed.tobytes() == full.astype(np.float32).tobytes()
    h, idx, wt = args[:3]
    one = _run((h[7:8], idx[7:8], wt[7:8], *args[3:]), configs=_config())
    assert one.tobytes() == full[7:8].astype(np.float32).tobytes()


def test_tiny_dense_int4_ffn_runs_as_one_expert(emulated):
    """A dense FFN with int4 weights (expert_idx, weight None; one expert, no shared one)
    under "mma": its routing filled on the device, the one-expert W4A16 launches, within the
    bound of the reference's dense FFN."""
    from kdtree_numba.layers import moe_ffn
    from kdtree_numba.layers.workspace import int4_experts
    h, idx, wt, gu, dn, _, _ = _case(9, 18, 64, 1, 32, np.zeros((18, 1)), 0)
    got = moe_ffn(h, None, None, int4_experts(gu), int4_experts(dn), method="mma",
                  configs=_config()).copy_to_host()
    want = ref.moe_ffn(h, None, None, gu, dn)
    bound = moe_mma_bound(h, idx, np.ones_like(wt), None, None,
                          expert=lambda e: (gu[e].dequantize(), dn[e].dequantize()))
    assert np.all(np.abs(got - want) <= bound) and np.abs(want).max() > 0.1


def _swapped_halves(pair):
    def swapped(word, shifted):
        v = int(pair(word, shifted))
        return np.uint32((v >> 16) | ((v & 0xFFFF) << 16))
    return swapped


@pytest.mark.parametrize("fault", ["nibble order", "scale"])
def test_simulated_bound_has_teeth(fault, emulated, monkeypatch):
    """The bound fails a kernel that swaps the two nibbles of a byte (the even weight in the
    high half) or doubles the group scale (simulator only: the faults are Python)."""
    from kdtree_numba import compat
    if not compat.SIMULATOR:
        pytest.skip("the faults are patched into the simulator's Python kernel")
    if fault == "nibble order":
        monkeypatch.setattr(emulated, "int4_pair1_bf16",
                            _swapped_halves(emulated.int4_pair1_bf16))
    else:
        real = emulated.bits_to_f32
        monkeypatch.setattr(emulated, "bits_to_f32", lambda b: real(b) * np.float32(2.0))
    with pytest.raises(AssertionError):
        _check(_case(3, 2, 64, 3, 32, [[0, 2], [1, 2]], 32), configs=_config())


class _Picked(Exception):
    pass


@pytest.mark.parametrize("method, m, switch, picked", [
    ("mma", 1, "0", "mma"), ("auto", 129, "0", "skinny"), ("auto", 129, "1", "skinny"),
    ("auto", 17, "1", "skinny"), ("auto", 2, "1", "skinny"), ("tensor-cores", 2, "0", "skinny"),
    ("tensor-cores", 2, "1", "mma"), ("tensor-cores", 129, "1", "mma"),
    ("skinny", 129, "1", "skinny")])
def test_which_methods_take_the_w4a16_tensor_core_kernels(method, m, switch, picked,
                                                          needs_kernels, monkeypatch):
    """"mma" always; "tensor-cores" at every M unless KDTREE_INT4_MMA=0; never "auto" (not
    by M either: the kernel's bf16 activations would part a verify's rows from a decode's)
    nor "skinny"."""
    from kdtree_numba.layers import moe as moe_module

    def kernels(name):
        def launch(*args, **kw):
            raise _Picked(name)
        return launch
    monkeypatch.setattr(moe_module, "grouped_int4_mma", kernels("mma"))
    monkeypatch.setattr(moe_module, "_experts_skinny", kernels("skinny"))
    monkeypatch.setenv("KDTREE_INT4_MMA", switch)
    args = _case(6, m, 32, 3, 32, np.random.default_rng(6).integers(0, 3, (m, 1)), 0)
    with pytest.raises(_Picked, match=picked):
        _run(args, method=method)


def test_w4a16_mma_refuses_what_it_cannot_take(needs_kernels):
    """Groups of 16 split a 32-weight panel: "mma" refuses them (one line); "tensor-cores"
    with the switch keeps them on the CUDA-core W4A16 kernels; a bad tile is refused."""
    args = _case(8, 2, 32, 3, 16, [[0, 1], [1, 2]], 0, group=16)
    with pytest.raises(ValueError, match="group sizes multiple of 32"):
        _run(args)
    with pytest.raises(ValueError, match="Int4MmaConfig"):
        _config(tn=1)
    with pytest.raises(TypeError, match="Int4MmaConfig"):
        _run(_case(8, 2, 32, 3, 32, [[0, 1], [1, 2]], 0), configs=mm.mma_tile(1))
    with pytest.raises(ValueError, match="group sizes that are multiples of 32"):
        from kdtree_numba.layers.moe_int4_mma import int4_mma_kernel
        int4_mma_kernel(_config(), True, False, 16)


# ------------------------------------------------------------------ GPU (Kimi-K2 widths)

def _kimi_routing(m, pool, seed):
    """Top-8 of ``pool`` of the 384 experts per token (sorted), weights U[0.05, 0.5]: at 33
    and 65 rows several experts hold many tokens and the float64 reference stays affordable;
    h standard normal."""
    rng = np.random.default_rng(seed)
    experts = rng.choice(E, pool, replace=False)
    idx = np.sort(np.stack([rng.choice(experts, TOP_K, replace=False) for _ in range(m)]),
                  axis=1).astype(np.int32)
    wt = rng.uniform(0.05, 0.5, (m, TOP_K)).astype(np.float32)
    return rng.standard_normal((m, D)).astype(np.float32), idx, wt


@pytest.mark.gpu
@pytest.mark.parametrize("m, pool", [(1, 384), (33, 24), (65, 24)])
def test_gpu_w4a16_mma_kimi_widths(cp, layers, kimi_experts, m, pool, monkeypatch):
    """Kimi widths (D 7168, I 2048, 384 int4 experts of group 32, a bf16 shared expert):
    within the grouped MoE's bound of the float64 reference, within both bounds of the
    CUDA-core W4A16 kernels' output, a row alone its batch's bits, the work list the full
    grid's bits."""
    h, idx, wt = _kimi_routing(m, pool, m + 1)
    gate_up, down, sgu, sdn = kimi_experts

    def run(rows=slice(None), method="mma"):
        return cp.asnumpy(cp.asarray(layers.moe_ffn(h[rows], idx[rows], wt[rows],
                                                    *kimi_experts, method=method)))
    monkeypatch.setenv("KDTREE_MOE_WORK_LIST", "0")
    got = run()
    expert = expert_loader(cp, gate_up, down)          # float64, each expert once
    want, cuda_bound = reference(cp, h, idx, wt, *kimi_experts, expert=expert)
    bound = moe_mma_bound(h, idx, wt, None, None, cp.asnumpy(sgu), cp.asnumpy(sdn),
                          expert=expert)
    err = np.abs(got - want)
    assert np.all(err <= bound), f"max err {err.max():.3g}, ratio {(err / bound).max():.3g}"
    assert np.abs(want).max() > 1e-2
    cuda_cores = run(method="skinny")
    assert np.all(np.abs(got - cuda_cores) <= bound + cuda_bound)
    assert np.array_equal(run(slice(m - 1, m))[0], got[-1])
    monkeypatch.setenv("KDTREE_MOE_WORK_LIST", "1")
    assert run().tobytes() == got.tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [t[0] for t in bench_layers().INT4_MMA_TILES])
def test_gpu_bench_tiles_give_the_picked_tiles_bits(cp, layers, kimi_experts, tile,
                                                    monkeypatch):
    """Kimi widths at 33 rows (several experts of many tokens, most of one or two): each
    tile tools/bench_layers.py times beside int4_mma_config's (INT4_MMA_TILES, work list
    on, as the bench runs them) gives the picked tile's bits.  Run it before the bench: a
    tile that faulted there would end its CUDA context."""
    from kdtree_numba.layers.moe_int4_mma import Int4MmaConfig
    h, idx, wt = _kimi_routing(33, 24, 34)
    kw = next(t[1] for t in bench_layers().INT4_MMA_TILES if t[0] == tile)
    monkeypatch.setenv("KDTREE_MOE_WORK_LIST", "1")

    def run(cfg=None):
        return cp.asnumpy(cp.asarray(layers.moe_ffn(h, idx, wt, *kimi_experts, method="mma",
                                                    configs=cfg)))
    assert run(Int4MmaConfig(**kw)).tobytes() == run().tobytes()


# ------------------------------------------------------------------ sm_90 PTX, any machine

PTX_SCRIPT = HOPPER_PRELUDE + r"""
import itertools
from kdtree_numba.layers.moe_int4_mma import int4_mma_config, int4_mma_kernel
MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"

f2, u2, i1 = T.float32[:, ::1], T.uint16[:, ::1], T.int32[::1]
configs = {int4_mma_config(m, 8, 384) for m in (1, 33, 65)}
configs |= {int4_mma_config(m, 1, 1) for m in (24, 40, 64)}   # 2-4 m16 tiles
for cfg, gate_up, work_list in itertools.product(sorted(configs, key=str), (True, False),
                                                 (False, True)):
    out = T.uint32[:, ::1] if gate_up else f2           # act as bf16 pairs, or y_slot
    sig = (u2,) + (i1,) * 7 + (T.uint32[:, :, ::1], T.uint16[:, :, ::1], out) + (T.int64,) * 5
    ptx, _ = cuda.compile_ptx(int4_mma_kernel(cfg, gate_up, work_list, 32).py_func, sig,
                              cc=(9, 0))
    log = ptxas(ptx)
    local = len(re.findall(r"(?:ld|st)\.local", ptx))
    regs = int(re.findall(r"Used (\d+) registers", log)[0])
    spill = sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log))
    print("kernel", cfg, "gate_up" if gate_up else "down", "work list" * work_list, "mma",
          ptx.count(MMA), "prmt", ptx.count("prmt.b32"), "regs", regs, "spill", spill,
          "local", local, flush=True)
    # a panel's mma and unpacking once (the panel loop), or once per panel (unrolled)
    assert ptx.count(MMA) in (2 * cfg.tm * cfg.tn, 2 * cfg.tm * cfg.tn * cfg.panels), "mma"
    assert ptx.count("fma.rn.bf16x2") == 4 * cfg.tn * ptx.count(MMA) // (2 * cfg.tm * cfg.tn)
    assert "cp.async.cg.shared.global" in ptx
    assert "cp.async.wait_group %d;" % (cfg.stages - 2) in ptx, "ring wait"
    assert local == 0 and spill == 0, "local memory"
# a group of 128 (the chain carried across panels and stages)
cfg = int4_mma_config(33, 8, 384)
sig = (u2,) + (i1,) * 7 + (T.uint32[:, :, ::1], T.uint16[:, :, ::1], f2) + (T.int64,) * 5
ptx, _ = cuda.compile_ptx(int4_mma_kernel(cfg, False, False, 128).py_func, sig, cc=(9, 0))
log = ptxas(ptx)
assert not re.findall(r"(?:ld|st)\.local", ptx) and "spill stores" not in log.replace(
    "0 bytes spill stores", ""), log
print("assembled")
"""


@pytest.mark.compile_check(PTX_SCRIPT, timeout=900)
def test_w4a16_mma_kernels_compile_to_hopper_ptx():
    """Both W4A16 kernels of every int4_mma_config tile (Kimi-K2's verify sizes, and the 32-
    to 64-row tiles) compile for sm_90: 2 tm tn mma and 4 tn bf16x2 FMAs (the unpacking) a
    panel, cp.async in a ring, no local memory, and ptxas assembles them without spills."""
    from ptx_check import run_without_simulator
    out = run_without_simulator(PTX_SCRIPT, timeout=900)
    assert "assembled" in out.splitlines()[-1], out[-2000:]


def test_the_unpacking_ptx_sequence_equals_the_simulator_twin():
    """gpu/bits.py's int4_pair{i}_bf16 on the GPU is PRMT (its selector), LOP3 (mask, magic,
    LUT) and a bf16x2 FMA (x 1 - 136): those steps, evaluated here by the PTX ISA's
    definitions with the module's constants, give the simulator twin's bf16 pair for every
    byte of random words (what the tests above run)."""
    from kdtree_numba import compat
    from kdtree_numba.gpu import bits
    if not compat.SIMULATOR:
        pytest.skip("the twin is the simulator's (on a GPU the names are the intrinsics)")

    def prmt(a, b, sel):
        src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
        return sum(src[(sel >> 4 * k) & 7] << 8 * k for k in range(4))

    def lop3(a, b, c, lut):
        return sum(((lut >> ((((a >> n) & 1) << 2) | (((b >> n) & 1) << 1) | ((c >> n) & 1)))
                    & 1) << n for n in range(32))

    def fma_bf16x2(a, b, c):
        def half(x, k):
            return float(np.uint32(((x >> 16 * k) & 0xFFFF) << 16).view(np.float32))
        out = [half(a, k) * half(b, k) + half(c, k) for k in range(2)]   # exact: small ints
        return sum((int(np.float32(v).view(np.uint32)) >> 16) << 16 * k
                   for k, v in enumerate(out))
    twins = (bits.int4_pair0_bf16, bits.int4_pair1_bf16, bits.int4_pair2_bf16,
             bits.int4_pair3_bf16)
    rng = np.random.default_rng(10)
    for word in [0, 0xFFFFFFFF, 0x88888888, 0x01234567] + rng.integers(0, 1 << 32, 200).tolist():
        for i, twin in enumerate(twins):
            p = prmt(word, word >> 4, bits._int4_pair_selector(i))
            p = lop3(p, bits._I4_MASK, bits._I4_MAGIC, bits._I4_LUT)
            got = fma_bf16x2(p, bits._BF16X2_ONE, bits._BF16X2_M136)
            assert got == int(twin(np.uint32(word), np.uint32(word >> 4))), (hex(word), i)


# ------------------------------------------------------------------ the bench's variants

VARIANTS_PTX_SCRIPT = HOPPER_PRELUDE + r"""
import dataclasses
from kdtree_numba.layers.moe import _expert_kernel
from kdtree_numba.layers.moe_int4_mma import Int4MmaConfig, int4_mma_config, int4_mma_kernel
from kdtree_numba.layers.moe_shapes import expert_config
import importlib.util
spec = importlib.util.spec_from_file_location("bench_layers", "tools/bench_layers.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

def assemble(name, fn, sig, cap=0):
    ptx, _ = cuda.compile_ptx(fn.py_func, sig, cc=(9, 0))
    log = ptxas(ptx, cap)
    regs = int(re.findall(r"Used (\d+) registers", log)[0])
    spill = sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log))
    local = len(re.findall(r"(?:ld|st)\.local", ptx))
    print(name, "regs", regs, "spill", spill, "local", local, flush=True)
    assert spill == 0 and local == 0, name
    return ptx

f2, u2, i1, i64 = T.float32[:, ::1], T.uint16[:, ::1], T.int32[::1], T.int64
for name, kw in bench.INT4_MMA_TILES:
    cfg = Int4MmaConfig(**kw)
    for gate_up in (True, False):
        out = T.uint32[:, ::1] if gate_up else f2
        sig = (u2,) + (i1,) * 7 + (T.uint32[:, :, ::1], T.uint16[:, :, ::1], out) + (i64,) * 5
        ptx = assemble(f"mma {name} {'gate_up' if gate_up else 'down'}",
                       int4_mma_kernel(cfg, gate_up, True, 32), sig)
        assert "cp.async.wait_group %d;" % (cfg.stages - 2) in ptx, "ring wait"
d, inter = bench.MOE_SHAPE["d"], bench.MOE_SHAPE["inter"]
sig = (f2, i1, i1, i1, i1, T.uint32[:, :, ::1], T.uint16[:, :, ::1], f2, i64, i64, i64)
for name, gate_up_kw, down_kw in bench.INT4_GEMV_VARIANTS:
    for gate_up, k_in, kw in ((True, d, gate_up_kw), (False, inter, down_kw)):
        cfg = dataclasses.replace(expert_config(1, 8, 384, k_in, gate_up, True), **kw)
        ptx = assemble(f"{name} {'gate_up' if gate_up else 'down'}",
                       _expert_kernel(cfg, "i4", gate_up, 32), sig, cfg.max_registers)
        assert ("cp.async.bulk.prefetch.L2.global" in ptx) == cfg.prefetch, "prefetch"
        # the ring waits on its own depth; the denormal products are no flush-to-zero FMAs
        assert ("cp.async.wait_group %d;" % (cfg.stages - 1) in ptx) == bool(cfg.stages)
        assert "fma.rn.f32" in ptx and "fma.rn.ftz" not in ptx, "denormals kept"
print("assembled")
"""


@pytest.mark.slow
def test_the_benchs_variant_kernels_assemble_for_hopper():
    """Every W4A16 kernel tools/bench_layers.py --only int4 times beside the defaults (the
    tensor-core tiles of INT4_MMA_TILES, the decode GEMV's INT4_GEMV_VARIANTS) compiles for
    sm_90 and assembles without spills or local memory (a register cap where the variant
    has one), the rings waiting on their own depth, the prefetch variants holding the
    bulk L2 prefetch, no FMA flushing denormals (the denormal unpacking reads its weights
    as denormals): so the GPU run measures them.  ~2 min."""
    from ptx_check import run_without_simulator
    out = run_without_simulator(VARIANTS_PTX_SCRIPT, timeout=900)
    assert "assembled" in out.splitlines()[-1], out[-3000:]
