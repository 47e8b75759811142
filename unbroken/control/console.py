"""The launcher's console and what a worker prints: torchrun's ``--tee`` for the group's leader.

Owns the channel both ends share: a pipe the launcher (or a host's agent) creates and every worker it starts
inherits (``UNBROKEN_CONSOLE=<fd>:<speaks before joining: 1|0>``). A worker's stdout stays its log file
(``logs/worker-N.log``: every worker's prints are kept there); ``ConsoleTee`` wraps the worker's
``sys.stdout`` and also writes each complete line to the pipe while the worker speaks for the job: while it
leads the group (``ctx.rank == 0``), or, before the group forms, if it is worker 0 on its first start. The
worker decides per line, so when the leader changes the console follows it from its first line as leader.
The write end is non-blocking: a line the pipe has no room for is dropped from the console (never from the
log), so training never waits for the console. ``ConsoleRelay`` is the launcher's end: it drains the pipe into
lines for the progress view to print above its bar.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

CONSOLE_ENV = "UNBROKEN_CONSOLE"
_PIPE_BUF = 4096  # writes up to this size are atomic on a pipe: lines of two workers never interleave
_MAX_LINE = 1 << 16


class ConsoleRelay:
    """The launcher's end: a pipe whose write end the workers inherit; ``drain`` gives the lines written."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)  # a full pipe drops a console line, never stalls a worker
        self._partial = b""

    def env(self, speaks_before_joining: bool) -> str:
        """The value of ``UNBROKEN_CONSOLE`` for a worker (``pass_fds`` must include ``write_fd``)."""
        return f"{self.write_fd}:{1 if speaks_before_joining else 0}"

    def drain(self) -> list[str]:
        """The complete lines written since the last call (without their newlines)."""
        chunks = [self._partial]
        while True:
            try:
                chunk = os.read(self.read_fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        data = b"".join(chunks)
        *lines, self._partial = data.split(b"\n")
        return [line.decode(errors="replace") for line in lines]

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


class ConsoleTee:
    """A worker's ``sys.stdout``: everything to the original stream (its log); complete lines also to the
    console pipe while ``speaking()`` says so."""

    def __init__(self, out: TextIO, fd: int, speaking: Callable[[], bool]) -> None:
        self._out = out
        self._fd = fd
        self.speaking = speaking
        self._line = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        n = self._out.write(text)
        with self._lock:
            *lines, rest = (self._line + text).split("\n")
            self._line = rest[-_MAX_LINE:]  # a line that never ends (a \r progress bar) keeps only its tail
        if lines and self._speaks():
            for line in lines:
                self._send((line + "\n").encode(errors="replace"))
        return n

    def _speaks(self) -> bool:
        try:
            return bool(self.speaking())
        except Exception:  # noqa: BLE001 - a print must never fail because of the console
            return False

    def _send(self, data: bytes) -> None:
        for start in range(0, len(data), _PIPE_BUF):
            try:
                os.write(self._fd, data[start : start + _PIPE_BUF])
            except OSError:  # full (non-blocking), or the launcher is gone: the log has the line
                return

    def flush(self) -> None:
        self._out.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)  # fileno, encoding, isatty, buffer, ...


def install_tee(speaking: Callable[[bool], bool]) -> ConsoleTee | None:
    """In a worker started with ``UNBROKEN_CONSOLE``: wrap ``sys.stdout`` in a ``ConsoleTee`` whose lines reach
    the console when ``speaking(speaks_before_joining)`` is true. None (nothing changed) without it."""
    value = os.environ.get(CONSOLE_ENV, "")
    fd_text, _, early = value.partition(":")
    if not fd_text.isdigit():
        return None
    if isinstance(sys.stdout, ConsoleTee):
        return sys.stdout
    before_joining = early == "1"
    tee = ConsoleTee(sys.stdout, int(fd_text), lambda: speaking(before_joining))
    sys.stdout = tee  # type: ignore[assignment]
    return tee
