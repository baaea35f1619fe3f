"""What a run prints while it works: start-up phases with their times, and its progress.

Start-up lines go to stdout (`marsi: Ray started (2.1 s)`), so stderr holds only warnings and errors and a
failing command's stderr stays its one error line. Progress is tqdm's bar on a terminal; piped or redirected
to a file, a plain line every `every` steps (and at the last) instead of a stream of `\\r` fragments.
"""

from __future__ import annotations

import sys
import time


def phase(message: str, seconds: float) -> None:
    """One start-up phase done: `marsi: MESSAGE (S s)` on stdout, at once."""
    print(f"marsi: {message} ({seconds:.1f} s)", flush=True)


class PlainProgress:
    """The progress bar's interface (update, set_postfix, reset, close) as a line every `every` steps."""

    def __init__(self, total: int, initial: int, every: int | None = None, stream=None):
        self.total, self.n, self.postfix = total, initial, ""
        self.every = every or max(1, round((total - initial) / 20))
        self.stream = stream or sys.stderr
        self.began, self.first = time.perf_counter(), initial

    def update(self, n: int = 1) -> None:
        self.n += n
        if n and (self.n % self.every == 0 or self.n == self.total):
            rate = (time.perf_counter() - self.began) / max(1, self.n - self.first)
            print(f"marsi: step {self.n}/{self.total}{self.postfix} ({rate:.2f} s/step)", file=self.stream, flush=True)

    def set_postfix(self, **values) -> None:
        self.postfix = "".join(f", {k} {v}" for k, v in values.items())

    def reset(self, total: int | None = None) -> None:
        self.total = self.total if total is None else total
        self.n = self.first = 0
        self.began = time.perf_counter()

    def close(self) -> None:
        pass


def progress(done: int, total: int, enabled: bool, terminal: bool | None = None):
    """tqdm's bar on a terminal, `PlainProgress` lines otherwise, nothing when not `enabled`."""
    from tqdm import tqdm

    terminal = sys.stderr.isatty() if terminal is None else terminal
    if enabled and not terminal:
        return PlainProgress(total, done)
    return tqdm(total=total, initial=done, disable=not enabled, unit="step", dynamic_ncols=True)


def say(message: str) -> None:
    """A warning or a recovery note: `marsi: MESSAGE` on stderr, at once."""
    print(f"marsi: {message}", file=sys.stderr, flush=True)
