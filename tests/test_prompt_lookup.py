"""Prompt lookup in DDTree's rounds (kdtree_numba/lookup.py; the kernels' contract in
reference/ddtree/lookup.py, their twins in tests/test_lookup_kernels.py).

* Lossless: with the lookup DDTree gives AR's tokens under one seed (T = 0 and 0.8, eos, a
  ragged batch), on host rounds and device rounds alike, which agree on every round.
* It pays where the text repeats: the demo pair on the CPU path commits more a round.
* The device history the rounds keep is each request's sequence; the chain and AR ignore
  the lookup; the settings and ``KDTREE_PROMPT_LOOKUP`` are checked.
* A `gpu` twin: the demo pair's device rounds with the lookup, AR's tokens, more a round.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from kdtree_numba import compat, runtime
from kdtree_numba.engine import generate
from kdtree_numba.lookup import ON, PromptLookup, resolve
from test_dflash import target_and_drafter

# repeats inside each prompt, so the lookup has something to find from the first round
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 8, 7, 6, 5, 4, 3], [11, 12, 11, 12, 11]]


@pytest.mark.parametrize("device_rounds", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_ddtree_with_the_lookup_gives_ar_tokens(device_rounds, temperature):
    """AR's tokens (one request stopped by eos), and the rounds' trees are not the plain
    drafter's: the lookup changed what was verified."""
    target, drafter = target_and_drafter(seed=37)
    ar = generate(target, PROMPTS, 14, temperature=temperature, seed=4)
    eos = ar.tokens[1][5]
    want = generate(target, PROMPTS, 14, temperature=temperature, seed=4, eos=eos).tokens
    trees = {}
    for lookup in (None, PromptLookup(0.9, 4, 1)):
        seen = []
        res = generate(target, PROMPTS, 14, method="ddtree", drafter=drafter, budget=6,
                       temperature=temperature, seed=4, eos=eos, prompt_lookup=lookup or False,
                       device_rounds=device_rounds,
                       on_round=None if device_rounds else
                       lambda tree, *_: seen.append(np.asarray(tree.token).copy()))
        assert res.tokens == want
        assert res.stats.prompt_lookup == lookup
        trees[lookup] = seen
    if not device_rounds:
        assert not all(np.array_equal(a, b) for a, b in zip(*trees.values()))


def test_host_and_device_rounds_agree_with_the_lookup():
    """The same rounds (tau of every round) whether the host drives them or they run as
    device programs with the history in the program's buffer."""
    target, drafter = target_and_drafter(seed=37)
    kw = dict(method="ddtree", drafter=drafter, budget=5, prompt_lookup=PromptLookup(0.7, 3))
    host = generate(target, PROMPTS, 16, device_rounds=False, **kw)
    dev = generate(target, PROMPTS, 16, device_rounds=True, **kw)
    assert host.tokens == dev.tokens
    assert host.stats.tau == dev.stats.tau and host.stats.rounds == dev.stats.rounds


def test_the_device_history_is_each_requests_sequence():
    """After device rounds, the program's history holds each request's prompt and committed
    tokens at their positions (what ``record_tokens`` wrote, round after round)."""
    target, drafter = target_and_drafter(seed=37)
    res = generate(target, PROMPTS, 16, method="ddtree", drafter=drafter, budget=5,
                   prompt_lookup=True, device_rounds=True)
    cache = target.cache_for_generation(len(PROMPTS), 1)
    (rounds,) = [p for p in cache.programs.values() if p.lookup == ON]
    history = np.asarray(rounds.history)
    for b, (prompt, out) in enumerate(zip(PROMPTS, res.tokens)):
        seq = prompt + out
        np.testing.assert_array_equal(history[b, :len(seq)], seq)


