"""How a process of ours ends: as a Python program ends, without the interpreter's teardown.

After a program's last line, CPython joins its non-daemon threads, runs its ``atexit`` handlers, flushes the
standard streams, and then tears the interpreter down: it clears every module and releases every object. With
torch imported that teardown costs more than the rest of a short process's end: 0.47 s of CPU in a process
forked from one that imported torch (releasing inherited objects writes to their pages, which the kernel then
copies), and about half a second in a started one, on this machine; a worker, coordinator, zygote or command line
pays it at every end. ``run_then_exit`` does everything before the teardown, then leaves with ``os._exit``: what
the program wrote, its exit status and its exit handlers are the same.

What the teardown would also do and this does not: close files that nobody closed (their unflushed bytes are
lost) and run ``__del__`` of objects still alive. Our processes write through ``with`` blocks, line-buffered
records and logging (flushed at each record and by its own exit handler).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def run_then_exit(program: Callable[[], object]) -> NoReturn:
    """Run ``program`` (the whole of what the process does: its return value is the exit status, as with
    ``sys.exit(program())``), then end the process as the interpreter would, without its teardown. The status is
    what ``sys.exit`` gives (None: 0; a string is printed and gives 1). The non-daemon threads are joined and the
    ``atexit`` handlers run, in the interpreter's order (its own functions: there is no public one), then the
    standard streams are flushed. An exception other than ``SystemExit`` propagates: the interpreter reports it
    and tears down as usual (a crash is not the path to make cheap)."""
    try:
        status: object = program()
    except SystemExit as e:
        status = e.code
    if status is None:
        status = 0
    elif not isinstance(status, int):
        print(status, file=sys.stderr)
        status = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # closed, or its reader gone: the interpreter's own flush at exit ignores that too
    os._exit(status)
