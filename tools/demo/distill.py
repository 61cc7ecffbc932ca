"""The frozen target's side of drafter training: load the HF export, tap the features, give
the greedy labels, and measure a drafter against the target on held-out windows.

Features are taken with forward hooks on the target's decoder layers, not from
``output_hidden_states``: transformers (5.x) replaces the last entry of ``hidden_states`` with
the final-normed output, while the spec wants every feature before any final norm (the
residual stream after layer j), the last layer's included (docs/DEMO.md, "The DFlash drafter").
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .dflash import DFlashDrafter, expected_tau, position_weights, weighted_ce
from .target import set_experts_impl
from .trainer import autocast, gather


def load_target(path: str, device, log=print):
    """The HF export in float32 (run under bf16 autocast on a GPU, as it was trained and
    evaluated), frozen, in eval mode; on a GPU the grouped_mm expert kernel when it runs."""
    import transformers
    from transformers import DeepseekV3ForCausalLM
    transformers.utils.logging.disable_progress_bar()
    model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                  attn_implementation="sdpa").to(device)
    model.eval().requires_grad_(False)
    impl = set_experts_impl(model, "grouped_mm" if device.type == "cuda" else "eager")
    if impl != "eager":
        try:
            with torch.no_grad(), autocast(device.type, torch.bfloat16):
                model.model(input_ids=torch.zeros(2, 8, dtype=torch.long, device=device),
                            use_cache=False)
        except Exception as e:       # noqa: BLE001 -- a kernel this build cannot run
            log(f"experts grouped_mm unusable here ({type(e).__name__}: {e}); eager"[:300])
            impl = set_experts_impl(model, "eager")
    return model, impl


def target_head(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(embedding, lm_head or None when tied): what the drafter shares."""
    emb = model.model.embed_tokens.weight
    head = model.lm_head.weight
    return emb.detach(), (None if head is emb or head.data_ptr() == emb.data_ptr()
                          else head.detach())


class FeatureTap:
    """Forward hooks keeping the outputs of the chosen decoder layers (the residual stream
    after each) during the next forward."""

    def __init__(self, model, layer_ids):
        self.layer_ids = tuple(layer_ids)
        self.out: dict[int, torch.Tensor] = {}
        self.handles = [model.model.layers[j].register_forward_hook(self._hook(j))
                        for j in self.layer_ids]

    def _hook(self, j):
        def hook(module, inputs, output):
            self.out[j] = output[0] if isinstance(output, (tuple, list)) else output
        return hook

    def features(self) -> torch.Tensor:
        """[bs, T, k*D] float32, layers in ``layer_ids`` order; clears what was kept."""
        feats = torch.cat([self.out[j].float() for j in self.layer_ids], dim=-1)
        self.out.clear()
        return feats

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def target_pass(model, tap: FeatureTap, ids: torch.Tensor, amp_dtype, keep_logits=False):
    """(features [bs, T, k*D], greedy [bs, T]): the target's argmax after each position,
    teacher forced on ``ids``; with ``keep_logits`` also its logits [bs, T, V] (the soft
    targets of sampled rows)."""
    with autocast(ids.device.type, amp_dtype):
        h = model.model(input_ids=ids, use_cache=False).last_hidden_state
        logits = model.lm_head(h)
        greedy = logits.argmax(-1)
    if keep_logits:
        return tap.features(), greedy, logits
    return tap.features(), greedy


def random_anchors(bs: int, A: int, T: int, B: int, device, generator=None) -> torch.Tensor:
    """[bs, A] distinct sorted anchors a in [1, T-B] (a >= 1: at least one context entry;
    a + B - 1 < T: the block's labels exist)."""
    n = T - B
    if A > n:
        raise ValueError(f"{A} anchors do not fit in a window of {T} with blocks of {B}")
    r = torch.rand(bs, n, device=device, generator=generator)
    return (r.topk(A, dim=1).indices + 1).sort(dim=1).values


