"""The failure schedule's signals, delivered to a host's workers when they reach a scheduled point.

Owns ``FaultDelivery``: a worker that reached a scheduled failure point (``ft.inject``) publishes the event under its
injection key, wakes its agent (the injection pipe, ``INJECT_FD_ENV``) and waits there; the agent takes the event
(``injected`` record), marks it fired (each event fires once, across coordinator restarts too) and sends the real
signal: SIGKILL for a kill, SIGSTOP for a hang or a pause (the pause is continued at its end: ``Supervisor.pause``);
a cut the worker does to itself. A fatal event whose worker holds the last live copy of the training state is
skipped (``injection_skipped``). A worker that leaves after a pause, a cut or a stall with a ``rejoin`` is down from
its exit on, and restarted after it (``settle_exits``).

It reads the workers' keys only when the coordinator's injection bell rang, a worker woke the agent, or every
``FULL_LOOK_EVERY`` looks: one store call a look otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from unbroken.control.host.link import CoordinatorLink
from unbroken.control.host.processes import WakePipe, WorkerProcess
from unbroken.control.host.supervisor import Supervisor
from unbroken.control.store import keys
from unbroken.control.store.connect import publish_record
from unbroken.core.failures import FATAL_KINDS, FailureEvent, FailureKind, parse_event
from unbroken.core.layout import ReplicaLayout
from unbroken.core.records import RecordKind, make

FULL_LOOK_EVERY = 8  # looks (at most IDLE_WAIT_S apart) between reads of every worker's injection key, rung or not
# Events after which a worker that left is restarted after the event's ``rejoin`` (a kill or a hang is down at once).
_DOWN_ON_EXIT = (FailureKind.PAUSE, FailureKind.CUT, FailureKind.STALL)


class FaultDelivery:
    """Delivers the failure schedule's events (``enabled``: the run has one) to ``supervisor``'s workers; ``wake``
    is the pipe the workers wake the agent on."""

    def __init__(
        self,
        enabled: bool,
        supervisor: Supervisor,
        link: CoordinatorLink,
        layout: ReplicaLayout,
        wake: WakePipe | None = None,
    ) -> None:
        self.enabled = enabled
        self.supervisor = supervisor
        self.link = link
        self.layout = layout
        self.wake = wake
        self.fired: set[str] = set()  # injected events (each fires once, across coordinator restarts too)
        # The latest event injected into each worker, with the process it was injected into: a new process (a
        # restart, a promoted spare) is not the one it concerned.
        self.last_event: dict[int, tuple[WorkerProcess, FailureEvent]] = {}
        self._rung: int | None = None  # the injection bell's count at the last look at the workers' keys
        self._looks = 0

    def reconnected(self) -> None:
        """A coordinator (a new one, after a restart) is reached: its bell counts from 0, and it learns which events
        fired already."""
        self._rung = None
        for event in self.fired:
            self.link.call(lambda s, e=event: s.set(keys.fired(e), "1"))

    def wake_fds(self) -> tuple[int, ...]:
        """Descriptors that end the wait for an exit (``wait_for_exit``) when readable: a worker at an injection
        point."""
        return self.wake.fds() if self.wake is not None else ()

    def drain_wakes(self) -> bool:
        """Whether a worker reached an injection point since the last look (the pipe emptied)."""
        return self.wake is not None and self.wake.drain()

    def close(self) -> None:
        if self.wake is not None:
            self.wake.close()  # a worker still running gets EPIPE on a wake: it ignores it

    def deliver(self) -> None:
        """A worker that reached a scheduled failure point waits there; deliver the real signal now."""
        if not self.enabled or self.link.store is None or self.supervisor.finished or not self._worth_a_look():
            return
        for wid, proc in self.supervisor.workers.items():
            if proc.poll() is not None or self.supervisor.out(wid):
                continue
            key = keys.inject(wid)
            info = self.link.call(lambda s, k=key: json.loads(s.get(k)) if s.check([k]) else None)
            if info is None:
                continue
            event = parse_event(info["event"])
            if event.kind in FATAL_KINDS and not self._other_members_alive(wid):
                self._skip(wid, key, info["event"])
                continue
            if not self._take(wid, key, info["event"], event):
                return
            self.fired.add(info["event"])
            self.last_event[wid] = (proc, event)
            self._signal(wid, proc, event)

    def _worth_a_look(self) -> bool:
        """One store call a look: the workers' keys are read when the bell rang since the last look, when a worker
        woke the agent, and every FULL_LOOK_EVERY looks anyway (a ring lost with a coordinator that died between a
        key and its ring)."""
        woken = self.drain_wakes()
        rung = self.link.call(lambda s: s.add(keys.INJECT_BELL, 0))
        self._looks += 1
        if rung is None or (rung == self._rung and not woken and self._looks % FULL_LOOK_EVERY):
            return False
        self._rung = rung
        return True

    def _skip(self, wid: int, key: str, name: str) -> None:
        """A cluster never loses its last copy of the state to a scheduled failure (the paper's 32 ranks never all
        fail); random schedules plan in expected time and can overlap."""
        why = "no other member of the group is alive: it would lose the training state"
        record = make(RecordKind.INJECTION_SKIPPED, time.time(), worker=wid, event=name, why=why)

        def skip(s: Any) -> None:
            s.set(keys.fired(name), "1")
            s.set(keys.skip(wid), "1")
            s.delete_key(key)
            publish_record(s, record)

        self.link.call(skip)

    def _take(self, wid: int, key: str, name: str, event: FailureEvent) -> bool:
        """Take the event from the worker's key and record it; False if the coordinator is gone."""
        record = make(RecordKind.INJECTED, time.time(), worker=wid, event=name, kind=str(event.kind))

        def take(s: Any) -> bool:
            s.delete_key(key)
            s.set(keys.injected(wid), json.dumps({"event": name, "time": record["time"]}))
            s.set(keys.fired(name), "1")
            publish_record(s, record)
            return True

        return bool(self.link.call(take))

    def _signal(self, wid: int, proc: WorkerProcess, event: FailureEvent) -> None:
        if event.kind is FailureKind.CUT:
            return  # the worker cuts its own connections; its exit is handled like any other
        os.kill(proc.pid, signal.SIGKILL if event.kind is FailureKind.KILL else signal.SIGSTOP)
        if event.kind is FailureKind.PAUSE:
            self.supervisor.pause(wid, time.monotonic() + event.seconds)
            return
        self.supervisor.put_down(wid, event.rejoin_after_s, hung=event.kind is FailureKind.HANG)

    def _other_members_alive(self, wid: int) -> bool:
        """Whether a member of the newest epoch other than ``wid`` is alive (not killed, paused or exited
        here; a member on another host counts as alive until the coordinator removes it)."""
        members = self.link.newest_members() or []
        replica = self.layout.replica_of(wid)
        workers = self.supervisor.workers
        return any(
            self.layout.replica_of(w) != replica
            and (w not in workers or (not self.supervisor.out(w) and workers[w].poll() is None))
            for w in members
        )

    def settle_exits(self) -> None:
        """A worker that left after a pause, a cut or a stall with a ``rejoin`` is down from its exit on (restarted
        after the rejoin); an event's entry ends with its process."""
        now = time.monotonic()
        for wid, (proc, event) in list(self.last_event.items()):
            if self.supervisor.workers.get(wid) is not proc:
                del self.last_event[wid]  # restarted, or a spare took its place: a new process
                continue
            if not self.supervisor.out(wid) and proc.poll() not in (None, 0):
                del self.last_event[wid]
                if event.rejoin_after_s is not None and event.kind in _DOWN_ON_EXIT:
                    self.supervisor.put_down(wid, event.rejoin_after_s, at=now)

    def forget(self, wid: int) -> None:
        """``wid``'s exit was handled otherwise (replaced after ``restart_after_s``, or refused)."""
        self.last_event.pop(wid, None)
