"""The simulator's failure events in time order (``EventQueue``): the generated timeline's deaths and repairs,
merged with the kills (and rejoins) a failure schedule fires during a step. Pure Python.

It also keeps which replicas are up, as the events taken so far left them (``up``, and ``up_sorted``: the
group a restart forms).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterator

import numpy as np

from unbroken.sim.timeline import Timeline


class NeedLongerTimeline(Exception):
    """The run outlived the failure events generated so far (run.steps without run.hours)."""


class EventQueue:
    """The next events (time, replica, up) of one timeline and of the kills scheduled into it."""

    def __init__(self, timeline: Timeline, replicas: int, end_s: float) -> None:
        self.tl = timeline
        self.end_s = end_s
        self.up = np.ones(replicas, dtype=bool)
        self.up_sorted = list(range(replicas))  # the replicas up now, kept sorted (a restart's new group)
        self._times, self._replicas, self._ups = (
            timeline.times.tolist(),
            timeline.replicas.tolist(),
            timeline.up.tolist(),
        )
        self.next_event = 0
        self.heap: list[tuple[float, int, int, bool]] = []  # scheduled kills and rejoins: (t, seq, replica, up)
        self.seq = 0

    def _from_heap(self) -> bool:
        t_line = self._times[self.next_event] if self.next_event < len(self._times) else math.inf
        return bool(self.heap) and self.heap[0][0] < t_line

    def peek(self) -> tuple[float, int, bool]:
        """The next event (time, replica, up); time is inf when none is left in the generated timeline."""
        if self._from_heap():
            return self.heap[0][0], self.heap[0][2], self.heap[0][3]
        if self.next_event == len(self._times):
            return math.inf, -1, False
        i = self.next_event
        return self._times[i], self._replicas[i], self._ups[i]

    def pop(self) -> tuple[float, int, bool]:
        """Take the next event (it must exist), and mark its replica up or down."""
        event = self.peek()
        if event[0] == math.inf:
            raise RuntimeError("no event left to take")
        if self._from_heap():
            heapq.heappop(self.heap)
        else:
            self.next_event += 1
        _, replica, up = event
        if up and not self.up[replica]:
            bisect.insort(self.up_sorted, replica)
        elif not up and self.up[replica]:
            del self.up_sorted[bisect.bisect_left(self.up_sorted, replica)]
        self.up[replica] = up
        return event

    def upcoming(self) -> Iterator[tuple[float, int, bool]]:
        """The events to come, in time order, without taking them."""
        heap = sorted(self.heap)
        i, j = self.next_event, 0
        while True:
            t_line = self._times[i] if i < len(self._times) else math.inf
            t_heap = heap[j][0] if j < len(heap) else math.inf
            if t_line == t_heap == math.inf:
                return
            if t_heap < t_line:
                yield heap[j][0], heap[j][2], heap[j][3]
                j += 1
            else:
                yield t_line, self._replicas[i], self._ups[i]
                i += 1

    def schedule_kill(self, t: float, replica: int, rejoin_after_s: float | None) -> None:
        """A scheduled kill of ``replica`` at ``t`` (and its rejoin ``rejoin_after_s`` later)."""
        self.seq += 2
        heapq.heappush(self.heap, (t, self.seq, replica, False))
        if rejoin_after_s is not None:
            heapq.heappush(self.heap, (t + rejoin_after_s, self.seq + 1, replica, True))

    def check_horizon(self, t: float) -> None:
        """NeedLongerTimeline if ``t`` is past the generated events while the run goes on past them."""
        if t > self.tl.horizon_s and self.tl.horizon_s < self.end_s:
            raise NeedLongerTimeline
