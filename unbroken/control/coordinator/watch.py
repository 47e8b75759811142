"""The coordinator's watch on the members: what it reads from the store each tick, and the deaths it concludes.

Owns the one round trip a tick costs (every member's heartbeat counter, the metrics sequence, the counts of death
and timeout reports), the reads of the reports themselves (``keys.dead``, ``keys.timeout``: only when their count,
the epoch or the members moved since the last read), and the heartbeat clock: a member is dead when the launcher
reported its exit, or when its counter has not moved for ``heartbeat_timeout_s`` of the time this coordinator was
watching (a gap of its own, not being scheduled on an overloaded host, makes the counters it saw stale).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from unbroken.control.store import keys
from unbroken.control.store.connect import get_int, process_failure


class Watch:
    """The heartbeats and reports of the members, read from ``store``."""

    def __init__(self, store: Any, heartbeat_timeout_s: float) -> None:
        self.store = store
        self.heartbeat_timeout_s = heartbeat_timeout_s
        for counter in (keys.METRICS_SEQ, keys.DEATHS, keys.TIMEOUTS):
            store.add(counter, 0)  # exists from the start: the tick reads them with the heartbeats
        self.heartbeats: dict[int, tuple[int, float]] = {}  # member -> (its counter, when it was last seen moving)
        self.watched_at = time.monotonic()  # when the heartbeats were last looked at
        self.deaths_count = self.timeouts_count = 0
        # What the dead/<id> and timeout/<e>/<id> keys said at the last look, and the (count, epoch, members)
        # it was taken at: looked at again only when one of those moved (one read a tick, not one per member).
        self._deaths_seen: tuple[int, int, tuple[int, ...]] | None = None
        self._timeouts_seen: tuple[int, int, tuple[int, ...]] | None = None
        self._timeouts_reported: set[int] = set()

    def admitted(self, wid: int) -> None:
        """``wid`` was admitted: its heartbeat counter (created now if new) is watched from here."""
        self.heartbeats[wid] = (get_int(self.store, keys.heartbeat(wid)), time.monotonic())

    def read(self, members: tuple[int, ...]) -> tuple[list[int], int]:
        """Every member's heartbeat counter and the metrics sequence, in one round trip (every one of those
        counters exists: ``admitted`` created each heartbeat counter); the death and timeout report counts in
        the same trip (``deaths_count``, ``timeouts_count``)."""
        counters = [keys.METRICS_SEQ, keys.DEATHS, keys.TIMEOUTS]
        raw = self.store.multi_get([*(keys.heartbeat(wid) for wid in members), *counters])
        self.deaths_count, self.timeouts_count = int(raw[-2]), int(raw[-1])
        return [int(r) for r in raw[:-3]], int(raw[-3])

    def dead(
        self, epoch: int, members: tuple[int, ...], counts: list[int], reported: bool, removed: Mapping[int, str]
    ) -> dict[int, str]:
        """Members that died, each with why: ``removed`` (dead by another judge's word: a raised exception, a
        fail-slow exclusion), reported by the launcher (looked up only when ``reported`` may have news), or
        silent for longer than the heartbeat timeout (``counts``: ``read``'s, in ``members``' order)."""
        dead: dict[int, str] = {}
        now = time.monotonic()
        # The reports are read only when their count (or the membership) moved since the last read; a report
        # adds to the count after writing its key, and the count was read before the keys, so none is missed.
        looked = (self.deaths_count, epoch, members)
        reported = reported and looked != self._deaths_seen
        if reported:
            self._deaths_seen = looked
        # Silence is evidence only for the time the coordinator was watching: after a gap of its own (its
        # process not scheduled on an overloaded host, paused), the counters it last saw are stale, so they
        # count from now (found by chaos seed 2060 under a load of 12 on 2 cores: every worker "died").
        blind = now - self.watched_at > self.heartbeat_timeout_s / 2
        self.watched_at = now
        for wid, count in zip(members, counts, strict=True):
            if wid in removed:
                dead[wid] = removed[wid]
                continue
            if reported and self.store.check([keys.dead(wid)]):
                dead[wid] = process_failure(self.store.get(keys.dead(wid)).decode())
                continue
            last_count, last_time = self.heartbeats.get(wid, (count, now))
            if count != last_count or blind:
                self.heartbeats[wid] = (count, now)
            elif now - last_time > self.heartbeat_timeout_s:
                dead[wid] = f"no heartbeat for {now - last_time:.2f} s"
        return dead

    def timeouts(self, epoch: int, members: tuple[int, ...]) -> set[int]:
        """The members that reported a timed-out collective of ``epoch`` (read again only when the report count,
        the epoch or the members moved since the last read)."""
        looked = (self.timeouts_count, epoch, members)
        if looked != self._timeouts_seen:
            self._timeouts_seen = looked
            self._timeouts_reported = {w for w in members if self.store.check([keys.timeout(epoch, w)])}
        return set(self._timeouts_reported)