def block_labels(greedy: torch.Tensor, anchors: torch.Tensor, B: int) -> torch.Tensor:
    """[bs, A, B-1]: slot k's label g(a + k - 1), the target's choice for position a + k."""
    idx = anchors[:, :, None] + torch.arange(B - 1, device=anchors.device)
    return greedy.gather(1, idx.flatten(1)).view(idx.shape)


def block_roots(ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    return ids.gather(1, anchors)


# ----------------------------------------------------------------------------- self-generated data

@torch.no_grad()
def greedy_windows(model, stream: torch.Tensor, T: int, rows: int, prefix: int, amp_dtype,
                   generator=None) -> torch.Tensor:
    """[rows, T] windows: ``prefix`` tokens of the stream (random starts), then the target's
    own greedy continuation to T tokens, decoded with the KV cache.

    What the drafter meets at inference is the target's greedy text after a prompt, so its
    labels there are exact continuations rather than the argmax after *corpus* tokens (which
    differs from the continuation from depth 2 on: a chain is checked against the target's
    own choices, not the corpus's).  DFlash trains on target-generated responses for the same
    reason (docs/DEMO.md, "Training on the target's own text")."""
    temps = torch.zeros(rows, device=stream.device)
    return sampled_windows(model, stream, T, temps, prefix, amp_dtype, generator)


def sample_next(logits: torch.Tensor, temps: torch.Tensor, generator=None,
                any_hot: bool | None = None) -> torch.Tensor:
    """[rows] tokens: the argmax where ``temps`` is 0, else a draw from softmax(logits / t)
    (the target's own sampling at that temperature, no top-p or top-k).  The draw is the
    exponential race argmax_v p_v / E_v, E_v ~ Exp(1) (an exact sample, and no device sync
    as torch.multinomial's checks make); ``any_hot``: whether some t > 0, when known."""
    greedy = logits.argmax(-1)
    if any_hot is None:
        any_hot = bool((temps > 0).any())
    if not any_hot:
        return greedy
    hot = temps > 0
    scaled = logits.float() / torch.where(hot, temps, torch.ones_like(temps))[:, None]
    # a draw of exactly 0 (a float32 uniform hitting its end) would give 0/0 = nan, which
    # argmax takes for the largest: clamp to the smallest normal float, no other change
    race = torch.empty_like(scaled).exponential_(generator=generator).clamp_min_(1.2e-38)
    drawn = (scaled.softmax(-1) / race).argmax(-1)
    return torch.where(hot, drawn, greedy)


@torch.no_grad()
def sampled_windows(model, stream: torch.Tensor, T: int, temps: torch.Tensor, prefix: int,
                    amp_dtype, generator=None) -> torch.Tensor:
    """[rows, T] windows, rows = len(temps): ``prefix`` tokens of the stream (random starts),
    then the target's own continuation to T tokens decoded with the KV cache, row r sampled at
    temperature temps[r] (0: greedy).  At T > 0 the engine's DDTree walk checks the drafter
    against the target's *samples*, so that is the text to learn from (DFlash trains on the
    target's sampled responses and keeps most of its acceptance at T = 1)."""
    from transformers import DynamicCache
    dev = stream.device
    rows = temps.numel()
    any_hot = bool((temps > 0).any())
    starts = torch.randint(0, stream.numel() - T - 1, (rows,), device=dev, generator=generator)
    ids = gather(stream, starts, T - 1).clone()
    cache = DynamicCache(config=model.config)
    with autocast(dev.type, amp_dtype):
        out = model(input_ids=ids[:, :prefix], past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        for t in range(prefix, T):
            nxt = sample_next(out.logits[:, -1], temps, generator, any_hot)
            ids[:, t] = nxt
            if t + 1 < T:
                out = model(input_ids=nxt[:, None], past_key_values=out.past_key_values,
                            use_cache=True)
    return ids


def row_temperatures(mix, rows: int, device) -> torch.Tensor:
    """[rows] temperatures of one generation chunk: ``mix`` [(temperature, share), ...] laid
    out in contiguous runs, round(share * rows) rows each (the last takes the remainder)."""
    out, used = [], 0
    for i, (t, share) in enumerate(mix):
        n = rows - used if i == len(mix) - 1 else min(rows - used, round(share * rows))
        out.append(torch.full((n,), float(t), device=device))
        used += n
    return torch.cat(out)


def generate_pool(model, stream: torch.Tensor, T: int, rows: int, prefix_range, amp_dtype,
                  seconds: float, seed: int, log=print, max_rows: int | None = None,
                  mix=((0.0, 1.0),)):
    """Self-generated windows (``sampled_windows``) in chunks of ``rows`` until ``seconds``
    have passed (the first chunk always runs) or ``max_rows`` are made; each chunk draws its
    own prefix length from ``prefix_range`` (lo, hi), so the pool covers short and long
    prompts, and splits its rows over the temperatures of ``mix`` [(temperature, share)]
    (the default: all greedy).  Returns (windows [N, T] int64, prefix lengths [N] int64,
    temperatures [N] float32) on the stream's device."""
    g = torch.Generator(device=stream.device).manual_seed(seed)
    lo, hi = prefix_range
    temps = row_temperatures(mix, rows, stream.device)
    pool, prefixes = [], []
    t0 = time.monotonic()
    made = 0
    while not pool or (time.monotonic() - t0 < seconds
                       and (max_rows is None or made < max_rows)):
        p = int(torch.randint(lo, hi + 1, (1,), generator=torch.Generator().manual_seed(
            seed * 1_000_003 + len(pool))).item())
        w = sampled_windows(model, stream, T, temps, p, amp_dtype, g)
        pool.append(w)
        prefixes.append(torch.full((rows,), p, dtype=torch.long, device=stream.device))
        made += rows
        if len(pool) == 1 or len(pool) % 8 == 0:
            dt = time.monotonic() - t0
            log(f"self-generated: {made} windows ({made * T / 1e6:.2f} M tokens, "
                f"{sum(T - int(x[0]) for x in prefixes) * rows / max(dt, 1e-9) / 1e3:.1f}k "
                f"generated tokens/s) in {dt:.1f} s")
    return torch.cat(pool), torch.cat(prefixes), temps.repeat(len(pool))


# ----------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(drafter: DFlashDrafter, model, tap: FeatureTap, stream: torch.Tensor, T: int,
             amp_dtype, *, windows: int, anchors: int, free_rows: int, gamma: float,
             seed: int = 1234, chunk: int = 64, deadline: float | None = None) -> dict:
    """Held-out measurements of the drafter against the target.

    teacher_forced: ``windows`` consecutive windows of T tokens, ``anchors`` random blocks
      each, labels g(a+k-1) as in training: loss, top-1 and top-4 agreement per slot k.
    free_running: ``free_rows`` windows, one anchor each; the target's own greedy
      continuation g_1..g_{B-1} of the prefix x[0..a] (what a chain round at T = 0 is checked
      against); accepted = the length of the prefix of the drafter's argmaxes that equals it;
      tau = mean(accepted + 1), its histogram, per-depth top-1/top-4 and the acceptance
      rate at depth k given depth k-1 was accepted.
    ``deadline`` (time.monotonic()): no new chunk of windows starts after it (the first of
    each part always runs; the teacher-forced part gets the first 30% of the time left), so
    a call's budget holds whatever the machine's speed; the counts say what was measured."""
    was = drafter.training
    drafter.eval()
    dev, B = stream.device, drafter.B
    g = torch.Generator(device=dev).manual_seed(seed)
    n_win = min(windows, (stream.numel() - 1) // T)
    n_free = min(free_rows, (stream.numel() - 1) // T)
    w = position_weights(B, gamma, dev)
    top1 = torch.zeros(B - 1, device=dev)
    top4 = torch.zeros(B - 1, device=dev)
    loss_sum, n_blocks = 0.0, 0
    t0 = time.monotonic()
    tf_deadline = None if deadline is None else t0 + 0.3 * max(0.0, deadline - t0)
    for i in range(0, n_win, chunk):
        if i and tf_deadline is not None and time.monotonic() > tf_deadline:
            break
        starts = torch.arange(i, min(n_win, i + chunk), device=dev) * T
        ids = gather(stream, starts, T - 1)
        feats, greedy = target_pass(model, tap, ids, amp_dtype)
        anc = random_anchors(ids.shape[0], anchors, T, B, dev, g)
        labels = block_labels(greedy, anc, B)
        with autocast(dev.type, amp_dtype):
            logits = drafter(feats, block_roots(ids, anc), anc)
        loss_sum += weighted_ce(logits, labels, w).item() * labels.shape[0] * labels.shape[1]
        n_blocks += labels.shape[0] * labels.shape[1]
        top1 += (logits.argmax(-1) == labels).flatten(0, 1).sum(0)
        top4 += (logits.topk(4, dim=-1).indices == labels[..., None]).any(-1).flatten(0, 1).sum(0)
    tf = None
    if n_blocks:
        tf = {"blocks": n_blocks, "loss": loss_sum / n_blocks,
              "top1": [round(v, 4) for v in (top1 / n_blocks).tolist()],
              "top4": [round(v, 4) for v in (top4 / n_blocks).tolist()]}
        tf["tau_from_top1"] = round(expected_tau(tf["top1"]), 4)

    acc_len, f_top1, f_top4 = [], torch.zeros(B - 1, device=dev), torch.zeros(B - 1, device=dev)
    # other windows than the teacher-forced ones where the stream has enough
    first = n_win if (stream.numel() - 1) // T >= n_win + n_free else 0
    for i in range(first, first + n_free, chunk):
        if i > first and deadline is not None and time.monotonic() > deadline:
            break
        starts = torch.arange(i, min(first + n_free, i + chunk), device=dev) * T
        ids = gather(stream, starts, T - 1).clone()
        n = ids.shape[0]
        anc = random_anchors(n, 1, T, B, dev, g)                               # [n, 1]
        feats, cont = greedy_continuation(model, tap, ids, anc[:, 0], B - 1, amp_dtype)
        with autocast(dev.type, amp_dtype):
            logits = drafter(feats, block_roots(ids, anc), anc)[:, 0]         # [n, B-1, V]
        draft = logits.argmax(-1)
        match = draft == cont
        acc_len.append(match.long().cumprod(-1).sum(-1))
        f_top1 += match.sum(0)
        f_top4 += (logits.topk(4, dim=-1).indices == cont[..., None]).any(-1).sum(0)
        f_top4.sum().item()            # wait for the device: the deadline is wall time
    fr = None
    if acc_len:
        acc = torch.cat(acc_len)
        n = acc.numel()
        reached = torch.stack([(acc >= k).sum() for k in range(B)])          # depth k tried
        fr = {"rows": n, "tau": round((acc.float() + 1).mean().item(), 4),
              "accepted_hist": torch.bincount(acc, minlength=B).tolist(),
              "top1": [round(v, 4) for v in (f_top1 / n).tolist()],
              "top4": [round(v, 4) for v in (f_top4 / n).tolist()],
              "accept_given_previous": [round(reached[k + 1].item()
                                              / max(1, reached[k].item()), 4)
                                        for k in range(B - 1)]}
        fr["tau_from_top1"] = round(expected_tau(fr["top1"]), 4)
    drafter.train(was)
    return {"teacher_forced": tf, "free_running": fr}


@torch.no_grad()
def evaluate_greedy(drafter: DFlashDrafter, model, tap: FeatureTap, pool: torch.Tensor,
                    prefixes: torch.Tensor, amp_dtype, *, anchors: int, seed: int = 4321,
                    chunk: int = 64) -> dict | None:
    """The drafter on held-out greedy windows (``generate_pool`` on the held-out stream), at
    anchors inside the generated part only: there the target's teacher-forced argmax *is* its
    free-running continuation, so a block's accepted length is the run of slots whose argmax
    equals the label -- the chain round of an engine decoding at T = 0 after a held-out
    prompt, which is what tools/bench_demo.py measures end to end."""
    was = drafter.training
    drafter.eval()
    dev, B = pool.device, drafter.B
    T = pool.shape[1]
    g = torch.Generator(device=dev).manual_seed(seed)
    lens, top1, top4, n = [], torch.zeros(B - 1, device=dev), torch.zeros(B - 1, device=dev), 0
    for i in range(0, pool.shape[0], chunk):
        ids, pre = pool[i:i + chunk], prefixes[i:i + chunk]
        feats, greedy = target_pass(model, tap, ids, amp_dtype)
        anc = random_anchors(ids.shape[0], anchors, T, B, dev, g)
        labels = block_labels(greedy, anc, B)
        with autocast(dev.type, amp_dtype):
            logits = drafter(feats, block_roots(ids, anc), anc)
        keep = (anc >= pre[:, None]).flatten()                  # blocks in the greedy part
        logits, labels = logits.flatten(0, 1)[keep], labels.flatten(0, 1)[keep]
        match = logits.argmax(-1) == labels
        lens.append(match.long().cumprod(-1).sum(-1))
        top1 += match.sum(0)
        top4 += (logits.topk(4, dim=-1).indices == labels[..., None]).any(-1).sum(0)
        n += labels.shape[0]
    drafter.train(was)
    if not n:
        return None
    acc = torch.cat(lens)
    return {"blocks": n, "tau": round((acc.float() + 1).mean().item(), 4),
            "accepted_hist": torch.bincount(acc, minlength=B).tolist(),
            "top1": [round(v, 4) for v in (top1 / n).tolist()],
            "top4": [round(v, 4) for v in (top4 / n).tolist()]}


def target_probs(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """The target's next-token distribution [rows, .., V] (float32) at each row's temperature:
    softmax(logits / t), one-hot on the argmax where t is 0 (greedy)."""
    t = temps.float().view(-1, *([1] * (logits.dim() - 1)))
    hot = t > 0
    soft = (logits.float() / torch.where(hot, t, torch.ones_like(t))).softmax(-1)
    onehot = torch.zeros_like(soft).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(hot, soft, onehot)


@torch.no_grad()
def evaluate_sampled(drafter: DFlashDrafter, model, tap: FeatureTap, pool: torch.Tensor,
                     prefixes: torch.Tensor, temps: torch.Tensor, amp_dtype, *,
                     anchors: int = 4, seed: int = 2468, chunk: int = 64) -> dict:
    """The drafter's chain on held-out windows the target generated at each temperature
    (``generate_pool`` with a mix on the held-out stream), per temperature, in expectation.

    For each row and each of ``anchors`` anchors a inside the generated part (the same ones
    for every drafter: fixed seed): the drafter proposes its argmax chain d_1..d_{B-1} after
    x[..a]; one target pass over x[..a] d_1 .. d_{B-1} gives p_k = P_T(d_k | x[..a], d_<k),
    the target's probability (at the row's temperature; an indicator of its argmax at 0) of
    sampling the drafted token at depth k.  A chain round accepts depth k with probability
    prod_{i<=k} p_i, so the expected tokens per round is tau = 1 + sum_k prod_{i<=k} p_i:
    exact, no sampling noise (at T = 0 it is the measured greedy chain tau).  ``top4_mass``:
    the target's probability mass on the drafter's top 4 at each depth along the drafted
    chain (at depth 1: the chance a 4-wide first tree level holds the target's sample)."""
    was = drafter.training
    drafter.eval()
    dev, B = pool.device, drafter.B
    T = pool.shape[1]
    g = torch.Generator(device=dev).manual_seed(seed)
    steps = torch.arange(B - 1, device=dev)
    sums: dict[float, dict] = {}
    for i in range(0, pool.shape[0], chunk):
        ids, pre, tt = pool[i:i + chunk], prefixes[i:i + chunk], temps[i:i + chunk]
        n = ids.shape[0]
        with autocast(dev.type, amp_dtype):
            model.model(input_ids=ids, use_cache=False)
        feats = tap.features()
        for _ in range(anchors):
            span = (T - B - pre + 1).clamp_min(1)
            anc = (pre + (torch.rand(n, device=dev, generator=g) * span).long()).clamp_max(T - B)
            with autocast(dev.type, amp_dtype):
                logits = drafter(feats, block_roots(ids, anc[:, None]), anc[:, None])[:, 0]
            draft = logits.argmax(-1)                                           # [n, B-1]
            chain = ids.clone()
            chain[torch.arange(n, device=dev)[:, None], anc[:, None] + 1 + steps] = draft
            pos = anc[:, None] + steps                                          # a+k-1
            with autocast(dev.type, amp_dtype):
                h = model.model(input_ids=chain, use_cache=False).last_hidden_state
                tl = model.lm_head(h[torch.arange(n, device=dev)[:, None], pos])
            tap.out.clear()
            p = target_probs(tl, tt)                                            # [n, B-1, V]
            pk = p.gather(-1, draft[..., None])[..., 0]
            reach = pk.cumprod(-1)
            top4 = p.gather(-1, logits.topk(4, dim=-1).indices).sum(-1)
            for t in tt.unique().tolist():
                m = tt == t
                acc = sums.setdefault(t, {"n": 0, "tau": 0.0, "p": 0, "reach": 0, "top4": 0})
                acc["n"] += int(m.sum())
                acc["tau"] += float((1 + reach[m].sum(-1)).sum())
                acc["p"] = acc["p"] + pk[m].sum(0)
                acc["reach"] = acc["reach"] + reach[m].sum(0)
                acc["top4"] = acc["top4"] + top4[m].sum(0)
    drafter.train(was)

    def r(x, n):
        return [round(v, 4) for v in (x / n).tolist()]
    return {f"{t:g}": {"blocks": a["n"], "chain_tau": round(a["tau"] / a["n"], 4),
                       "p_draft": r(a["p"], a["n"]), "reach": r(a["reach"], a["n"]),
                       "top4_mass": r(a["top4"], a["n"])}
            for t, a in sorted(sums.items())}


def _children(tree, n: int) -> list[list[dict]]:
    """Per row, per tree slot: {token: child slot} (a reference.ddtree DraftTree)."""
    kids = [[{} for _ in range(tree.budget + 1)] for _ in range(n)]
    for r in range(n):
        for s in range(1, int(tree.n_nodes[r]) + 1):
            kids[r][int(tree.parent[r, s])][int(tree.token[r, s])] = s
    return kids


@torch.no_grad()
def evaluate_tree(drafter: DFlashDrafter, model, tap: FeatureTap, pool: torch.Tensor,
                  prefixes: torch.Tensor, temps: torch.Tensor, amp_dtype, *, budget: int,
                  anchors: int = 2, seed: int = 1357, chunk: int = 64) -> dict:
    """DDTree's tokens per round at ``budget`` on held-out generated windows, per temperature.

    Per chunk of rows and each of ``anchors`` anchors a (one per chunk, inside every row's
    generated part): the drafter's logits after x[..a] -> top-K log-probs -> the best-first
    tree of ``budget`` nodes (reference.ddtree.build_tree, the engine's contract); then the
    engine's walk with the target's KV cache: at the current node the target's distribution
    P_T (the row's temperature; the argmax at 0) gives the mass m on the node's children,
    a token is drawn from P_T, and the walk descends while the draw is a child.  tau = 1 +
    the sum of m over the visited nodes: an unbiased estimate of 1 + E[accepted] (each step
    succeeds with probability m given the walk so far), exact at T = 0."""
    from reference.ddtree.build import build_tree
    from transformers import DynamicCache
    was = drafter.training
    drafter.eval()
    dev, B = pool.device, drafter.B
    T, V = pool.shape[1], model.config.vocab_size
    g = torch.Generator(device=dev).manual_seed(seed)
    gcpu = np.random.default_rng(seed)
    sums: dict[float, list] = {}
    for i in range(0, pool.shape[0], chunk):
        ids, tt = pool[i:i + chunk], temps[i:i + chunk]
        n, lo = ids.shape[0], int(prefixes[i:i + chunk].max())
        with autocast(dev.type, amp_dtype):
            model.model(input_ids=ids, use_cache=False)
        feats = tap.features()
        for _ in range(anchors):
            a = int(gcpu.integers(lo, max(lo, T - B) + 1))
            anc = torch.full((n, 1), a, device=dev)
            with autocast(dev.type, amp_dtype):
                logits = drafter(feats, ids[:, a:a + 1], anc)[:, 0]              # [n, L, V]
            top = logits.float().log_softmax(-1).topk(min(budget, V), dim=-1)
            tree = build_tree(top.values.cpu().numpy(), top.indices.int().cpu().numpy(),
                              budget)
            kids = _children(tree, n)
            with autocast(dev.type, amp_dtype):
                out = model(input_ids=ids[:, :a + 1], past_key_values=DynamicCache(
                    config=model.config), use_cache=True, logits_to_keep=1)
            tap.out.clear()
            node, alive = [0] * n, [True] * n
            est = torch.ones(n, dtype=torch.float64, device=dev)
            for _depth in range(B - 1):
                last = out.logits[:, -1].float()
                rows = [r for r in range(n) if alive[r] for _ in kids[r][node[r]]]
                toks = [t for r in range(n) if alive[r] for t in kids[r][node[r]]]
                mask = torch.zeros(n, V, device=dev)
                mask[torch.tensor(rows, dtype=torch.long, device=dev),
                     torch.tensor(toks, dtype=torch.long, device=dev)] = 1.0
                est += (target_probs(last, tt) * mask).sum(-1).double()
                drawn = sample_next(last, tt, g)
                for r, y in enumerate(drawn.tolist()):
                    nxt = kids[r][node[r]].get(y) if alive[r] else None
                    alive[r], node[r] = nxt is not None, (nxt or 0)
                if not any(alive):
                    break
                with autocast(dev.type, amp_dtype):
                    out = model(input_ids=drawn[:, None], past_key_values=out.past_key_values,
                                use_cache=True)
                tap.out.clear()
            for t in tt.unique().tolist():
                m = tt == t
                acc = sums.setdefault(t, [0, 0.0])
                acc[0] += int(m.sum())
                acc[1] += float(est[m].sum())
    drafter.train(was)
    return {f"{t:g}": {"blocks": n_, "tau": round(tot / n_, 4)}
            for t, (n_, tot) in sorted(sums.items())}


@torch.no_grad()
def greedy_continuation(model, tap: FeatureTap, ids: torch.Tensor, anchors: torch.Tensor,
                        n: int, amp_dtype):
    """The target's greedy tokens after x[0..a] for each row (a = anchors[row]), written into
    ``ids`` in place at a+1 .. a+n-1 as they are chosen; returns (the features of the first
    pass [bs, T, k*D] -- positions < a are the true prefix's -- and the n tokens [bs, n]).
    Every pass runs the whole window: the model is causal, so what lies after the position
    read does not matter."""
    rows = torch.arange(ids.shape[0], device=ids.device)
    out = []
    feats = None
    for k in range(n):
        with autocast(ids.device.type, amp_dtype):
            h = model.model(input_ids=ids, use_cache=False).last_hidden_state
            nxt = model.lm_head(h[rows, anchors + k]).argmax(-1)
        if feats is None:
            feats = tap.features()
        else:
            tap.out.clear()
        out.append(nxt)
        if k + 1 < n:
            ids[rows, anchors + k + 1] = nxt
    return feats, torch.stack(out, dim=1)

