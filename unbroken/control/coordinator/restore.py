"""A restarted coordinator (``--restore``, a successor started by the launcher at the same address): the members it
waits for, and what it publishes once they came back or its window closed.

Owns what the state store's hard state (``store.durable.State``) gives back: the epoch counter, the admitted workers
and the ids handed out, the committed step; the members of the last epoch, waited for up to
``coordinator.rejoin_window_s`` (they kept training meanwhile, and register again as ``returning``); and the epoch
that ends the wait: the whole replicas that came back (with any joiner), the others recorded as failed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from unbroken.control.store.durable import State
from unbroken.core.layout import ReplicaLayout


@dataclass(frozen=True)
class RestoreEnd:
    """The epoch that ends a restarted coordinator's wait: its ``members`` and ``reason``; ``gone``: the members of
    the last epoch that did not come back (failures)."""

    members: tuple[int, ...]
    reason: str
    gone: tuple[int, ...]


@dataclass
class Restore:
    """A restarted coordinator's state: nothing (``epoch`` 0, ``waiting`` false) unless it replaced a dead one with
    an epoch published."""

    epoch: int = 0  # the epoch restored (0: not a restarted coordinator)
    committed_step: int = -1
    next_worker_id: int = 0
    admitted: dict[int, dict[str, Any]] = field(default_factory=dict)
    restored: tuple[int, ...] = ()  # the members it waits for (emptied once the wait ends)
    returned: set[int] = field(default_factory=set)  # ... and those that came back
    until: float = 0.0  # when the wait ends, whoever came back

    @classmethod
    def of(cls, prior: State | None, restore: bool, window_s: float) -> Restore:
        """From the hard state ``prior`` when this coordinator replaces a dead one (``restore``); a new launch of a
        run continues only its epoch numbers (``epoch_floor``), and waits for nobody."""
        if not restore or prior is None or prior.epoch <= 0:
            return cls()
        return cls(
            epoch=prior.epoch,
            committed_step=prior.committed_step,
            next_worker_id=prior.next_worker_id,
            admitted={w: {"host": v.host, "pid": v.pid} for w, v in prior.admitted.items()},
            restored=prior.members,
            until=time.monotonic() + window_s,
        )

    @property
    def waiting(self) -> bool:
        """Still waiting for the last epoch's members (no epoch published since the restart)."""
        return bool(self.restored)

    def awaits(self, wid: int) -> bool:
        """``wid`` is a member this coordinator waits for that has not come back yet."""
        return wid in self.restored and wid not in self.returned

    def due(self, now: float) -> bool:
        """Every member came back, or the window closed."""
        return set(self.restored) <= self.returned or now > self.until

    def end(self, layout: ReplicaLayout, joined: Iterable[int]) -> RestoreEnd:
        """The epoch to publish: the members that came back (whole replicas only) and any joiner; the wait is over."""
        back = layout.whole(w for w in self.restored if w in self.returned)
        gone = tuple(w for w in self.restored if w not in back)
        self.restored = ()
        members = (*back, *joined)
        reason = "coordinator restarted: " + (", ".join(map(str, back)) or "nobody") + " came back"
        if gone:
            reason += "; " + ", ".join(map(str, gone)) + " did not"
        return RestoreEnd(tuple(members), reason, gone)
