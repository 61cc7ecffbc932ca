"""The shipped demo model (issue 14; docs/DEMO.md): what ``kdtree-run`` runs without
``--model``.

``TARGET`` is a DeepSeek-V3-architecture code model (transformers' ``DeepseekV3ForCausalLM``,
8.75 M parameters, hidden 256, 6 layers, vocabulary 8192, context 512, tied embeddings)
trained on Python source by tools/train_target.py and brought in with ``kdtr-import-hf``; its
byte-level BPE tokenizer travels inside the bundle (kdtree_numba/text.py), so it takes text
in and gives text out.  It is package data (setup.cfg), so a non-editable install has it too.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["TARGET", "TEXT_PROMPT", "DEFAULT_DRAFTER", "DEFAULT_DRAFTER_PEEKS", "describe"]

HERE = Path(__file__).resolve().parent
TARGET = HERE / "demo-target.kdtr"

# kdtree-run's prompt when none is given and the model has a tokenizer (shown in --help).
TEXT_PROMPT = "def fibonacci(n):"

# ---------------------------------------------------------------------------------------------
# THE DEFAULT DRAFTER: what `kdtree-run --method ddtree` drafts with on the default model when
# no --drafter is given (kdtree_numba/cli_checks.py, plan_drafter, reads these two names and
# nothing else chooses it).  Until issue 14's DFlash block drafter, trained against TARGET,
# ships next to it, this is the test drafter oracle:0.8: it runs the target itself, so it
# knows the target's greedy future (its acceptance and speed are an upper bound, not a
# result), and kdtree-run says so on stderr.  When the trained drafter lands, point
# DEFAULT_DRAFTER at its bundle and set DEFAULT_DRAFTER_PEEKS to False.
DEFAULT_DRAFTER = "oracle:0.8"
DEFAULT_DRAFTER_PEEKS = True
# ---------------------------------------------------------------------------------------------


def describe() -> str:
    """One line for kdtree-run's notice."""
    return ("the shipped demo target (a DeepSeek-V3-architecture code model, 8.75 M "
            "parameters, trained on Python source)")
