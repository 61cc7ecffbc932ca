"""kdtree_numba/weights.py: the one table the model loads its weights through -- every stored
tensor has a registered format, each format says what the model keeps of it and which uses
each backend's kernels take, and a format a backend cannot run is refused at load, naming the
tensor."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from formats.int4_group import Int4GroupWeight
from kdtree_numba.backends import make_backend
from kdtree_numba.bundle import BundleError
from kdtree_numba.weights import FORMATS, USES, format_of, load_weight


def test_every_stored_dtype_has_its_format():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    assert format_of(w).name == "f32"
    assert format_of(w.astype(ml_dtypes.bfloat16)).name == "bf16"
    assert format_of(w.astype(ml_dtypes.bfloat16).view(np.uint16)).name == "bf16"
    assert format_of(w.astype(np.float16)).name == "f16"
    assert format_of(Int4GroupWeight.quantize(w[None], 32)).name == "int4-group"
    with pytest.raises(TypeError, match="no weight format stores"):
        format_of(np.zeros(3, np.int8))
    assert set(FORMATS) == {"f32", "bf16", "f16", "int4-group"}


def test_float_weights_load_as_the_backend_keeps_them_for_every_use():
    be = make_backend("reference")
    w = np.arange(8, dtype=np.float32).reshape(2, 4).astype(ml_dtypes.bfloat16)
    for use in USES:
        kept = load_weight(be, "w", w, use)
        assert kept.dtype == np.float64 and np.array_equal(kept, w.astype(np.float64))
    assert load_weight(be, "w", w, "float32", np.float32).dtype == np.float64


def test_int4_group_experts_run_on_the_reference_only_as_experts():
    rng = np.random.default_rng(1)
    packed = Int4GroupWeight.quantize(rng.standard_normal((2, 4, 64)).astype(np.float32), 32)
    be = make_backend("reference")
    assert load_weight(be, "mlp/experts/down_proj", packed, "experts") is packed   # kept packed
    with pytest.raises(BundleError, match="attn/o_proj is int4-group: the reference backend's "
                                          "kernels take no int4-group weight as linear"):
        load_weight(be, "attn/o_proj", packed, "linear")
    with pytest.raises(ValueError, match="weight use must be one of"):
        load_weight(be, "x", packed, "lm_head")


def test_int4_group_experts_stay_packed_on_the_numba_backend():
    """The numba backend keeps int4-group experts as the packed words and bf16 scales its
    W4A16 kernels read (their bytes, never a wider copy), as experts only."""
    from kdtree_numba import compat
    from kdtree_numba.layers.workspace import Int4Experts
    if not compat.kernels_runnable():
        pytest.skip("the numba backend needs a GPU or NUMBA_ENABLE_CUDASIM=1")
    rng = np.random.default_rng(2)
    packed = Int4GroupWeight.quantize(rng.standard_normal((2, 4, 64)).astype(np.float32), 32)
    be = make_backend("numba")
    kept = load_weight(be, "mlp/experts/gate_up_proj", packed, "experts")
    assert isinstance(kept, Int4Experts) and kept.nbytes == packed.nbytes
    words, scale = (a.get() if hasattr(a, "get") else a for a in (kept.words, kept.scale))
    assert np.array_equal(np.asarray(words).view(np.uint8), packed.packed)
    assert np.array_equal(np.asarray(scale), packed.scale.view(np.uint16))
    assert load_weight(be, "again", kept, "experts") is kept        # drawn on the device
    with pytest.raises(BundleError, match="attn/o_proj is int4-group: the numba backend's "
                                          "kernels take no int4-group weight as linear"):
        load_weight(be, "attn/o_proj", packed, "linear")
    with pytest.raises(BundleError, match="^x: int4 experts drawn for the numba kernels"):
        load_weight(make_backend("reference"), "x", kept, "experts")
