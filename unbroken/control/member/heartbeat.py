"""A worker's heartbeats: the sender thread that beats every interval and delivers the metrics records between
beats, and what the worker logs when a beat is late.

A beat is one ``add`` to the worker's ``keys.heartbeat``, or, under host heartbeats, a count on its host's beat
board that its agent passes on (``control.member.hostbeat``), with the ``add`` too until the agent has passed one
of this worker's beats on and while the agent is behind. Owns the beat's timing (``done``: when the last beat was
answered; ``since``: when the one under way was sent), which the reconnection's stall watch reads
(``control.member.reconnect``), and the dump of every thread's stack once a beat is late by most of the timeout.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback

from torch.distributed import TCPStore

from unbroken.control.member.hostbeat import WorkerBeat
from unbroken.control.member.outbox import MetricsOutbox
from unbroken.control.store import keys

log = logging.getLogger(__name__)

STALL_DUMP_SHARE = 0.75  # a heartbeat this late (share of the timeout) logs every thread's stack
STALL_HEADER = "heartbeat late by {late:.2f} s; every thread's stack, most recent call first:"
# A process logs every thread's stack at most this often, whatever the clients in it: the stacks are every
# thread's already, and reading them holds the GIL (with 128 clients in one process, as a control-scale crowd
# runs them, each late beat's dump of 600 threads made the next beats later still, until the crowd seized up).
STALL_DUMP_EVERY_S = 10.0


class _RateLimit:
    """``due()`` is True at most once every ``every_s``, across the threads of the process."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._last: float | None = None

    def due(self) -> bool:
        with self._lock:
            now = time.monotonic()
            if self._last is not None and now - self._last < self.every_s:
                return False
            self._last = now
            return True


_STALL_DUMPS = _RateLimit(STALL_DUMP_EVERY_S)


def thread_stacks() -> str:
    """Every thread's Python stack, innermost call first (faulthandler's layout), read while holding the GIL.
    ``faulthandler``'s own dump reads other threads' frames without it, and a live worker crashed in one (SIGSEGV
    while its training thread ran; CPython issues 116008 and 131580)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    blocks = []
    for ident, frame in sys._current_frames().items():
        lines = [f"Thread {names.get(ident, hex(ident))} (most recent call first):"]
        lines += [
            f'  File "{f.filename}", line {f.lineno} in {f.name}' for f in reversed(traceback.extract_stack(frame))
        ]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


class Heartbeat:
    """One worker's beats: ``run`` is the sender thread's body (one per connection), ``log_if_late`` and
    ``unanswered_since`` are read by the stall watch. ``host_beat``: this process's slot on its host's board
    (None: every beat is the worker's own ``add``)."""

    def __init__(self, interval_s: float, timeout_s: float, host_beat: WorkerBeat | None = None) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.host_beat = host_beat
        self.since: float | None = None  # when the heartbeat under way was sent (None: none is)
        self.done = time.monotonic()  # when the last heartbeat was answered (or the sender started)
        self._stall_dump_s = STALL_DUMP_SHARE * timeout_s
        self._stall_logged = 0.0  # the ``done`` whose lateness was logged (once per late beat)
        self._first_counted: float | None = None  # host heartbeats: when this worker's first count was on the board

    def restart(self) -> None:
        """A new sender is about to start: a late beat is counted from now."""
        self.done = time.monotonic()

    def run(self, store: TCPStore, worker_id: int, outbox: MetricsOutbox) -> None:
        """A heartbeat every interval and, between them, ``outbox``'s records in order, so the training thread
        never waits on the store to publish. Ends at the outbox's close, after everything queued before it; a
        failed store call raises RuntimeError."""
        key = keys.heartbeat(worker_id)
        if self.host_beat is not None:
            self.host_beat.claim(worker_id)
        self._first_counted = None
        next_beat = time.monotonic()
        while True:
            if time.monotonic() >= next_beat:
                self.beat(store, key)
                next_beat = self.done + self.interval_s
            if not outbox.deliver(store, next_beat - time.monotonic()):
                return

    def beat(self, store: TCPStore, key: str) -> None:
        """One beat: a count on the board where there is one, and the worker's own ``add`` unless its agent has
        passed one of its counts on and is not behind."""
        host_beat = self.host_beat
        if host_beat is not None:
            host_beat.beat()
            self._first_counted = self._first_counted or time.monotonic()
        if (
            host_beat is None
            or self._first_counted is None
            or not host_beat.passed_since(self._first_counted)
            or host_beat.agent_behind(self.interval_s)
        ):
            self.since = time.monotonic()
            store.add(key, 1)
            self.since = None
        self.done = time.monotonic()

    def unanswered_since(self) -> float | None:
        """Since when a beat has gone unanswered: the worker's own call under way, or under host heartbeats its
        agent's calls failing (the earlier of the two); None while neither is."""
        since = self.since
        if self.host_beat is not None and (agent := self.host_beat.agent_call_since()) is not None:
            since = agent if since is None else min(since, agent)
        return since

    def log_if_late(self) -> None:
        """Once the next beat is late by most of the timeout (the sender starved of the GIL, or the store slow to
        answer), log every thread's stack, once per late beat: why a live worker was about to be declared dead."""
        done = self.done
        late = time.monotonic() - done
        if late > self._stall_dump_s and self._stall_logged != done:
            self._stall_logged = done
            if _STALL_DUMPS.due():
                log.warning("%s\n\n%s", STALL_HEADER.format(late=late), thread_stacks())
            else:
                log.warning("heartbeat late by %.2f s (this process logged every thread's stack lately)", late)
