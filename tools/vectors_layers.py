#!/usr/bin/env python3
"""KDTR test vectors for the non-attention kernels (reference.layers), and their checker.

    python3 tools/vectors_layers.py [--out DIR]        # or: python3 tools/make_vectors.py layers

Writes tests/vectors/layers_dense.kdtr, layers_rope.kdtr and layers_moe.kdtr.  The layout
(groups, dataset names, dtypes, attributes) is specified in docs/LAYERS.md, section "Test
vectors"; in short ``<op>/<case>/in/<arg>``, ``<op>/<case>/out/<result>`` and the scalar
arguments as attributes of ``<op>/<case>``.  Inputs are seeded, so regenerating gives the same
bytes.  :func:`check_file` is what tests/test_layers.py runs on the committed files.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from formats import kdtr  # noqa: E402
import reference.layers as ref  # noqa: E402

BF16 = ml_dtypes.bfloat16
EPS32 = 2.0 ** -24
VERSION = 1

# The real configs' rope entries (config.json of DeepSeek-V3 and Kimi-K2-Instruct).
ROPE_CONFIGS = {
    "deepseek_v3": {"rope_theta": 10000.0, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                    "rope_scaling": {"type": "yarn", "factor": 40.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                     "original_max_position_embeddings": 4096}},
    "kimi_k2": {"rope_theta": 50000.0, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                "rope_scaling": {"type": "yarn", "factor": 32.0, "beta_fast": 1.0,
                                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                 "original_max_position_embeddings": 4096}},
}
ROUTE_CASES = {
    "v3_grouped": dict(top_k=3, n_group=4, topk_group=2, norm_topk_prob=True,
                       routed_scaling_factor=2.5, scoring="sigmoid"),
    "kimi": dict(top_k=4, n_group=1, topk_group=1, norm_topk_prob=True,
                 routed_scaling_factor=2.827, scoring="sigmoid"),
    "v2_softmax": dict(top_k=3, n_group=2, topk_group=1, norm_topk_prob=False,
                       routed_scaling_factor=1.0, scoring="softmax"),
}
ROUTE_KEYS = ("top_k", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
              "scoring")


# ============================================================================ cases

def dense_cases(rng):
    """(op, case, inputs, attrs) for rmsnorm, linear, embedding and argmax."""
    yield "rmsnorm", "f32_weight", dict(x=(rng.standard_normal((3, 48)) * 3).astype(np.float32),
                                        weight=rng.uniform(0.5, 1.5, 48).astype(np.float32)), \
        dict(eps=1e-6)
    yield "rmsnorm", "bf16_weight", dict(x=rng.standard_normal((2, 40)).astype(np.float32),
                                         weight=rng.uniform(0.5, 1.5, 40).astype(BF16)), \
        dict(eps=1e-5)
    yield "linear", "f32", dict(x=rng.standard_normal((3, 64)).astype(np.float32),
                                w=rng.standard_normal((24, 64)).astype(np.float32)), {}
    yield "linear", "bf16", dict(x=rng.standard_normal((5, 64)).astype(np.float32),
                                 w=(rng.standard_normal((16, 64)) * 0.1).astype(BF16)), {}
    yield "linear", "k_not_multiple_of_8", dict(x=rng.standard_normal((4, 13)).astype(np.float32),
                                                w=rng.standard_normal((7, 13)).astype(np.float32)), {}
    yield "embedding", "bf16_table", dict(ids=np.array([3, 0, 19, 3, 7], np.int32),
                                          table=rng.standard_normal((20, 16)).astype(BF16)), {}
    logits = rng.standard_normal((4, 100)).astype(np.float32)
    logits[0, [5, 40, 63]] = 9.0                 # ties: smallest index
    logits[1] = -np.inf                          # all -inf: index 0
    logits[2, [3, 50]] = np.nan                  # NaN wins, first NaN
    logits[3] = 0.0
    logits[3, 1] = -0.0                          # -0.0 == 0.0: index 0
    yield "argmax", "ties_nan_inf", dict(logits=logits), {}


def rope_cases(rng):
    spec = ref.RopeSpec(theta=10000.0, head_dim=16, interleave=False)
    yield "rope", "neox_plain", dict(x=rng.standard_normal((3, 2, 16)).astype(np.float32),
                                     positions=np.array([0, 1, 4097], np.int64)), \
        _rope_attrs(spec, qk_head_dim=16 + 32)
    for name, config in ROPE_CONFIGS.items():
        spec = ref.RopeSpec.from_hf_config(config)
        yield "rope", name, dict(x=rng.standard_normal((3, 2, 64)).astype(np.float32),
                                 positions=np.array([0, 5000, 160_000], np.int64)), \
            _rope_attrs(spec, config["qk_nope_head_dim"] + config["qk_rope_head_dim"])


def _rope_attrs(spec: ref.RopeSpec, qk_head_dim: int) -> dict:
    y = spec.yarn
    attrs = dict(theta=spec.theta, head_dim=spec.head_dim, interleave=spec.interleave,
                 yarn=y is not None, qk_head_dim=qk_head_dim)
    if y is not None:
        attrs.update(factor=y.factor, original_max_position_embeddings=
                     y.original_max_position_embeddings, beta_fast=y.beta_fast,
                     beta_slow=y.beta_slow, mscale=y.mscale, mscale_all_dim=y.mscale_all_dim)
    return attrs


def spec_from_attrs(attrs) -> ref.RopeSpec:
    yarn = None
    if attrs["yarn"]:
        yarn = ref.YarnScaling(attrs["factor"], attrs["original_max_position_embeddings"],
                               attrs["beta_fast"], attrs["beta_slow"], attrs["mscale"],
                               attrs["mscale_all_dim"])
    return ref.RopeSpec(attrs["theta"], attrs["head_dim"], attrs["interleave"], yarn)


def moe_cases(rng):
    # Routing logits/biases from small value sets: exact ties, no near-ties (see LAYERS.md).
    for name, case in ROUTE_CASES.items():
        inputs = dict(logits=rng.choice(np.float32([-1.5, -0.5, 0.25, 0.75, 2.0]), (4, 16)))
        if name != "v2_softmax":
            inputs["bias"] = rng.choice(np.float32([-3.0, 0.0, 0.125, 0.5]), 16)
        yield "route", name, inputs, dict(case)
    yield "route", "dropped_groups_minus_inf", dict(
        logits=np.array([[2.0, 1.0, 0.5, 0.4, -1.0, -2.0, -2.5, -3.0]], np.float32),
        bias=np.full(8, -3.0, np.float32)), dict(ROUTE_CASES["v3_grouped"], topk_group=2)
    h = (rng.integers(-4, 5, (3, 16)) / 4).astype(np.float32)     # dyadic: exact fp32 logits
    gate = (rng.integers(-4, 5, (8, 16)) / 8).astype(np.float32)
    gate[5] = gate[2]
    yield "moe_route", "dyadic_grouped", dict(h=h, gate_w=gate, bias=np.zeros(8, np.float32)), \
        dict(top_k=2, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
             scoring="sigmoid")
    yield "moe_ffn", "bf16_shared", _moe_inputs(
        rng, np.array([[3, 5], [0, 3], [3, 7], [1, 3], [3, 6]], np.int32), 16, 8, 8, BF16, True), {}
    yield "moe_ffn", "f32_no_shared", _moe_inputs(
        rng, np.array([[0, 2], [1, 2], [2, 3]], np.int32), 16, 4, 8, np.float32, False), {}


def _moe_inputs(rng, expert_idx, d, n_experts, inter, dtype, shared):
    m, k = expert_idx.shape
    inputs = dict(h=rng.standard_normal((m, d)).astype(np.float32), expert_idx=expert_idx,
                  weight=rng.uniform(0.1, 1.0, (m, k)).astype(np.float32),
                  gate_up=(rng.standard_normal((n_experts, 2 * inter, d)) * 0.3).astype(dtype),
                  down=(rng.standard_normal((n_experts, d, inter)) * 0.3).astype(dtype))
    if shared:
        inputs["shared_gate_up"] = (rng.standard_normal((2 * inter, d)) * 0.3).astype(dtype)
        inputs["shared_down"] = (rng.standard_normal((d, inter)) * 0.3).astype(dtype)
    return inputs


FILES = {"layers_dense.kdtr": dense_cases, "layers_rope.kdtr": rope_cases,
         "layers_moe.kdtr": moe_cases}


# ============================================================================ the reference

def reference_outputs(op: str, inputs: dict, attrs: dict) -> dict:
    """What reference.layers returns for one case, named as stored under ``out/``."""
    if op == "rmsnorm":
        return dict(y=ref.rmsnorm(inputs["x"], inputs["weight"], attrs["eps"]))
    if op == "linear":
        return dict(y=ref.linear(inputs["x"], inputs["w"]))
    if op == "embedding":
        return dict(y=ref.embedding(inputs["ids"], inputs["table"]))
    if op == "argmax":
        return dict(idx=ref.argmax(inputs["logits"]))
    if op == "rope":
        spec = spec_from_attrs(attrs)
        return dict(y=ref.rope(inputs["x"], inputs["positions"], spec),
                    inv_freq=spec.inv_freq(),
                    softmax_scale=np.float64(spec.softmax_scale(attrs["qk_head_dim"])),
                    amplitude=np.float64(spec.amplitude()))
    if op == "moe_ffn":
        return dict(y=ref.moe_ffn(*_moe_args(inputs)))
    if op == "route":
        idx, w = ref.route_from_logits(inputs["logits"], inputs.get("bias"), **_routing(attrs))
        return dict(expert_idx=idx, weight=w)
    if op == "moe_route":
        idx, w = ref.moe_route(inputs["h"], inputs["gate_w"], inputs.get("bias"),
                               **_routing(attrs))
        return dict(expert_idx=idx, weight=w)
    raise ValueError(f"unknown op {op!r}")


def _routing(attrs) -> dict:
    return {k: attrs[k] for k in ROUTE_KEYS}


def _moe_args(inputs):
    return (inputs["h"], inputs["expert_idx"], inputs["weight"], inputs["gate_up"],
            inputs["down"], inputs.get("shared_gate_up"), inputs.get("shared_down"))


def write(outdir) -> list[Path]:
    """Write the three files into ``outdir``; returns their paths."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    for filename, cases in FILES.items():
        rng = np.random.default_rng(sum(map(ord, filename)))
        path = outdir / filename
        with kdtr.File(path, "w") as f:
            f.attrs["family"] = "layers"
            f.attrs["version"] = VERSION
            f.attrs["contract"] = "reference/layers.py; layout in docs/LAYERS.md"
            for op, case, inputs, attrs in cases(rng):
                group = f.create_group(f"{op}/{case}")
                for name, value in attrs.items():
                    group.attrs[name] = value
                for name, arr in inputs.items():
                    f.create_dataset(f"{op}/{case}/in/{name}", data=arr)
                for name, arr in reference_outputs(op, inputs, attrs).items():
                    f.create_dataset(f"{op}/{case}/out/{name}", data=np.asarray(arr))
        paths.append(path)
    return paths


