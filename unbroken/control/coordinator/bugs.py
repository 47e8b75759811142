"""A bug or a failing host: the rule that tells them apart when workers die of exceptions. Pure Python.

A worker that dies of a Python exception (``records.WorkerError``) is survived like a kill: the group
re-forms without it and its microbatches are planned again over the survivors. A failing host raises once,
somewhere; a bug in the user's code raises again, at the same place, on whichever worker runs that code. So
the coordinator stops the job when an error *repeats*:

- the same error: the same exception type raised at the same place, the innermost frame of the user's code
  (its file's name, line and function; the file's name only, since hosts may hold the script under
  different paths); the message may differ (it often holds data-dependent values);
- on another worker (the same worker raising twice, e.g. after a restart, is a bad host);
- for the same work: in the same step (the re-planned microbatch, or another microbatch of that step), or,
  for code that runs outside any microbatch (between steps, in an evaluation, before the first step), at
  any step: such code typically runs on one rank only (``if ctx.rank == 0``), and the next worker to take
  that rank reaches it at a later step.

The coordinator applies ``repeated`` to each new error and, when it matches, stops the job with
``stop_line``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from unbroken.core.records import WorkerError


def same_place(a: WorkerError, b: WorkerError) -> bool:
    """The same exception type raised at the same line of the same function of the user's code."""
    return (a.exception, Path(a.file).name, a.line, a.function) == (b.exception, Path(b.file).name, b.line, b.function)


def repeats(a: WorkerError, b: WorkerError) -> bool:
    """``b`` is ``a`` again on another worker, for the same work (see the module's rule)."""
    outside = a.microbatch is None and b.microbatch is None
    return a.worker != b.worker and same_place(a, b) and (a.step == b.step or outside)


def repeated(earlier: Sequence[WorkerError], new: WorkerError) -> list[WorkerError]:
    """The errors of ``earlier`` that ``new`` repeats, one per worker (the first each raised), then ``new``;
    empty if it repeats none (a single error: a flaky host, survived)."""
    found: dict[int, WorkerError] = {}
    for error in earlier:
        if repeats(error, new) and error.worker not in found:
            found[error.worker] = error
    return [*found.values(), new] if found else []


def stop_line(errors: Sequence[WorkerError]) -> str:
    """The one line that stops the job for ``errors`` (``repeated``'s answer): the exception, the place, where
    the newest was raised, and the verdict."""
    new = errors[-1]
    workers = ", ".join(str(e.worker) for e in errors)
    return (
        f"{new.exception} ({new.message}) at {new.place()}, {new.where()}, on workers {workers}: "
        f"the same error on {len(errors)} workers: a bug, not a failure"
    )
