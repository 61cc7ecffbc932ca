"""Pictures of generation (issue 14, item 5): ``kdtree-run --plot`` and tools/bench_demo.py.

* :func:`plot_run` (``kdtree-run ... --plot run.png``): the histogram of the run's acceptance
  lengths (``GenerationStats.tau``: tokens committed per round, the accepted draft tokens plus
  the target's bonus token) above one round's draft tree, drawn as a tree: the root on the
  left, one column per depth, each node labelled with its token's text (ids when the model has
  no tokenizer), the accepted path and the bonus token in their own colours.
* :func:`plot_budget_curves` (``tools/bench_demo.py --plot``): tau and speedup against the
  budget, two panels.

Getting a round's tree to the host costs a device read that the engine's one read per round
does not include (docs/ENGINE.md, "Sync points").  :class:`RoundRecorder` is the engine's
``on_round`` hook: each round it copies request 0's tree into one small int32 array *on the
device* (no read), and after generation :meth:`RoundRecorder.pick` reads the one round it
draws, the round with the median acceptance (:func:`pick_round`).  Without the hook the engine
reads what it always did.

matplotlib is optional (the ``plot`` extra): only the drawing functions import it, and they
draw on a bare ``matplotlib.figure.Figure`` (written by the Agg canvas), never through pyplot,
so no GUI backend or global figure state is involved.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

__all__ = ["PLOT_EXTRA_HINT", "require_matplotlib", "RoundRecorder", "RoundTree",
           "request_rounds", "pick_round", "token_label", "plot_run", "plot_budget_curves"]

PLOT_EXTRA_HINT = "pip install 'kdtree-numba[plot]'"

# colours (Tableau 10): the accepted path, the bonus token, the root, the other nodes
ACCEPTED, BONUS, ROOT, OTHER = "#f28e2b", "#59a14f", "#a0cbe8", "#e6e6e6"


def require_matplotlib():
    """``matplotlib.figure`` (ImportError when matplotlib is not installed)."""
    import matplotlib.figure
    return matplotlib.figure


# ----------------------------------------------------------------------------- the round

@dataclasses.dataclass
class RoundTree:
    """One round's tree of request 0, on the host.  Slot 0 is the root (the last committed
    token before the round), slots 1..n the drafted nodes (``token``, ``parent``, ``depth``
    per slot); ``accepted`` the slots of the accepted path, root first; ``bonus`` the token
    the target chose after it (None when generation stopped before committing it)."""
    index: int                  # 0-based round of the generation
    rounds: int                 # request 0's rounds in all
    how: str                    # how the round was chosen (pick_round)
    root: int
    token: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    accepted: list
    bonus: int | None

    @property
    def n_nodes(self) -> int:
        return int(self.token.size) - 1

    def accepted_tokens(self) -> list[int]:
        return [int(self.token[s]) for s in self.accepted[1:]]


def request_rounds(tau: Sequence[Sequence[int]], n_out: int) -> list[tuple[int, int, int]]:
    """(round, acc_len, tokens committed before it) of each round request 0 took part in.
    ``tau`` is ``GenerationStats.tau`` (per round the acc_len of the requests still active,
    request 0 first while it is), ``n_out`` request 0's number of new tokens; the prefill
    commits its first token, and a request, once finished, stays finished."""
    out, done = [], min(n_out, 1)
    for r, accs in enumerate(tau):
        if done >= n_out or not accs:
            break
        out.append((r, int(accs[0]), done))
        done += int(accs[0])
    return out


def pick_round(rounds: Sequence[tuple[int, int, int]]) -> tuple[int, str] | None:
    """Which of ``rounds`` (:func:`request_rounds`) to draw: the first round whose acceptance
    is the (lower) median of all of them, so the picture shows a typical round rather than
    the luckiest.  (position in ``rounds``, how it was chosen), or None without rounds."""
    if not rounds:
        return None
    accs = sorted(a for _, a, _ in rounds)
    median = accs[(len(accs) - 1) // 2]
    i = next(i for i, (_, a, _) in enumerate(rounds) if a == median)
    return i, f"the first with the median acceptance, {median}; all rounds: {accs[0]} to " \
              f"{accs[-1]}"


class RoundRecorder:
    """``engine.generate``'s ``on_round`` hook for ``kdtree-run --plot``: keeps request 0's
    tree of every round as one int32 device array ``[n_nodes, acc_len, token (W), parent
    (W), depth (W), acc_idx (L + 1)]`` (W = budget + 1 slots), copied on the device, so the
    rounds read nothing more; :meth:`pick` reads one of them after generation."""

    def __init__(self, backend):
        self.backend = backend
        self.packed: list = []
        self.width = 0

    def __call__(self, tree, acc_idx, acc_len) -> None:
        xp = self.backend.xp
        parts = (tree.n_nodes[:1], acc_len[:1], tree.token[0], tree.parent[0], tree.depth[0],
                 acc_idx[0])
        self.packed.append(xp.concatenate([xp.asarray(p).reshape(-1).astype(np.int32)
                                           for p in parts]))
        self.width = int(tree.token.shape[1])

    def pick(self, tau, out_tokens: Sequence[int]) -> RoundTree | None:
        """Request 0's round to draw (:func:`pick_round`) as a :class:`RoundTree`, from
        ``GenerationStats.tau`` and request 0's new tokens; reads that one round's array (the
        one extra read of ``--plot``).  None when request 0 took no round."""
        rounds = request_rounds(tau, len(out_tokens))
        chosen = pick_round(rounds)
        if chosen is None:
            return None
        i, how = chosen
        r, acc_len, before = rounds[i]
        data = np.asarray(self.backend.to_host(self.packed[r]), np.int64)
        W = self.width
        n = int(data[0])
        token, parent, depth = (data[2 + j * W: 2 + (j + 1) * W][:n + 1] for j in range(3))
        accepted = [int(s) for s in data[2 + 3 * W:][:acc_len]]
        last = before + acc_len - 1          # the bonus token's place in request 0's output
        bonus = int(out_tokens[last]) if last < len(out_tokens) else None
        return RoundTree(index=r, rounds=len(rounds), how=how,
                         root=int(out_tokens[before - 1]), token=token, parent=parent,
                         depth=depth, accepted=accepted, bonus=bonus)


# ----------------------------------------------------------------------------- drawing

def token_label(text: str, limit: int = 12) -> str:
    """A token's text as a node label: whitespace made visible (space as a middle dot,
    newline and tab as ``\\n`` and ``\\t``), ``$`` escaped (matplotlib would read a pair as
    mathtext), cut to ``limit`` characters."""
    shown = text.replace("\\", "\\\\").replace(" ", "\u00b7").replace("\n", "\\n") \
        .replace("\t", "\\t").replace("\r", "\\r")
    shown = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in shown)
    if len(shown) > limit:
        shown = shown[:limit - 1] + "\u2026"
    return shown.replace("$", r"\$") or "''"


def _layout(rt: RoundTree) -> tuple[dict, dict]:
    """Children lists and a y coordinate per slot (leaves one row apart in depth-first order,
    a parent at the mean of its children); the bonus token is slot -1, the last accepted
    node's last child."""
    children: dict[int, list[int]] = {s: [] for s in range(rt.n_nodes + 1)}
    for s in range(1, rt.n_nodes + 1):
        children.setdefault(int(rt.parent[s]), []).append(s)
    if rt.bonus is not None:
        children[rt.accepted[-1]].append(-1)
        children[-1] = []
    y: dict[int, float] = {}
    leaf = 0
    stack = [(0, False)]                  # iterative post-order: depths may be large
    while stack:
        s, expanded = stack.pop()
        if not children[s]:
            y[s] = float(leaf)
            leaf += 1
        elif expanded:
            y[s] = float(np.mean([y[c] for c in children[s]]))
        else:
            stack.append((s, True))
            stack.extend((c, False) for c in reversed(children[s]))
    return children, y


