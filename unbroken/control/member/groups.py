"""What a member says of its collective groups, and reads of the others': that it leaves a group for a newer epoch's
(``keys.forming``), and that a group's collective or rendezvous timed out with nobody removed (``keys.timeout``).

A member blocked in a superseded group's collective reads the others' ``forming`` keys to learn that the collective
can never complete; the coordinator reads the timeouts (it sees every heartbeat, and decides whether to re-form the
group or exclude whoever stalls again). Every call here gives up quietly when the coordinator is gone: its
successor re-forms the groups anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from torch.distributed import TCPStore

from unbroken.control.store import keys
from unbroken.control.store.connect import report_timeout

LEFT_CHECK_S = 0.05  # how often a member blocked in a superseded group's collective looks for members that left


class GroupNotes:
    """Worker ``worker_id``'s notes on its groups, on ``current()`` (the connection now)."""

    def __init__(self, current: Callable[[], TCPStore], worker_id: int) -> None:
        self._current = current
        self.worker_id = worker_id
        self._left_checked_at = 0.0
        self._left = False

    def announce_forming(self, epoch: int) -> None:
        """This worker leaves its current group for ``epoch``'s: it runs none of the old group's collectives
        again (members still blocked in one read this through ``left_for_newer``)."""
        try:
            self._current().set(keys.forming(self.worker_id), str(epoch))
        except RuntimeError:
            pass  # the coordinator is gone: its successor re-forms the group anyway

    def left_for_newer(self, epoch: int, members: tuple[int, ...]) -> bool:
        """Whether a member of ``epoch``'s group has left it for a newer epoch (so a collective of it can never
        complete). Store reads, at most every ``LEFT_CHECK_S``; call it only when a newer epoch exists."""
        now = time.monotonic()
        if now < self._left_checked_at + LEFT_CHECK_S:
            return self._left
        self._left_checked_at = now
        try:
            store = self._current()
            self._left = any(
                m != self.worker_id and store.check([keys.forming(m)]) and int(store.get(keys.forming(m))) > epoch
                for m in members
            )
        except (RuntimeError, ValueError):
            self._left = False
        return self._left

    def report_timeout(self, epoch: int) -> None:
        """A collective (or the rendezvous) of ``epoch`` timed out with nobody removed: the coordinator, which
        sees every heartbeat, decides what to do (re-form once, then exclude whoever stalls again)."""
        try:
            report_timeout(self._current(), epoch, self.worker_id)
        except RuntimeError:
            pass  # the coordinator is gone: its successor re-forms the group anyway
