"""Progress of ``unbroken prepare``: a live bar on a terminal, plain periodic lines otherwise.

Owns showing documents, tokens, tokens/s and the time left (estimated from the input bytes read) while a
preparation runs. The bar is drawn by ``rich`` on stderr when stderr is a terminal; elsewhere (a log file, a
CI job, a test) one line is written every ``interval_s`` seconds and one at the end. It computes nothing
about the data.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

MODES = ("auto", "bar", "lines", "none")


def _eta(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


class Progress:
    """Shows a preparation's progress. Use as a context manager; call ``update`` as often as convenient.

    Args:
        total_bytes: input bytes on disk (the ETA is the share of them read so far).
        mode: ``auto`` (a bar on a terminal, else lines), ``bar``, ``lines`` or ``none``.
        interval_s: seconds between plain lines.
        stream: where to write (default stderr).
    """

    def __init__(
        self, total_bytes: int, mode: str = "auto", interval_s: float = 10.0, stream: IO[str] | None = None
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"--progress {mode} is not allowed; allowed: {', '.join(MODES)}")
        self.stream = stream if stream is not None else sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode = mode
        self.total_bytes = max(1, total_bytes)
        self.interval_s = interval_s
        self.start = time.monotonic()
        self._last_line = self.start
        self._state = (0, 0, 0)
        self._first_tokens: int | None = None  # tokens already done when this run started (a resume)
        self._bar: Any = None
        self._task: Any = None
        self._closed = False

    def __enter__(self) -> Progress:
        if self.mode == "bar":
            from rich.console import Console
            from rich.progress import BarColumn, TaskProgressColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("prepare"),
                BarColumn(),
                TaskProgressColumn(),
                TextColumn("{task.fields[docs]} docs, {task.fields[tokens]} tokens, {task.fields[rate]} tok/s"),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("prepare", total=self.total_bytes, docs="0", tokens="0", rate="-")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(final=exc[0] is None)

    def rate(self) -> float:
        """Tokens per second made by this run."""
        docs, tokens, done = self._state
        elapsed = time.monotonic() - self.start
        return (tokens - (self._first_tokens or 0)) / elapsed if elapsed > 0 else 0.0

    def update(self, docs: int, tokens: int, done_bytes: int) -> None:
        """The totals so far: documents, tokens and input bytes read."""
        if self._first_tokens is None:
            self._first_tokens = tokens
        self._state = (docs, tokens, min(done_bytes, self.total_bytes))
        if self.mode == "bar" and self._bar is not None:
            self._bar.update(
                self._task,
                completed=self._state[2],
                docs=f"{docs:,}",
                tokens=_count(tokens),
                rate=_count(self.rate()),
            )
        elif self.mode == "lines":
            now = time.monotonic()
            if now - self._last_line >= self.interval_s:
                self._last_line = now
                self._line()

    def _line(self, final: bool = False) -> None:
        docs, tokens, done = self._state
        elapsed = time.monotonic() - self.start
        share = done / self.total_bytes
        if final:
            tail = f"done in {_eta(elapsed)}"
        else:
            left = elapsed * (1 - share) / share if share > 0 else float("inf")
            tail = f"{share:.1%} of input, ETA {_eta(left)}"
        print(
            f"prepare: {docs:,} docs, {_count(tokens)} tokens, {_count(self.rate())} tok/s, {tail}",
            file=self.stream,
            flush=True,
        )

    def close(self, final: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            if final:
                self._bar.update(self._task, completed=self.total_bytes)
            self._bar.stop()
            self._bar = None
        elif self.mode == "lines" and final:
            self._line(final=True)