# ============================================================================ the checker

def read_cases(path):
    """Yield (op, case, inputs, attrs, outputs) from one vectors file, as NumPy arrays."""
    with kdtr.File(path) as f:
        for op in f.keys():
            for case in f[op].keys():
                node = f[f"{op}/{case}"]
                inputs = {k: np.array(node["in"][k][...]) for k in node["in"].keys()}
                outputs = {k: np.array(node["out"][k][...]) for k in node["out"].keys()}
                yield op, case, inputs, dict(node.attrs), outputs


def check_file(path, layers=None) -> int:
    """Assert that the reference reproduces every stored output (to 1 float32 ulp: float64
    BLAS/libm may differ by an ulp between machines; integers exactly), and, with ``layers``
    (the kdtree_numba.layers module), that the kernels match within the tolerances of
    docs/LAYERS.md.  Returns the number of cases checked."""
    n = 0
    for op, case, inputs, attrs, outputs in read_cases(path):
        where = f"{Path(path).name}:{op}/{case}"
        for name, want in reference_outputs(op, inputs, attrs).items():
            _assert_same(np.asarray(want), outputs[name], f"{where} reference out/{name}")
        if layers is not None:
            _check_kernel(layers, op, inputs, attrs, outputs, where)
        n += 1
    return n


def _assert_same(got, want, where):
    assert got.dtype == want.dtype and got.shape == want.shape, (where, got.dtype, want.dtype)
    if np.issubdtype(want.dtype, np.floating):
        np.testing.assert_array_max_ulp(got, want, maxulp=1, dtype=want.dtype)
    else:
        assert np.array_equal(got, want), where


