"""Parity with Hugging Face transformers' DeepseekV3ForCausalLM (CPU, float32, eager attention).

The tiny config of docs/ENGINE.md ("Bundles") with re-initialised O(0.1-1) weights, YaRN on,
n_group > 1 and a dense first layer.  HF runs the *naive* (decompressed) MLA, we run the absorbed
form, so agreement also checks the absorption.  Skipped when torch/transformers are missing.
Pins that worked here: torch 2.13.0+cpu, transformers 5.24.0.
"""
from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kdtree_numba.bundle import random_weights, read_bundle, size_config  # noqa: E402
from kdtree_numba.drafter import NoisyOracleDrafter  # noqa: E402
from kdtree_numba.engine import generate  # noqa: E402
from kdtree_numba.hf_import import export_hf_checkpoint, import_hf  # noqa: E402
from kdtree_numba.model import Model  # noqa: E402

CONFIGS = {
    "tiny": {},  # q_lora, YaRN (factor 8, L0 64), n_group 4 / topk_group 2, dense layer 0
    "variant": dict(q_lora_rank=None, tie_word_embeddings=True, rope_interleave=False,
                    rope_scaling=None, first_k_dense_replace=0, n_group=2, topk_group=1),
}
SEQS = [np.array([3, 17, 99, 5, 64, 2, 1, 77, 8, 120, 33, 41, 90, 91, 6, 12, 45, 100, 7, 70,
                  22, 11, 5, 3]),
        np.array([127, 0, 64])]


@functools.lru_cache(maxsize=None)
def models(name: str, tmp_dir: str):
    cfg = size_config("tiny", **CONFIGS[name])
    weights = dict(random_weights(cfg, seed=7))
    hf_dir = f"{tmp_dir}/{name}"
    export_hf_checkpoint(cfg, weights, hf_dir)
    transformers.utils.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
            hf_dir, attn_implementation="eager", dtype=torch.float32).eval()
    return cfg, weights, hf, Model(cfg, weights, "reference"), hf_dir


@pytest.fixture(scope="module")
def tmp_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, tmp_dir):
    _, _, hf, ours, _ = models(name, tmp_dir)
    for seq in SEQS:
        with torch.no_grad():
            want = hf(torch.tensor(seq[None])).logits[0].double().numpy()
        got = ours.score(seq)
        # 1e-4 of the logit scale: HF computes in float32, we in float64 (measured ~1e-6)
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
        assert np.abs(want).max() > 1.0                    # the weights are not trivial


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_tokens_match_transformers_generate(name, tmp_dir):
    _, _, hf, ours, _ = models(name, tmp_dir)
    prompt = SEQS[0][:6]
    with torch.no_grad():
        want = hf.generate(torch.tensor(prompt[None]), max_new_tokens=12, do_sample=False,
                           attention_mask=torch.ones(1, prompt.size, dtype=torch.long),
                           pad_token_id=0)[0, prompt.size:].tolist()
    assert generate(ours, [prompt], 12).tokens[0] == want
    drafter = NoisyOracleDrafter(ours, 3, agreement=0.7, seed=1, sharpness=4.0)
    assert generate(ours, [prompt], 12, method="ddtree", drafter=drafter,
                    budget=8).tokens[0] == want


def test_save_pretrained_imports_back_to_the_same_bundle(tmp_dir, tmp_path):
    cfg, weights, hf, _, _ = models("tiny", tmp_dir)
    out_dir = tmp_path / "saved"
    hf.save_pretrained(out_dir)            # transformers' own writer: per-expert tensor names
    got_cfg = import_hf(out_dir, tmp_path / "m.kdtr", quiet=True)
    assert got_cfg == cfg
    _, got = read_bundle(tmp_path / "m.kdtr")
    for name, w in weights.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)
