"""Batches, the learning-rate schedule, the train step, held-out evaluation and the loop.

The schedule runs on training *seconds*, not steps: a chain of device calls whose speed is
not known in advance (the call's start, the corpus build and the machine vary) still ends
with the learning rate at its floor exactly when the planned training time is spent.
Warm-up is in steps (the first ones, whatever their speed).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class TrainState:
    """What the checkpoint carries besides tensors; ``epoch``/``cursor`` are the data
    position (WindowSampler)."""
    step: int = 0
    tokens: int = 0
    trained_s: float = 0.0
    epoch: int = 0
    cursor: int = 0
    history: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class WindowSampler:
    """Windows of seq_len + 1 tokens from the flat train stream, taken in a fresh random order
    each epoch; the window grid moves by 131 tokens per epoch so the cut points differ."""

    def __init__(self, n_tokens: int, seq_len: int, seed: int, epoch: int = 0, cursor: int = 0):
        self.n_tokens, self.seq_len, self.seed = n_tokens, seq_len, seed
        self.epoch, self.cursor = epoch, cursor
        self._order()

    def _order(self) -> None:
        T = self.seq_len
        self.offset = (131 * self.epoch) % T
        n_windows = (self.n_tokens - 1 - self.offset) // T
        if n_windows < 1:
            raise ValueError(f"the train stream ({self.n_tokens} tokens) holds no window of {T}")
        self.perm = np.random.default_rng([self.seed, self.epoch]).permutation(n_windows)

    def next_starts(self, batch: int) -> np.ndarray:
        if batch > self.perm.size:
            raise ValueError(f"batch {batch} > {self.perm.size} windows in an epoch")
        if self.cursor + batch > self.perm.size:      # the epoch's remainder is dropped
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order()
        idx = self.perm[self.cursor:self.cursor + batch]
        self.cursor += batch
        return self.offset + idx.astype(np.int64) * self.seq_len

    def next_starts_on(self, batch: int, device) -> torch.Tensor:
        """next_starts as a slice of the epoch's start offsets kept on ``device``: copied
        once an epoch, since a copy from pageable host memory waits for the GPU's queue."""
        self.next_starts(batch)
        key = (self.epoch, str(device))
        if getattr(self, "_device_key", None) != key:
            starts = self.offset + self.perm.astype(np.int64) * self.seq_len
            self._device_starts = torch.from_numpy(starts).to(device)
            self._device_key = key
        return self._device_starts[self.cursor - batch:self.cursor]


def gather(stream: torch.Tensor, starts, seq_len: int) -> torch.Tensor:
    """[B, seq_len + 1] token ids (int64) from a device stream."""
    starts = torch.as_tensor(starts, device=stream.device)
    idx = starts[:, None] + torch.arange(seq_len + 1, device=stream.device)
    return stream[idx].long()


def lr_at(step: int, progress: float, peak: float, warmup_steps: int, floor: float) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine from ``peak`` to ``floor * peak`` as
    ``progress`` (trained seconds / planned seconds) goes from 0 to 1."""
    warm = min(1.0, (step + 1) / max(1, warmup_steps))
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    return peak * warm * (floor + (1.0 - floor) * cos)


def make_optimizer(model, lr: float, weight_decay: float, beta2: float):
    """AdamW; weight decay on matrices only (norm weights and 1-D tensors are left alone)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, beta2), eps=1e-8, fused=fused)


def autocast(device_type: str, amp_dtype):
    return torch.autocast(device_type=device_type, dtype=amp_dtype or torch.float32,
                          enabled=amp_dtype is not None)


def next_token_logits(model, x: torch.Tensor, amp_dtype) -> torch.Tensor:
    with autocast(x.device.type, amp_dtype):
        return model(input_ids=x, use_cache=False).logits


def train_step(model, opt, batch: torch.Tensor, lr: float, clip: float, amp_dtype):
    """One AdamW step on [B, T + 1] ids; returns the (device) loss and gradient norm."""
    for g in opt.param_groups:
        g["lr"] = lr
    x, y = batch[:, :-1], batch[:, 1:]
    logits = next_token_logits(model, x, amp_dtype)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach(), gnorm


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq_len: int, batch: int, amp_dtype,
             max_windows: int | None = None) -> dict | None:
    """Mean next-token loss (nats) and top-1 accuracy over consecutive windows of the held-out
    stream (each window starts with an empty context)."""
    n = (stream.numel() - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        return None
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=stream.device)
    correct = torch.zeros((), dtype=torch.int64, device=stream.device)
    for i in range(0, n, batch):
        starts = torch.arange(i, min(n, i + batch), device=stream.device) * seq_len
        b = gather(stream, starts, seq_len)
        x, y = b[:, :-1], b[:, 1:]
        logits = next_token_logits(model, x, amp_dtype).float()
        loss_sum += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                    reduction="sum").double()
        correct += (logits.argmax(-1) == y).sum()
    model.train(was_training)
    tokens = n * seq_len
    return {"loss": loss_sum.item() / tokens, "top1": correct.item() / tokens, "tokens": tokens}