def test_the_lookup_pays_on_the_demo_pair():
    """The shipped pair on the CPU path, two held-out prompts x 64 tokens, budget 16: the same
    tokens, at least 15% more a round with the lookup (dev/lookup_mix.py measured +47% on
    32 prompts x 128)."""
    from kdtree_numba import demo
    from kdtree_numba.backends import make_backend
    from kdtree_numba.drafter import load_drafter
    from kdtree_numba.model import Model
    from kdtree_numba.text import load_codec
    model = Model.load(str(demo.TARGET), make_backend("reference", precision="float32"))
    drafter = load_drafter(demo.DEFAULT_DRAFTER, model, 15, 0)
    codec = load_codec(str(demo.TARGET))
    prompts = [[0] + codec.encode("def parse_args(argv):\n    parser = argparse.ArgumentParser("
                                  "description=__doc__)\n    parser.add_argument("),
               [0] + codec.encode("class Point:\n    def __init__(self, x, y):\n        self.x"
                                  " = x\n        self.y = y\n\n    def __repr__(self):\n")]
    ar = generate(model, prompts, 64).tokens
    taus = {}
    for lookup in (False, True):
        res = generate(model, prompts, 64, method="ddtree", drafter=drafter, budget=16,
                       prompt_lookup=lookup)
        assert res.tokens == ar
        taus[lookup] = res.stats.mean_tau
    assert taus[True] >= 1.15 * taus[False], taus


def test_chain_and_ar_ignore_the_lookup():
    target, drafter = target_and_drafter(seed=37)
    kw = dict(method="chain", drafter=drafter, temperature=0.8, seed=1)
    a = generate(target, PROMPTS, 8, **kw)
    b = generate(target, PROMPTS, 8, prompt_lookup=0.9, **kw)
    assert a.tokens == b.tokens and a.stats.tau == b.stats.tau
    assert b.stats.prompt_lookup is None
    assert generate(target, PROMPTS, 4, prompt_lookup=True).stats.prompt_lookup is None


def test_an_automatic_budget_with_the_lookup():
    target, drafter = target_and_drafter(seed=37)
    ar = generate(target, PROMPTS, 12).tokens
    res = generate(target, PROMPTS, 12, method="ddtree", drafter=drafter, budget="auto",
                   prompt_lookup=True)
    assert res.tokens == ar and res.stats.prompt_lookup == ON


def test_the_settings_and_the_switch(monkeypatch):
    from kdtree_numba.backends import make_backend
    cpu, exact = make_backend("reference", precision="float32"), make_backend("reference")
    assert resolve(False, "ddtree", cpu) is None and resolve(True, "ddtree", exact) == ON
    assert resolve(0.5, "ddtree", exact) == dataclasses.replace(ON, weight=0.5)
    mine = PromptLookup(0.6, 5, 3)
    assert resolve(mine, "ddtree", exact) is mine and resolve(mine, "chain", exact) is None
    for bad, err in ((1.0, ValueError), (0.0, ValueError), ("0.5", TypeError),
                     ([0.5], TypeError)):
        with pytest.raises(err, match="lookup|prompt_lookup"):
            resolve(bad, "ddtree", exact)
    for fields, match in (((0.5, 0, 0), "max_n"), ((0.5, 33, 2), "max_n"),
                          ((0.5, 3, 4), "min_n"), ((True, 3, 2), "weight")):
        with pytest.raises((ValueError, TypeError), match=match):
            PromptLookup(*fields)
    env = runtime.RuntimeConfig.from_environment
    assert env({}).prompt_lookup is None and env({"KDTREE_PROMPT_LOOKUP": "off"}).prompt_lookup == 0
    assert env({"KDTREE_PROMPT_LOOKUP": "on"}).prompt_lookup == ON.weight
    assert env({"KDTREE_PROMPT_LOOKUP": "0.65"}).prompt_lookup == 0.65
    for bad in ("1.5", "lots", "1"):
        with pytest.raises(ValueError, match="KDTREE_PROMPT_LOOKUP"):
            env({"KDTREE_PROMPT_LOOKUP": bad})
    monkeypatch.delenv("KDTREE_PROMPT_LOOKUP", raising=False)
    # unset: on the CPU path and the numba backend (where it was timed: runs 169-170), not on
    # the exact reference
    numba = make_backend("numba") if compat.SIMULATOR else None
    assert resolve(None, "ddtree", cpu) == ON and resolve(None, "ddtree", exact) is None
    if numba is not None:
        assert resolve(None, "ddtree", numba) == ON
    monkeypatch.setenv("KDTREE_PROMPT_LOOKUP", "0.7")
    assert resolve(None, "ddtree", exact) == dataclasses.replace(ON, weight=0.7)
    monkeypatch.setenv("KDTREE_PROMPT_LOOKUP", "off")
    assert resolve(None, "ddtree", cpu) is None


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_gpu_demo_pair_with_the_lookup(temperature):
    """The shipped pair on the GPU (device rounds, the numba lookup kernels in the captured
    round): AR's tokens with and without the lookup, and at T = 0 more a round with it."""
    from test_lean_round import demo_pair
    model, drafter = demo_pair()
    prompts = [[0, 5, 17, 300, 17, 300, 17], [0, 1000, 2000, 3000]]
    ar = generate(model, prompts, 48, temperature=temperature, seed=3).tokens
    taus = {}
    for lookup in (False, True):
        res = generate(model, prompts, 48, method="ddtree", drafter=drafter, budget=16,
                       temperature=temperature, seed=3, prompt_lookup=lookup)
        assert res.tokens == ar
        taus[lookup] = res.stats.mean_tau
    if temperature == 0:
        assert taus[True] > taus[False], taus