def _host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


def _check_kernel(layers, op, inputs, attrs, outputs, where):
    if op == "rmsnorm":
        got = _host(layers.rmsnorm(inputs["x"], inputs["weight"], attrs["eps"]))
        np.testing.assert_allclose(got, outputs["y"], rtol=1e-5, err_msg=where)
    elif op == "linear":
        x, w = inputs["x"], inputs["w"]
        got = _host(layers.linear(x, w))
        bound = (x.shape[1] + 12) * EPS32 * (np.abs(ref.as_float64(x))
                                             @ np.abs(ref.as_float64(w)).T)
        assert np.all(np.abs(got - outputs["y"]) <= bound), where
    elif op == "embedding":
        assert np.array_equal(_host(layers.embedding(inputs["ids"], inputs["table"])),
                              outputs["y"]), where
    elif op == "argmax":
        assert np.array_equal(_host(layers.argmax(inputs["logits"])), outputs["idx"]), where
    elif op == "rope":
        got = _host(layers.rope(inputs["x"], inputs["positions"], spec_from_attrs(attrs)))
        np.testing.assert_allclose(got, outputs["y"], rtol=1e-6, atol=1e-6, err_msg=where)
    elif op in ("route", "moe_route"):
        routing = _routing(attrs)
        if op == "route":
            idx, w = layers.route_from_logits(inputs["logits"], inputs.get("bias"), **routing)
        else:
            idx, w = layers.moe_route(inputs["h"], inputs["gate_w"], inputs.get("bias"),
                                      **routing)
        assert np.array_equal(_host(idx), outputs["expert_idx"]), where
        np.testing.assert_allclose(_host(w), outputs["weight"], rtol=2e-6, err_msg=where)
    elif op == "moe_ffn":
        args = _moe_args(inputs)
        got = _host(layers.moe_ffn(*args))
        absolute = [None if a is None else (np.abs(ref.as_float64(a))
                                            if a.dtype.kind == "f" or a.dtype == BF16 else a)
                    for a in args]
        magnitude = ref.moe_ffn(*absolute)
        assert np.all(np.abs(got - outputs["y"]) <= 1e-5 * (np.abs(magnitude) + 1e-3)), where
    else:
        raise ValueError(f"{where}: unknown op")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "vectors")
    args = parser.parse_args(argv)
    for path in write(args.out):
        print(f"wrote {path} ({path.stat().st_size:,} bytes, {check_file(path)} cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
