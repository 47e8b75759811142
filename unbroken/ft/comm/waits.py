"""Bounded waits on collectives: how a wait ended (``WaitStatus``), a collective in flight (``Pending``) and the
polled wait on several of them (``wait_all``).

Nothing here raises into model code: a wait returns a falsy ``WaitStatus`` when it was interrupted (the
membership epoch changed), its deadline passed, or the backend failed, and the caller abandons the group and
re-plans. A NCCL collective is waited on by polling ``Work.is_completed()`` (its future completes when it is
enqueued, not when it ran); a gloo one by its future's callback.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from enum import Enum

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 0.005


class WaitStatus(Enum):
    """How a bounded wait on collectives ended."""

    DONE = "done"
    INTERRUPTED = "interrupted"  # ``interrupted()`` turned true (a member was removed, the run stops)
    TIMED_OUT = "timed out"  # the deadline passed with every member still in the group (a stall, a partition)
    FAILED = "failed"  # the backend reported an error (e.g. a connection reset by a dead peer)

    def __bool__(self) -> bool:
        return self is WaitStatus.DONE


def backend_timed_out(error: BaseException) -> bool:
    """``error`` is the backend's own bound running out: gloo's on a collective ("Timed out waiting ...ms for recv
    operation"), the store's on a rendezvous (a ``DistStoreError``, "wait timeout after ...ms"). Its clock starts when
    the backend begins the work, which may be before the caller's wait began (a thread not scheduled between the
    launch and the wait), so it may end first: that is a timeout all the same, never a failure (which the caller
    does not report to the coordinator, whose stall decision then never comes)."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


class Pending:
    """A collective in flight (or already complete for a group of one). ``poll``: wait by polling
    ``is_completed()`` (NCCL); ``result``: where the result goes once done, when the collective ran on a
    copy (``staged``) of a CPU tensor on the group's GPU."""

    def __init__(
        self,
        work: dist.Work | None,
        poll: bool = False,
        staged: torch.Tensor | None = None,
        result: torch.Tensor | None = None,
    ) -> None:
        self.work = work
        self.poll = poll
        self.staged = staged
        self.result = result

    def done(self) -> bool:
        return self.work is None or self.work.is_completed()

    def finish(self) -> None:
        """After a successful wait: the result into the caller's tensor (a staged collective)."""
        if self.staged is not None and self.result is not None:
            self.result.copy_(self.staged)


def wait_all(
    pending: Sequence[Pending],
    timeout_s: float,
    interrupted: Callable[[], bool],
) -> WaitStatus:
    """Wait for every collective; anything but ``DONE`` (falsy) if ``interrupted()`` turns true, time runs
    out (``timeout_s``, or the backend's own bound: ``TIMED_OUT`` either way), or the backend fails.

    ``interrupted`` is typically "the membership epoch changed" and must be cheap (a cached value). A gloo
    collective whose peer died errors only on the dead rank's neighbours; everyone else would block until
    the group timeout, so the epoch watch is what bounds the wait. The thread sleeps on the collective's
    completion (no busy polling that would steal CPU from compute) and wakes every ``CHECK_INTERVAL_S``.
    """
    deadline = time.monotonic() + timeout_s
    for p in pending:
        if p.work is None:
            if interrupted():  # a group of one: no collective, but a membership change still ends the wait
                return WaitStatus.INTERRUPTED
            p.finish()
            continue
        if not p.done():
            finished = threading.Event()
            if not p.poll:
                p.work.get_future().add_done_callback(lambda _f, e=finished: e.set())
            while not (finished.is_set() or (p.poll and p.work.is_completed())):
                # A collective that completed counts, even when the membership has changed since: every member took
                # part in it, and the others go on with its result (commit the step), so this member must too.
                if interrupted() and not p.work.is_completed():
                    return WaitStatus.INTERRUPTED
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning("collective timed out after %.1f s", timeout_s)
                    return WaitStatus.TIMED_OUT
                finished.wait(min(remaining, CHECK_INTERVAL_S))
        try:
            p.work.wait()  # completed: surfaces a backend error (e.g. a reset connection) as an exception
        except RuntimeError as e:
            if backend_timed_out(e):
                log.warning("collective timed out: %s", e)
                return WaitStatus.TIMED_OUT
            log.warning("collective failed: %s", e)
            return WaitStatus.FAILED
        p.finish()
    return WaitStatus.DONE
