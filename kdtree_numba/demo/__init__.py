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

__all__ = ["TARGET", "DRAFTER", "TEXT_PROMPT", "DEFAULT_DRAFTER", "DEFAULT_DRAFTER_PEEKS", "describe"]

HERE = Path(__file__).resolve().parent
TARGET = HERE / "demo-target.kdtr"
# Its DFlash block drafter (B = 16, 2 layers, 1.89 M parameters, features of target layers
# 1, 3, 5), distilled from TARGET by tools/train_drafter.py on the target's own greedy text.
DRAFTER = HERE / "demo-drafter.kdtr"

# kdtree-run's prompt when none is given and the model has a tokenizer (shown in --help).
TEXT_PROMPT = "def fibonacci(n):"

# ---------------------------------------------------------------------------------------------
# THE DEFAULT DRAFTER: what `kdtree-run --method ddtree` (and chain) drafts with on the
# default model when no --drafter is given (kdtree_numba/cli_checks.py, plan_drafter, reads
# these two names and nothing else chooses it): the trained DFlash drafter above.
# DEFAULT_DRAFTER_PEEKS says whether it is a test drafter that knows the target's future
# (oracle:P, before the trained drafter shipped), which kdtree-run would announce.
DEFAULT_DRAFTER = str(DRAFTER)
DEFAULT_DRAFTER_PEEKS = False
# ---------------------------------------------------------------------------------------------


def describe() -> str:
    """One line for kdtree-run's notice."""
    return ("the shipped demo target (a DeepSeek-V3-architecture code model, 8.75 M "
            "parameters, trained on Python source)")
