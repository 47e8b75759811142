"""The launcher's console and what a worker prints: torchrun's ``--tee`` for the group's leader, and the order in
which the console tells a run's story.

Owns the channel both ends share: a pipe the launcher (or a host's agent) creates and every worker it starts
inherits (``UNBROKEN_CONSOLE=<fd>:<speaks before joining: 1|0>``). A worker's stdout stays its log file
(``logs/worker-N.log``: every worker's prints are kept there); ``ConsoleTee`` wraps the worker's
``sys.stdout`` and also writes each complete line to the pipe while the worker speaks for the job: while it
leads the group (``ctx.rank == 0``), or, before the group forms, if it is worker 0 on its first start. The
worker decides per line, so when the leader changes the console follows it from its first line as leader.
The write end is non-blocking: a line the pipe has no room for is dropped from the console (never from the
log), so training never waits for the console. ``ConsoleRelay`` is the launcher's end: it drains the pipe into
lines for the progress view to print above its bar.

The wire format of a line on the pipe (``encode_line`` / ``decode_line``): ``<worker> <step> <text>\\n``, the
worker's id (``-`` if it has none yet) and the step it was in, or had just committed, when it printed the line
(-1 before its first step). The console shows a line as ``[worker N] <text>``.

``Story`` puts the console's lines in the order of the run: the launcher's lines come from the metrics records
(``control.status.progress``), which reach the launcher later than the leader's prints and from two writers (the
leader's records through the coordinator, the coordinator's own at once). A leader's line is held until the
records of its step have been shown; a line about a re-formation (a failure, a new epoch, a worker's error)
until the group's records reach that epoch. Nothing is held for ever: the run's end, a stop, a new session, or
``HOLD_S`` without any new record (a long step, a stuck group) release everything held, in order.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, TextIO

CONSOLE_ENV = "UNBROKEN_CONSOLE"
_PIPE_BUF = 4096  # writes up to this size are atomic on a pipe: lines of two workers never interleave
_MAX_LINE = 1 << 16
HOLD_S = 5.0  # a held line waits at most this long without a new record (seconds of the launcher's clock)


@dataclass(frozen=True)
class LeaderLine:
    """A line the group's leader printed: who, in which step (-1 before its first), and the text."""

    worker: int | None
    step: int
    text: str

    def shown(self) -> str:
        """The line as the console shows it: ``[worker 0] text`` (``[leader]`` for a worker without an id)."""
        who = "leader" if self.worker is None else f"worker {self.worker}"
        return f"[{who}] {self.text}"


def encode_line(worker: int | None, step: int, text: str) -> bytes:
    """A line on the console pipe (``text`` without a newline)."""
    return f"{'-' if worker is None else worker} {step} {text}\n".encode(errors="replace")


def decode_line(raw: bytes) -> LeaderLine:
    """The line ``encode_line`` wrote (without its newline); anything else is the text of a line of no step."""
    text = raw.decode(errors="replace")
    worker, step, rest = (text.split(" ", 2) + ["", ""])[:3]
    if (worker == "-" or worker.isdigit()) and step.lstrip("-").isdigit() and text.count(" ") >= 2:
        return LeaderLine(None if worker == "-" else int(worker), int(step), rest)
    return LeaderLine(None, -1, text)


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

    def drain_lines(self) -> list[LeaderLine]:
        """The complete lines written since the last call."""
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
        return [decode_line(line) for line in lines]

    def drain(self) -> list[str]:
        """The complete lines written since the last call, as the console shows them (``[worker N] text``)."""
        return [line.shown() for line in self.drain_lines()]

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


class ConsoleTee:
    """A worker's ``sys.stdout``: everything to the original stream (its log); complete lines also to the
    console pipe while ``speaking()`` says so, tagged with ``place()``: (worker id, step)."""

    def __init__(
        self, out: TextIO, fd: int, speaking: Callable[[], bool], place: Callable[[], tuple[int | None, int]]
    ) -> None:
        self._out = out
        self._fd = fd
        self.speaking = speaking
        self.place = place
        self._line = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        n = self._out.write(text)
        with self._lock:
            *lines, rest = (self._line + text).split("\n")
            self._line = rest[-_MAX_LINE:]  # a line that never ends (a \r progress bar) keeps only its tail
        if lines and self._speaks():
            worker, step = self._place()
            for line in lines:
                self._send(encode_line(worker, step, line))
        return n

    def _speaks(self) -> bool:
        try:
            return bool(self.speaking())
        except Exception:  # noqa: BLE001 - a print must never fail because of the console
            return False

    def _place(self) -> tuple[int | None, int]:
        try:
            return self.place()
        except Exception:  # noqa: BLE001 - a print must never fail because of the console
            return None, -1

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