def _draw_tree(ax, rt: RoundTree, label: Callable[[int], str], fontsize: float) -> None:
    children, y = _layout(rt)
    depth = {s: int(rt.depth[s]) for s in range(rt.n_nodes + 1)}
    depth[0] = 0
    if rt.bonus is not None:
        depth[-1] = depth[rt.accepted[-1]] + 1
    on_path = set(rt.accepted)
    for s, kids in children.items():
        for c in kids:
            hot = c in on_path or c == -1
            ax.plot([depth[s], depth[c]], [-y[s], -y[c]], color=(BONUS if c == -1 else
                    ACCEPTED if hot else "#9a9a9a"), lw=2.4 if hot else 0.8,
                    ls="--" if c == -1 else "-", zorder=1)
    for s in children:
        if s == 0:
            text, face, edge, ls = label(rt.root), ROOT, "#4e79a7", "-"
        elif s == -1:
            text, face, edge, ls = label(rt.bonus), "white", BONUS, "--"
        else:
            text = label(int(rt.token[s]))
            face, edge, ls = (ACCEPTED, "#b35806", "-") if s in on_path else \
                (OTHER, "#9a9a9a", "-")
        ax.text(depth[s], -y[s], text, ha="center", va="center", fontsize=fontsize,
                family="monospace", zorder=2,
                bbox=dict(boxstyle="round,pad=0.25", fc=face, ec=edge, ls=ls, lw=1.0))
    top = max(depth.values())
    ax.set_xlim(-0.6, top + 0.6)
    ax.set_ylim(-max(y.values()) - 0.8, 0.8)
    ax.set_xticks(range(top + 1))
    ax.set_xlabel("depth (tokens after the root)")
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    from matplotlib.patches import Patch
    handles = [Patch(fc=ROOT, ec="#4e79a7", label="root (last committed token)"),
               Patch(fc=ACCEPTED, ec="#b35806", label="accepted"),
               Patch(fc=OTHER, ec="#9a9a9a", label="drafted, rejected")]
    if rt.bonus is not None:
        handles.append(Patch(fc="white", ec=BONUS, ls="--",
                             label="bonus token (the target's own)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


def plot_run(path, tau: Sequence[Sequence[int]], rt: RoundTree | None,
             label: Callable[[int], str], title: str) -> None:
    """Write ``path`` (PNG): the acceptance-length histogram of every round and request
    (``tau``, ``GenerationStats.tau``) above ``rt``'s tree (or a note when there is none);
    ``label(token_id)`` gives a node's text."""
    figure_module = require_matplotlib()
    flat = [int(a) for r in tau for a in r]
    leaves = 1
    if rt is not None:
        children, _ = _layout(rt)
        leaves = sum(1 for kids in children.values() if not kids)
    tree_h = min(max(3.0, 0.3 * leaves), 60.0)
    fig = figure_module.Figure(figsize=(11, 3.2 + tree_h + 0.8))
    # hspace is a fraction of the mean panel height: ~1.2 inches whatever the tree's height
    grid = fig.add_gridspec(2, 1, height_ratios=[3.2, tree_h + 0.8],
                            hspace=1.2 / ((3.2 + tree_h + 0.8) / 2))
    hist, tree_ax = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    if flat:
        top = max(flat)
        hist.hist(flat, bins=np.arange(0.5, top + 1.5), color=ACCEPTED, ec="#b35806")
        mean = float(np.mean(flat))
        hist.axvline(mean, color="#4e79a7", ls="--", lw=1.5, label=f"mean tau {mean:.2f}")
        hist.set_xticks(range(1, top + 1))
        from matplotlib.ticker import MaxNLocator
        hist.yaxis.set_major_locator(MaxNLocator(integer=True))
        hist.legend(fontsize=8)
    else:
        hist.text(0.5, 0.5, "no rounds (autoregressive, or every token came from prefill)",
                  ha="center", va="center", transform=hist.transAxes)
    hist.set_xlabel("tokens committed per round (acc_len: accepted draft tokens + 1 bonus)")
    hist.set_ylabel("rounds")
    hist.set_title(title, fontsize=10)
    if rt is None:
        tree_ax.axis("off")
        tree_ax.text(0.5, 0.5, "no round to draw", ha="center", va="center",
                     transform=tree_ax.transAxes)
    else:
        _draw_tree(tree_ax, rt, lambda t: token_label(label(t)),
                   fontsize=9 if leaves <= 40 else 7)
        tree_ax.set_title(
            f"round {rt.index + 1} of {rt.rounds} ({rt.how}): {rt.n_nodes} drafted nodes, "
            f"{len(rt.accepted) - 1} accepted"
            + ("" if rt.bonus is None else " + the bonus token"), fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")


def plot_budget_curves(path, rows: Sequence[dict], speed_goal: float | None = None,
                       tau_goal: float | None = None, title: str = "") -> None:
    """Write ``path`` (PNG): tau (left) and speedup over AR (right) against the budget.
    ``rows``: dicts with ``method`` (ar / chain / ddtree), ``budget``, ``temperature``,
    ``tau``, ``speedup``; DDTree rows are curves per temperature, chain rows a dashed level
    (it has no budget), AR the speedup of 1; the goals, when given, dotted lines."""
    figure_module = require_matplotlib()
    fig = figure_module.Figure(figsize=(11, 4.2))
    ax_tau, ax_speed = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    temps = sorted({float(r["temperature"]) for r in rows})
    colours = ["#4e79a7", "#e15759", "#76b7b2", "#edc948", "#b07aa1"]
    budgets = sorted({int(r["budget"]) for r in rows if r["method"] == "ddtree"})
    for i, t in enumerate(temps):
        c = colours[i % len(colours)]
        dd = sorted((r for r in rows if r["method"] == "ddtree" and r["temperature"] == t),
                    key=lambda r: r["budget"])
        chain = [r for r in rows if r["method"] == "chain" and r["temperature"] == t]
        for ax, key in ((ax_tau, "tau"), (ax_speed, "speedup")):
            if dd:
                ax.plot([r["budget"] for r in dd], [r[key] for r in dd], "o-", color=c,
                        label=f"DDTree, T = {t:g}")
            if chain:
                ax.axhline(chain[0][key], color=c, ls="--", lw=1,
                           label=f"chain, T = {t:g}")
    ax_speed.axhline(1.0, color="#555555", lw=1, label="AR")
    if tau_goal is not None:
        ax_tau.axhline(tau_goal, color="#59a14f", ls=":", lw=1.5,
                       label=f"goal: tau >= {tau_goal:g} at budget 32")
    if speed_goal is not None:
        ax_speed.axhline(speed_goal, color="#59a14f", ls=":", lw=1.5,
                         label=f"goal: {speed_goal:g}x AR")
    for ax, name in ((ax_tau, "mean tau (tokens per round)"),
                     (ax_speed, "tokens/s over AR's")):
        if budgets:
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets)
            ax.set_xticklabels([str(b) for b in budgets])
        ax.set_xlabel("budget (tree nodes per round)")
        ax.set_ylabel(name)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