@dataclass
class LoopConfig:
    seq: int
    batch: int
    lr: float
    min_lr_frac: float
    warmup_steps: int
    clip: float
    total_s: float
    print_every_s: float
    eval_every_s: float
    eval_windows: int
    eval_batch: int


def fit_schedule(lc: LoopConfig, st: TrainState, stop_at: float, log) -> None:
    """--finish: if the planned training time left does not fit in this call, shorten the plan
    so the cosine reaches its floor by the end of the call (the LR steps down once, a little,
    instead of the run ending half-way down the schedule)."""
    # 3% + 2 s of the wall time go to periodic evaluations, which are not training time
    available = 0.97 * (stop_at - time.monotonic()) - 2.0
    if lc.total_s - st.trained_s > available:
        old = lc.total_s
        lc.total_s = st.trained_s + max(0.0, available)
        log(f"--finish: planned training {old / 60:.2f} -> {lc.total_s / 60:.2f} min to end "
            f"in this call")


def train(model, opt, balancer, sampler: WindowSampler, train_stream, heldout_stream,
          st: TrainState, lc: LoopConfig, amp_dtype, stop_at: float, should_stop,
          log=print) -> bool:
    """Train until the planned time is spent (returns True: finished) or this call's time is
    up / a stop was asked for (returns False: checkpoint and resume)."""
    model.train()
    dev = train_stream.device
    loss_acc = torch.zeros((), device=dev)
    acc = {"n": 0, "tokens": st.tokens, "trained_s": st.trained_s, "lr": 0.0}
    t_report = t_eval = t_prev = time.monotonic()

    def report() -> None:
        """A progress line over the steps since the last one (syncs the device)."""
        nonlocal t_prev, t_report
        mean_loss = loss_acc.item() / acc["n"]        # syncs: the queued steps finish ...
        imbalance = balancer.imbalance()
        t_prev = _count_time(st, t_prev)              # ... and count as training time
        row = {"step": st.step, "tokens": st.tokens, "trained_s": round(st.trained_s, 1),
               "loss": round(mean_loss, 4), "lr": acc["lr"],
               "tok_s": round((st.tokens - acc["tokens"])
                              / max(1e-9, st.trained_s - acc["trained_s"])),
               "moe_max_over_mean": round(imbalance, 3), "epoch": st.epoch}
        st.history.append(row)
        log(f"step {row['step']:6d} | {row['tok_s'] / 1e3:7.1f}k tok/s | loss "
            f"{row['loss']:.4f} | lr {row['lr']:.2e} | moe max/mean {imbalance:.2f}"
            f" | epoch {st.epoch} | trained {st.trained_s / 60:.2f} of "
            f"{lc.total_s / 60:.2f} min")
        loss_acc.zero_()
        acc.update(n=0, tokens=st.tokens, trained_s=st.trained_s)
        t_report = t_prev

    while True:
        progress = st.trained_s / lc.total_s
        done = progress >= 1.0
        if done or should_stop() or time.monotonic() >= stop_at:
            if acc["n"]:
                report()
            return done
        lr = acc["lr"] = lr_at(st.step, progress, lc.lr, lc.warmup_steps, lc.min_lr_frac)
        batch = gather(train_stream, sampler.next_starts_on(lc.batch, dev), lc.seq)
        loss, _ = train_step(model, opt, batch, lr, lc.clip, amp_dtype)
        balancer.update()
        loss_acc += loss
        acc["n"] += 1
        st.step += 1
        st.tokens += lc.batch * lc.seq
        st.epoch, st.cursor = sampler.epoch, sampler.cursor
        t_prev = _count_time(st, t_prev)
        if t_prev - t_report >= lc.print_every_s:
            report()
        if t_prev - t_eval >= lc.eval_every_s:
            _sync(train_stream.device)
            t_prev = _count_time(st, t_prev)
            ev = evaluate(model, heldout_stream, lc.seq, lc.eval_batch, amp_dtype,
                          lc.eval_windows)
            if ev is not None:
                st.history.append({"step": st.step, "heldout_loss": round(ev["loss"], 4),
                                   "heldout_top1": round(ev["top1"], 4),
                                   "heldout_tokens": ev["tokens"]})
                log(f"step {st.step:6d} | held-out loss {ev['loss']:.4f} | top-1 "
                    f"{ev['top1']:.4f} ({ev['tokens']} tokens)")
            t_eval = t_prev = time.monotonic()               # evaluation is not training time


def _count_time(st: TrainState, t_prev: float) -> float:
    now = time.monotonic()
    st.trained_s += now - t_prev
    return now


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