def install_tee(
    speaking: Callable[[bool], bool], place: Callable[[], tuple[int | None, int]] = lambda: (None, -1)
) -> ConsoleTee | None:
    """In a worker started with ``UNBROKEN_CONSOLE``: wrap ``sys.stdout`` in a ``ConsoleTee`` whose lines reach
    the console when ``speaking(speaks_before_joining)`` is true, tagged with ``place()``: the worker's id and the
    step it is in or has just committed (-1 before its first). None (nothing changed) without it."""
    value = os.environ.get(CONSOLE_ENV, "")
    fd_text, _, early = value.partition(":")
    if not fd_text.isdigit():
        return None
    if isinstance(sys.stdout, ConsoleTee):
        return sys.stdout
    before_joining = early == "1"
    tee = ConsoleTee(sys.stdout, int(fd_text), lambda: speaking(before_joining), place)
    sys.stdout = tee  # type: ignore[assignment]
    return tee


class Channel(Enum):
    """Where a console line goes."""

    PROGRESS = "progress"  # the launcher's own lines (stdout; not under --quiet)
    SCRIPT = "script"  # the leader's prints (stdout, always)
    ERROR = "error"  # warnings and a worker's error (stderr, always)


@dataclass
class _Held:
    text: str
    channel: Channel
    epoch: int  # shown once the group's records reach this epoch
    step: int | None  # or once they reach this step
    rank: int  # among the lines of one epoch: what happened first (an error, a failure) before the new epoch


class Story:
    """The console's lines in the order of the run, out through ``emit(text, channel)``.

    The caller (``control.status.progress.ProgressView``) says what it learns from the records in their order:
    ``reached(step=, epoch=)`` for a step or re-formation record, ``heard()`` for any record, ``new_session()``
    for a new session's first record; and hands over lines: ``say`` (the launcher's, at once or held until an
    epoch) and ``script`` (the leader's, held until its step). ``tick()`` releases everything once ``hold_s``
    passed without a record; ``release_all()`` at the end. Lines are never dropped, and each kind keeps its
    order: the leader's lines in the order printed, the held launcher lines by epoch."""

    def __init__(
        self, emit: Callable[[str, Channel], None], clock: Callable[[], float] = time.monotonic, hold_s: float = HOLD_S
    ) -> None:
        self.emit = emit
        self.clock = clock
        self.hold_s = hold_s
        self.step = -1  # the newest step whose record was shown (this session)
        self.epoch = 0  # the newest epoch the group's records reached (this session)
        self._script: list[LeaderLine] = []  # the leader's lines not shown yet, in the order printed
        self._held: list[_Held] = []  # the launcher's lines waiting for an epoch, in the order said
        self._heard_at = clock()

    def heard(self) -> None:
        """A record arrived (any kind): the run is not silent."""
        self._heard_at = self.clock()

    def say(
        self,
        text: str,
        channel: Channel = Channel.PROGRESS,
        epoch: int | None = None,
        step: int | None = None,
        rank: int = 0,
    ) -> None:
        """A launcher line: shown now, or once the group's records reach ``epoch`` or, if given, ``step`` (after
        the lines held for earlier epochs, and among one epoch's lines by ``rank``)."""
        if epoch is None or epoch <= self.epoch or (step is not None and step <= self.step):
            self.emit(text, channel)
        else:
            self._held.append(_Held(text, channel, epoch, step, rank))

    def script(self, line: LeaderLine) -> None:
        """A line the leader printed: shown once the records of its step were shown."""
        self._script.append(line)
        self._release_script()

    def reached(self, step: int | None = None, epoch: int | None = None) -> None:
        """A record of the group's: it re-formed into ``epoch`` (a recovery record) or committed ``step`` in
        ``epoch`` (a step record, shown by the caller just before this call)."""
        self.epoch = max(self.epoch, epoch if epoch is not None else self.epoch)
        self.step = max(self.step, step if step is not None else self.step)
        due: list[_Held] = []
        waiting: list[_Held] = []
        for held in self._held:
            reached = held.epoch <= self.epoch or (held.step is not None and held.step <= self.step)
            (due if reached else waiting).append(held)
        self._held = waiting
        for held in sorted(due, key=lambda h: (h.epoch, h.rank)):
            self.emit(held.text, held.channel)
        self._release_script()

    def new_session(self) -> None:
        """A new session began (a new coordinator without a journal: a resume, a restart-policy relaunch): its
        steps and epochs count anew; what the last one left held is shown."""
        self.release_all()
        self.step, self.epoch = -1, 0

    def tick(self) -> None:
        """Release everything held once ``hold_s`` passed without a new record (a long step, a stuck group)."""
        if (self._script or self._held) and self.clock() - self._heard_at >= self.hold_s:
            self.release_all()

    def release_all(self) -> None:
        """Everything held, now: the launcher's held lines by epoch, then the leader's."""
        held, self._held = sorted(self._held, key=lambda h: (h.epoch, h.rank)), []
        for h in held:
            self.emit(h.text, h.channel)
        script, self._script = self._script, []
        for line in script:
            self.emit(line.shown(), Channel.SCRIPT)

    def _release_script(self) -> None:
        while self._script and self._script[0].step <= self.step:
            self.emit(self._script.pop(0).shown(), Channel.SCRIPT)
