"""Progress on stderr for long reads, writes and conversions, one helper for every tool.

    bar = ProgressBar("convert", force=args.progress)   # bytes; silent unless forced or a TTY
    try:
        to_hdf5(src, dst, progress=bar)                 # converters call progress(done, total)
    finally:
        bar.close()

    with ProgressBar("import", total=len(names), unit="tensor") as bar:
        for name in names:
            ...
            bar.update(1)

A bar is drawn only when stderr is a terminal or ``force`` is set; otherwise every call returns
at once and nothing is written.  tqdm draws it where it is installed (an optional extra, not a
dependency); without tqdm a ``\\r`` line shows the percentage, the count and the rate.  The
converters and ``File.verify`` take any ``progress(done, total)`` callable (``Progress``);
``ticker`` turns the per-block counts they see into such calls.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

__all__ = ["Progress", "ProgressBar", "ticker", "human_bytes"]

Progress = Callable[[int, int], None]   # progress(done, total), in the bar's unit


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def ticker(total: int, progress: Progress | None) -> Callable[[int], None]:
    """``tick(n)``: add ``n`` to a running count and call ``progress(count, total)`` (a tick
    that only counts where ``progress`` is None)."""
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)
    return tick


class ProgressBar:
    """A progress bar on stderr for ``total`` things of ``unit`` ("B": bytes, shown scaled).

    Call it as ``bar(done, total)`` (a ``Progress`` callback) or step it with
    ``bar.update(n)``; ``close()`` (or leaving a ``with`` block) ends the line.  ``force``
    draws it even when stderr is not a terminal (a log file, a pipe); otherwise it is silent
    there.  ``total`` may be unknown (None) until the first call."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "B", *,
                 force: bool = False):
        self.desc, self.total, self.unit = desc, total, unit
        self.enabled = force or sys.stderr.isatty()
        self.done = 0
        self._bar, self._last = None, -1
        self._t0: float | None = None   # first call: the fallback line's rate counts from it

    def __call__(self, done: int, total: int | None) -> None:
        self.done, self.total = done, total
        if not self.enabled:
            return
        if self._bar is None:
            try:
                from tqdm import tqdm
                scaled = self.unit == "B"
                self._bar = tqdm(total=total, unit=self.unit, unit_scale=scaled,
                                 unit_divisor=1024 if scaled else 1000,
                                 desc=self.desc, file=sys.stderr, leave=False)
            except ImportError:
                self._bar = False
        if self._bar:
            self._bar.total = total
            self._bar.update(done - self._bar.n)
            return
        count = human_bytes(done) if self.unit == "B" else f"{done} {self.unit}"
        if total is None:   # no percentage to show: the count, each time it changes
            if done != self._last:
                self._last = done
                sys.stderr.write(f"\r{self.desc}: {count}")
                sys.stderr.flush()
            return
        pct = 100 if total == 0 else int(100 * done / total)
        if self._t0 is None:
            self._t0 = time.perf_counter()
        if pct != self._last:
            self._last = pct
            shown = human_bytes(done) if self.unit == "B" else f"{done}/{total} {self.unit}"
            elapsed = time.perf_counter() - self._t0
            if elapsed > 0 and done:
                rate = done / elapsed
                shown += (f", {human_bytes(int(rate))}/s" if self.unit == "B"
                          else f", {rate:.1f} {self.unit}/s")
            sys.stderr.write(f"\r{self.desc}: {pct:3d}% ({shown})")
            sys.stderr.flush()

    def update(self, n: int = 1) -> None:
        """Count ``n`` more (of the ``total`` given when the bar was made)."""
        self(self.done + n, self.total)

    def close(self) -> None:
        if self._bar:
            self._bar.close()
        elif self._bar is False:
            sys.stderr.write("\n")
        self._bar = None

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
