"""A dependency-free progress bar for long loops (rank 0 only)."""
from __future__ import annotations

import sys
import time


class ProgressBar:
    """`\\r`-redrawn bar on a terminal; elsewhere (logs, CI) a line every ~10%, or with
    `lines=False` one line when it closes."""

    def __init__(self, total: int, label: str = "", stream=None, width: int = 30, lines: bool = True):
        self.total, self.label, self.width = max(1, total), label, width
        self.lines = lines
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self.done = 0
        self._last_decile = -1
        self.suffix = ""

    def update(self, n: int = 1, suffix: str | None = None) -> None:
        self.done = min(self.total, self.done + n)
        if suffix is not None:
            self.suffix = suffix
        frac = self.done / self.total
        if self.tty:
            self._draw(frac, end="")
        elif self.lines and int(frac * 10) != self._last_decile:
            self._last_decile = int(frac * 10)
            self._draw(frac, end="\n")

    def _draw(self, frac: float, end: str) -> None:
        filled = int(frac * self.width)
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        bar = "#" * filled + "-" * (self.width - filled)
        prefix = "\r\033[K" if self.tty else ""
        self.stream.write(f"{prefix}{self.label} [{bar}] {self.done}/{self.total} "
                          f"{rate:.1f} it/s {self.suffix}{end}")
        self.stream.flush()

    def write(self, line: str, out=None) -> None:
        """Print a result line to `out` (default stdout) above the bar without garbling it."""
        out = out or sys.stdout
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()
        out.write(line + "\n")
        out.flush()
        if self.tty:
            self._draw(self.done / self.total, end="")

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
        elif not self.lines:
            self._draw(self.done / self.total, end="\n")