def test_kdtree_run_prompt_lookup(capsys):
    """kdtree-run's flag: the shipped pair at T = 0, AR's tokens with the lookup on, the
    lookup named in --json's stats; a bad value is a usage error; other methods warn."""
    from kdtree_numba.cli import run_main
    base = ["--prompt", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
            "--max-new-tokens", "24", "--json"]
    assert run_main(base) == 0
    ar = json.loads(capsys.readouterr().out)
    assert run_main(base + ["--method", "ddtree", "--prompt-lookup", "on"]) == 0
    dd = json.loads(capsys.readouterr().out)
    assert dd["tokens"] == ar["tokens"]
    assert dd["stats"]["prompt_lookup"] == {"weight": ON.weight, "max_n": 8, "min_n": 2}
    for bad in ("1", "lots", "-0.5"):
        assert run_main(["--method", "ddtree", "--prompt-lookup", bad]) == 2
        err = capsys.readouterr().err
        assert "--prompt-lookup" in err and "weight in (0, 1)" in err
    # "0" is off, as in KDTREE_PROMPT_LOOKUP
    assert run_main(base + ["--method", "ddtree", "--prompt-lookup", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["prompt_lookup"] is None
    assert run_main(["--max-new-tokens", "2", "--prompt-lookup", "0.5"]) == 0
    assert "--method ar ignores it" in capsys.readouterr().err


def test_numba_rounds_with_the_lookup_in_simulator(needs_kernels):
    """The numba path (its lookup kernels in the device round's tree step and after its
    acceptance; the simulator here; host rounds call the same ops, and the twins' bool and
    int masks are tests/test_lookup_kernels.py's) on test_engine's tiny widths: AR's tokens,
    and the rounds the reference backend's rounds with the same lookup make."""
    from kdtree_numba.backends import make_backend
    from kdtree_numba.dflash import DFlashDrafter
    from kdtree_numba.model import Model
    from test_dflash import pair
    target_over = dict(num_hidden_layers=1, first_k_dense_replace=1, vocab_size=16,
                       hidden_size=8, intermediate_size=8, q_lora_rank=None,
                       kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                       num_attention_heads=1)
    tcfg, tw, dcfg, dw, spec = pair(target_over, dict(num_hidden_layers=1), (0,), 3)
    prompts, lookup = [[3, 9, 4, 3, 9, 4, 3]], PromptLookup(0.9, 3, 1)
    runs = {}
    for name in ("reference", "numba"):
        target = Model(tcfg, tw, make_backend(name))
        drafter = DFlashDrafter(target, dcfg, dw, spec)
        runs[name] = generate(target, prompts, 4, method="ddtree", drafter=drafter, budget=3,
                              prompt_lookup=lookup, device_rounds=True)
    assert runs["numba"].tokens == generate(Model(tcfg, tw, "reference"), prompts, 4).tokens
    assert runs["numba"].stats.tau == runs["reference"].stats.tau
