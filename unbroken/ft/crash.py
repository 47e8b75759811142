"""A worker that dies of a Python exception: the report it sends the coordinator before it ends.

Owns what a worker says about an exception nothing caught (``sys.excepthook``, set by ``api.Context``): the
exception's type and message, its place (the innermost frame of the user's code: not this library's
``ft``, ``control`` or ``core``, not the standard library, not an installed package such as torch), where in
the protocol it was raised (``records.ErrorPhase``, the step and the microbatch, which ``api`` knows) and the
traceback's last frames, as a ``records.WorkerError``. The hook prints the traceback as Python would (into
the worker's log), sends the report, and ends the process with status 1 at once, without waiting for helper
threads. The coordinator records the report, removes the worker and tells a bug from a failing host
(``control.coordinator.bugs``); the launcher shows the traceback on its console.
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from unbroken.core.records import ErrorPhase, WorkerError

log = logging.getLogger(__name__)

EXIT_RAISED = 1  # what Python exits with after an uncaught exception
TAIL_FRAMES = 6  # frames of the traceback the report keeps (the innermost ones)
MESSAGE_CHARS = 300

_PACKAGE = Path(__file__).resolve().parent.parent
# Not the user's code: this library's layers (the built-in trainer, ``unbroken/train``, is a user of it), the
# standard library and installed packages.
_NOT_USER = tuple(
    str(Path(p).resolve()) + os.sep
    for p in (
        *(_PACKAGE / layer for layer in ("ft", "control", "core")),
        *{sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")},
    )
)


def is_user_file(filename: str) -> bool:
    """Whether ``filename`` (a frame's) holds the user's code."""
    if filename.startswith("<"):  # <frozen ...>, <string>: no file of the user's
        return False
    return not os.path.realpath(filename).startswith(_NOT_USER)


def user_frame(tb: TracebackType | None) -> traceback.FrameSummary | None:
    """The innermost frame of ``tb`` in the user's code; else the innermost frame (None without frames)."""
    frames = traceback.extract_tb(tb)
    for frame in reversed(frames):
        if is_user_file(frame.filename):
            return frame
    return frames[-1] if frames else None


def type_name(kind: type[BaseException]) -> str:
    """``ZeroDivisionError``; ``torch.OutOfMemoryError`` (a builtin's bare name, else module-qualified)."""
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def describe(error: BaseException, worker: int, phase: ErrorPhase, step: int, microbatch: int | None) -> WorkerError:
    """The report of ``error`` (raised in worker ``worker`` at ``phase`` of ``step``, ``microbatch``)."""
    frame = user_frame(error.__traceback__)
    lines = str(error).strip().splitlines()
    message = lines[0] if lines else ""
    if len(message) > MESSAGE_CHARS:
        message = message[: MESSAGE_CHARS - 3] + "..."
    tail = traceback.format_exception(type(error), error, error.__traceback__, limit=-TAIL_FRAMES, chain=False)
    return WorkerError(
        worker=worker,
        exception=type_name(type(error)),
        message=message,
        file=frame.filename if frame is not None else "?",
        line=(frame.lineno or 0) if frame is not None else 0,
        function=frame.name if frame is not None else "?",
        phase=phase,
        step=step,
        microbatch=microbatch,
        traceback="".join(tail).rstrip("\n"),
    )


def install(report: Callable[[Exception], None]) -> None:
    """Make an uncaught ``Exception`` in this process's main thread end it through ``report`` (after the usual
    traceback on stderr). A ``KeyboardInterrupt`` or ``SystemExit`` is not a crash: Python handles those."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        previous(kind, value, tb)
        if isinstance(value, Exception):
            try:
                report(value)
            except Exception:  # noqa: BLE001 - the report is best effort; the process ends either way
                log.exception("could not report the exception to the coordinator")
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_RAISED)

    sys.excepthook = hook
