"""The source generator of the tiled GEMM kernels, and their shape, :class:`TiledConfig`.

tiled.py compiles what :func:`tiled_source` writes (one kernel per config, weight kind and
mode: ``linear``, or the MoE experts' ``gate_up`` and ``down``) together with the small device
functions it calls.  The kernel is generated rather than written because its accumulators
must stay in registers: every tile offset is spelled out as a constant.  Twin:
reference/layers/linear.py (the contract); design and measurements: docs/LAYERS.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from kdtree_numba.compat import SIMULATOR
from kdtree_numba.layers.common import CHUNK

__all__ = ["TiledConfig", "tiled_source"]

# ============================================================================ tiled GEMM
# For M > SKINNY_MAX_M (the DDTree verify step, M = 65, and prefill) and for the MoE experts of
# such steps.  A block computes a BM x BN output tile for all of its BM rows at once, so each
# weight element comes from HBM once per block (once per call when M <= BM).  Weights and x
# are staged through shared memory in K stages of bk (double-buffered: the next stage's 16-byte
# global loads are in flight in registers while the FMAs of this one run; one barrier per
# stage), transposed so that a warp reads a k-row of the tile with LDS.128.  Thread (warp
# (wm_i, wn_i), lane (ly_i, lx_i)) owns rows rbase + [0, tm) and columns cbase + g*BN/(tn/4)
# + [0, 4) for each float4 group g, so per k step it issues tm/4 + tn/4 LDS.128 (the x loads
# are broadcasts) for tm*tn FMAs.  bf16 weights are widened when staged.  Every output is one
# sequential fp32 sum over its K slice in k order; slices (``splits``) are added in order.

@dataclass(frozen=True)
class TiledConfig:
    """Tiled GEMM shape: ``wm`` x ``wn`` warps, each warp ``ly`` lanes along M by ``32 // ly``
    along N; a thread computes ``tm`` rows (a multiple of 4) x ``tn`` columns (4, or 8 = two
    float4 groups BN/2 apart); K in stages of ``bk`` (a multiple of 8); ``splits`` K slices
    (linear only: separate blocks, then an ordered sum).  BM = wm*ly*tm, BN = wn*(32/ly)*tn."""
    wm: int = 3
    wn: int = 1
    ly: int = 2
    tm: int = 12
    tn: int = 8
    bk: int = 16
    splits: int = 1
    max_registers: int = 0       # ptxas cap (0: none), to fit more blocks per SM

    @property
    def lx(self) -> int:
        return 32 // self.ly

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn

    @property
    def bm(self) -> int:
        return self.wm * self.ly * self.tm

    @property
    def bn(self) -> int:
        return self.wn * self.lx * self.tn

    @property
    def smem_bytes(self) -> int:
        return 2 * self.bk * (self.bn + 4 + self.bm + 4) * 4

    def __post_init__(self):
        if (self.tm % 4 or self.tn not in (4, 8) or self.ly not in (1, 2, 4, 8)
                or self.bk % CHUNK or self.bk <= 0 or self.splits < 1 or self.wm < 1
                or self.wn < 1 or self.threads > 1024 or self.smem_bytes > 48 * 1024):
            raise ValueError(f"bad TiledConfig {self}: tm % 4, tn in (4, 8), ly in (1, 2, 4, 8), "
                             f"bk % 8, <= 1024 threads, <= 48 KB shared memory")



class _Src:
    """Indented source lines for the generated kernels."""

    def __init__(self):
        self.lines, self.depth = [], 0

    def __call__(self, *lines):
        self.lines += ["    " * self.depth + line for line in lines]

    def indent(self, by=1):
        self.depth += by


def tiled_source(cfg: TiledConfig, wkind: str, mode: str) -> str:
    """Source of the tiled kernel: mode "linear" (x rows m0.., split-K; out [splits*M, N]),
    "gate_up" (an expert's gathered tokens, gate and up rows side by side, out = act with
    silu(g) * u) or "down" (an expert's slots, out = y_slot).  Shared memory is two flat
    arrays, [2 buffers][bk][BN+4] and [2][bk][BM+4].  Thread t stages the 16-byte vectors
    t, t + THREADS, ... of each tile, row-major (K fastest, so a row's bk elements are read
    contiguously): all of a thread's vectors share one k offset, and their rows and shared
    offsets differ by constants, so only a handful of per-thread values stay live."""
    c = cfg
    bm, bn, threads, lx = c.bm, c.bn, c.threads, c.lx
    bnp, bmp = bn + 4, bm + 4                         # +4 floats: rows stay 16-byte aligned
    vw = 8 if wkind == "bf16" else 4                  # weight elements per staged vector
    wq_n, xq_n = c.bk // vw, c.bk // 4                # vectors per tile row
    lay = dict(c=c, wkind=wkind, mode=mode, bnp=bnp, bmp=bmp, vw=vw,
               gstride=bn // (c.tn // 4), half=bn // 2,
               rw=threads // wq_n, rx=threads // xq_n,          # tile rows per vector step
               nwv=-(-bn * wq_n // threads), nxv=-(-bm * xq_n // threads))
    src = _Src()
    if mode == "linear":
        src("def tiled(x, w, out, m_total, n_total, k_total, n_mtiles, splits, kc_total):")
    else:
        src("def tiled(x, token_of_slot, offsets, active, n_active, w3, out, n_out, k_total, "
            "tiles, cmin, cmax):")
    src.indent()
    align = "" if SIMULATOR else ", alignment=16"
    src(f"wsm = cuda.shared.array({2 * c.bk * bnp}, np.float32{align})",
        f"xsm = cuda.shared.array({2 * c.bk * bmp}, np.float32{align})",
        f"acc = cuda.local.array({c.tm * c.tn}, np.float32)",
        "t = cuda.threadIdx.x", "lane = t & 31", "warp = t >> 5",
        f"ly_i = lane // {lx}", f"lx_i = lane - ly_i * {lx}",
        f"rbase = (warp % {c.wm}) * {c.ly * c.tm} + ly_i * {c.tm}",
        f"cbase = (warp // {c.wm}) * {lx * 4} + lx_i * 4",
        "z = np.float32(0.0)", "z4 = (z, z, z, z)", "u0 = np.uint32(0)",
        "z4u = (u0, u0, u0, u0)", "bid = cuda.blockIdx.x",
        f"wl = t // {wq_n}", f"wq = (t - wl * {wq_n}) * {vw}", f"wo = wq * {bnp} + wl",
        f"xl = t // {xq_n}", f"xq = (t - xl * {xq_n}) * 4", f"xo = xq * {bmp} + xl")
    if mode == "linear":
        src("mt_i = bid % n_mtiles", "rest = bid // n_mtiles", "s = rest % splits",
            f"n0 = (rest // splits) * {bn}", f"m0 = mt_i * {bm}",
            f"k_begin = {CHUNK} * (s * kc_total // splits)",
            f"k_end = min({CHUNK} * ((s + 1) * kc_total // splits), k_total)",
            "orow = s * m_total + m0 + rbase", "nw = n0 + wl", "nlast = n_total - 1")
    else:
        tile_n = lay["half"] if mode == "gate_up" else bn
        src("a = bid // tiles", "if a >= n_active[0]:", "    return", "e = active[a]",
            "count = offsets[e + 1] - offsets[e]", "if count < cmin or count >= cmax:",
            "    return", "w = w3[e]", f"n0 = (bid - a * tiles) * {tile_n}",
            "k_begin = 0", "k_end = k_total", "nw = n0 + wl", "nlast = n_out - 1")
        if mode == "gate_up":     # tile rows [0, half) are gate rows n0.., the rest up rows
            half = lay["half"]
            for i in range(lay["nwv"]):
                src(f"wr{i} = min(nw + {i * lay['rw']}, nlast) if wl + {i * lay['rw']} < {half}"
                    f" else n_out + min(nw + {i * lay['rw'] - half}, nlast)")
    if mode == "linear":
        src(f"rows_here = min({bm}, m_total - m0)")
        _tiled_chunk_source(src, lay)
    else:
        src("s0 = offsets[e]", "s_end = offsets[e + 1]", "while s0 < s_end:")
        src.indent()
        src(f"rows_here = min({bm}, s_end - s0)")
        _tiled_chunk_source(src, lay)
        src(f"s0 += {bm}")
    return "\n".join(src.lines)


def _tiled_chunk_source(src, lay):
    """One pass over the block's K range for rows_here rows, then the epilogue."""
    c, wkind, mode = lay["c"], lay["wkind"], lay["mode"]
    tm4, bnp, bmp, rw, rx = c.tm // 4, lay["bnp"], lay["bmp"], lay["rw"], lay["rx"]
    stage_w, stage_x = c.bk * bnp, c.bk * bmp
    vec_x = wkind in ("f32", "bf16")
    # vector i is a real one when its tile row exists (the last step may be partial)
    w_real = [i * rw + rw <= c.bn for i in range(lay["nwv"])]
    x_real = [i * rx + rx <= c.bm for i in range(lay["nxv"])]
    for i in range(lay["nxv"]):   # x row of each staged x vector (-1: padding, zeros)
        row = {"linear": f"m0 + xl + {i * rx}", "gate_up": f"token_of_slot[s0 + xl + {i * rx}]",
               "down": f"s0 + xl + {i * rx}"}[mode]
        src(f"xr{i} = {row} if xl + {i * rx} < rows_here else -1")
    src(f"for i in range({c.tm * c.tn}):", "    acc[i] = z")
    if mode != "linear":          # live 4-row groups of this thread (warp-uniform when ly = 1)
        src(f"ng = min(max((rows_here - rbase + 3) // 4, 0), {tm4})")

    def load(kexpr):
        src(f"kw = {kexpr} + wq", f"kx = {kexpr} + xq", "okw = kw < k_end", "okx = kx < k_end")
        for i in range(lay["nwv"]):
            ok = "okw" if w_real[i] else f"okw and wl + {i * rw} < {c.bn}"
            row = f"wr{i}" if mode == "gate_up" else f"min(nw + {i * rw}, nlast)"
            if wkind == "bf16":
                src(f"wv{i} = ldw(w, {row}, kw >> 1) if {ok} else z4u")
            elif wkind == "f32":
                src(f"wv{i} = ldw(w, {row}, kw) if {ok} else z4")
            else:
                src(f"wv{i} = ldw(w, {row}, kw, k_end)" +
                    ("" if w_real[i] else f" if wl + {i * rw} < {c.bn} else z4"))
        for i in range(lay["nxv"]):
            if vec_x:
                src(f"xv{i} = ldx(x, xr{i}, kx) if okx and xr{i} >= 0 else z4")
            else:
                src(f"xv{i} = ldx(x, xr{i}, kx, k_end) if xr{i} >= 0 else z4")

    def store(buf):
        for i in range(lay["nwv"]):
            if not w_real[i]:
                src(f"if wl + {i * rw} < {c.bn}:")
                src.indent()
            stage = "stage8" if wkind == "bf16" else "stage4"
            src(f"{stage}(wsm, wo + {buf * stage_w + i * rw}, i64({bnp}), wv{i})")
            if not w_real[i]:
                src.indent(-1)
        for i in range(lay["nxv"]):
            if not x_real[i]:
                src(f"if xl + {i * rx} < {c.bm}:")
                src.indent()
            src(f"stage4(xsm, xo + {buf * stage_x + i * rx}, i64({bmp}), xv{i})")
            if not x_real[i]:
                src.indent(-1)

    def compute(groups):
        # k steps unrolled in pairs: constant shared offsets, no loop counter per step
        src(f"for kp in range({c.bk // 2}):")
        src.indent()
        src(f"xk = xb + kp * {2 * bmp}", f"wk = wb + kp * {2 * bnp}")
        for kk in range(2):
            src(*[f"a{g} = lds(xsm, xk + {kk * bmp + 4 * g})" for g in range(groups)])
            src(*[f"b{g} = lds(wsm, wk + {kk * bnp + g * lay['gstride']})"
                  for g in range(c.tn // 4)])
            b1 = "b1" if c.tn == 8 else "b0"
            src(*[f"fma_row(acc, i64({i * c.tn}), a{i // 4}[{i % 4}], b0, {b1})"
                  for i in range(4 * groups)])
        src.indent(-1)

    src("ks = k_begin")
    load("ks")
    store(0)
    src("cuda.syncthreads()", "buf = 0", "while ks < k_end:")
    src.indent()
    src(f"nxt = ks + {c.bk}", "if nxt < k_end:")
    src.indent()
    load("nxt")
    src.indent(-1)
    src(f"xb = buf * {stage_x} + rbase", f"wb = buf * {stage_w} + cbase")
    if mode == "linear":
        compute(tm4)
    else:
        for groups in range(tm4, 0, -1):
            src(("if" if groups == tm4 else "elif") + f" ng == {groups}:")
            src.indent()
            compute(groups)
            src.indent(-1)
    src("if nxt < k_end:")
    src.indent()
    src("if buf == 0:")
    src.indent()
    store(1)
    src.indent(-1)
    src("else:")
    src.indent()
    store(0)
    src.indent(-2)
    src("cuda.syncthreads()", "ks = nxt", "buf = 1 - buf")
    src.indent(-1)
    _tiled_epilogue_source(src, lay)


def _tiled_epilogue_source(src, lay):
    c, mode = lay["c"], lay["mode"]
    limit = "n_total" if mode == "linear" else "n_out"
    src("col = n0 + cbase")
    for i in range(c.tm):
        row = f"orow + {i}" if mode == "linear" else f"s0 + rbase + {i}"
        if mode == "gate_up":          # column j of group 0 is gate row n0+col, group 1 its up
            call = f"store_silu(out, {row}, col, {limit}, acc, i64({i * 8}))"
        else:
            call = (f"store_row(out, {row}, col, i64({lay['gstride']}), {limit}, acc, "
                    f"i64({i * c.tn}))")
        src(f"if rbase + {i} < rows_here:", "    " + call)
