"""The coordinator's stop: the stop of the job (``keys.STOP``, its first reason kept), the launcher's death, the
end of the run (``keys.DONE``), and the records taken after a stop until the members have ended.

After a stop the members go on until they see it (a step may commit meanwhile, a checkpoint be written), then their
senders deliver what they queued and end: the records are taken until every member's heartbeats have been quiet
``STOP_QUIET_BEATS`` intervals, for at most ``STOP_DRAIN_S`` (half the launcher's grace before it kills).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from unbroken.control.coordinator.watch import Watch
from unbroken.control.store import keys
from unbroken.control.store.connect import request_stop

STOP_QUIET_BEATS = 3
STOP_DRAIN_S = 5.0


class Stop:
    """The stop of one coordinator's job. ``announce``: rings the workers' doorbell; ``parent_pid``: the launcher,
    whose death stops the job (None: nobody to watch)."""

    def __init__(self, store: Any, announce: Callable[[], None], parent_pid: int | None) -> None:
        self.store = store
        self.announce = announce
        self.parent_pid = parent_pid
        self.stopping = threading.Event()  # set once this coordinator stops acting (stopped, deposed, signalled)

    def request(self, reason: str) -> bool:
        """Stop the job for ``reason``; True if it is the reason kept (nobody stopped it for another before)."""
        first = request_stop(self.store, reason)
        self.stopping.set()
        self.announce()
        return first

    def launcher_alive(self) -> bool:
        """The process that started this coordinator still runs (always, when none was named)."""
        return self.parent_pid is None or os.getppid() == self.parent_pid

    def requested(self) -> bool:
        """A stop was written (by this coordinator, the launcher or a worker)."""
        return self.store.check([keys.STOP])

    def reason(self) -> str:
        return self.store.get(keys.STOP).decode()

    def done(self) -> bool:
        """The run finished (its leader wrote ``keys.DONE``)."""
        return self.store.check([keys.DONE])


def drain_until_quiet(
    watch: Watch, drain: Callable[[int], None], members: tuple[int, ...], interval_s: float, limit_s: float
) -> None:
    """Take the members' records (``drain``, given the metrics sequence) until each one's heartbeats have stopped for
    ``STOP_QUIET_BEATS`` intervals of ``interval_s`` (its sender ends after delivering what it queued), or
    ``limit_s`` has passed (a member still in a long step, or hung). Without it a stop lost the records of a step
    committed while the members learnt of it."""
    quiet_s = STOP_QUIET_BEATS * interval_s
    deadline = time.monotonic() + limit_s
    seen: dict[int, tuple[int, float]] = {}  # member -> (its heartbeat count, when that count was first read)
    while True:
        counts, seq = watch.read(members)
        drain(seq)
        now = time.monotonic()
        for wid, count in zip(members, counts, strict=True):
            if seen.get(wid, (None, now))[0] != count:
                seen[wid] = (count, now)
        if all(now - since >= quiet_s for _, since in seen.values()) or now >= deadline:
            return
        time.sleep(interval_s / 2)
