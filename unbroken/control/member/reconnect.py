"""Holding on when the coordinator is lost: why a connection failed, the search for another incarnation of the
coordinator (a restarted one, or a standby that took over), and the verdict when none comes back.

A dead coordinator does not stop the worker. Its gloo groups do not need the coordinator, so training goes on
while the worker looks for a coordinator again (the same address, restarted by its launcher, or a standby's from
the list in ``UNBROKEN_COORDINATOR``) for up to ``hold_s``. A new coordinator (another *incarnation*) is
re-registered with under the same worker id and the watchers move to it (the client's ``readmit`` and ``resume``),
and training-thread store calls made meanwhile wait for it and are retried (``HeldStore``). If the coordinator that
admitted the worker still answers, only the worker's connection was cut: it is ``lost = "cut"`` (it leaves, the job
goes on). Only when no coordinator comes back in time is the worker ``lost = "coordinator"``.

Owns the connection's *generation* (connections made so far: a watcher of a replaced connection is ignored), the
incarnation the worker is registered with, and the diagnosis thread (at most one at a time).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.distributed import TCPStore

from unbroken.control.member.heartbeat import Heartbeat
from unbroken.control.store import keys
from unbroken.control.store.connect import STORE_TIMEOUT_S, open_store
from unbroken.control.store.gateway import NothingListens, Tunnel, TunnelError

log = logging.getLogger(__name__)

RECONNECT_POLL_S = 0.1
LOST_POLL_S = 0.1  # how often a caller waiting for a new connection or a verdict looks again

# Re-register with the coordinator at an address (its store and tunnel): None once re-admitted under the same id,
# else why not. Raises RuntimeError if a store call fails (the search goes on).
Readmit = Callable[[str, TCPStore, Tunnel], str | None]


class Reconnection:
    """One worker's hold on its coordinator. ``readmit``: see ``Readmit``; ``resume(generation)``: start the
    watchers of a new connection; ``on_lost(reason)``: the worker stops for ``reason``. ``stopping``, once set
    (the client closing), ends the diagnosis and the stall watch. Probes time out after ``probe_timeout_s``."""

    def __init__(
        self,
        addresses: list[str],
        token: str,
        hold_s: float,
        probe_timeout_s: float,
        stopping: threading.Event,
        readmit: Readmit,
        resume: Callable[[int], None],
        on_lost: Callable[[str], None],
    ) -> None:
        self.addresses, self.token, self.hold_s = addresses, token, hold_s
        self.probe_timeout_s = probe_timeout_s
        self.lost: str | None = None
        self.holding = False
        self.generation = 0  # connections made so far (a new coordinator makes a new generation)
        self.incarnation = ""  # the coordinator's the worker registered with
        self.diagnosis: threading.Thread | None = None
        self._stopping = stopping
        self._readmit, self._resume, self._on_lost = readmit, resume, on_lost
        self._lost_event = threading.Event()
        self._reconnected = threading.Condition()
        self._diagnosing = threading.Lock()

    # -- callers -------------------------------------------------------------------------------------
    def connection_failed(self, generation: int | None = None) -> None:
        """A watcher's store call failed: find out why, once per connection (unless the client is closing)."""
        if generation is not None and generation != self.generation:
            return  # a watcher of a connection already replaced
        if self._stopping.is_set() or not self._diagnosing.acquire(blocking=False):
            return
        self.diagnosis = threading.Thread(target=self._diagnose, name="coordinator-lost", daemon=True)
        self.diagnosis.start()

    def await_reconnect(self, generation: int) -> bool:
        """After a failed call on connection ``generation``: wait until a new one exists (True) or the worker
        is lost (False)."""
        deadline = time.monotonic() + self.hold_s + STORE_TIMEOUT_S
        with self._reconnected:
            while self.generation == generation and self.lost is None and time.monotonic() < deadline:
                if not self.holding and not self._diagnosing.locked():
                    self.connection_failed()  # the training thread noticed first
                self._reconnected.wait(LOST_POLL_S)
            return self.generation != generation and self.lost is None

    def wait_lost(self, timeout_s: float) -> str | None:
        """After a store call failed: wait (bounded) for the verdict; None if the connection is fine again."""
        deadline = time.monotonic() + max(timeout_s, self.hold_s + 1.0)
        generation = self.generation
        while self.lost is None and self.generation == generation and time.monotonic() < deadline:
            if not self._diagnosing.locked():
                self.connection_failed()
            self._lost_event.wait(LOST_POLL_S)
        return self.lost

    def watch_for_successor(self, generation: int, beat: Heartbeat) -> None:
        """The stall watch of connection ``generation``. A heartbeat unanswered for the heartbeat timeout (or, under
        host heartbeats, its agent's calls failing for as long, ``control.member.hostbeat``): has another
        coordinator taken over (an etcd standby, the old leader's host cut off)? Then register with it. Otherwise
        nothing is done: the coordinator may be only slow or paused (it declares nobody dead then), and a worker
        whose own link is down is excluded by the coordinator and learns it when the link is back. Needed because
        a store call on a connection whose peer the network no longer reaches neither fails nor times out
        (TCPStore's timeout does not bound it): only the diagnosis of a failed call would otherwise find the
        successor. Also has ``beat`` log every thread's stack once a beat is late by most of the timeout."""
        while not self._stopping.wait(beat.interval_s) and generation == self.generation:
            beat.log_if_late()
            since = beat.unanswered_since()
            if since is None or time.monotonic() - since < beat.timeout_s or len(self.addresses) < 2:
                continue
            if self.lost is not None or self._diagnosing.locked():
                continue  # a diagnosis is under way (it finds a successor too)
            if self._take_over_to_successor():
                return

    # -- the search ----------------------------------------------------------------------------------
    def _take_over_to_successor(self) -> bool:
        """Look at the first coordinator that answers: if it is another incarnation, register with it (True: this
        stall watch is over); if it is the same one (slow or paused, or this host's link came back), wait."""
        for address in self.addresses:
            try:
                store, tunnel = open_store(address, timeout_s=self.probe_timeout_s, token=self.token)
                incarnation = store.get(keys.INCARNATION).decode()
            except (TunnelError, RuntimeError, OSError):
                continue
            if incarnation and incarnation != self.incarnation and self._diagnosing.acquire(blocking=False):
                self.holding = True
                try:
                    rejoined = self._rejoin(address, store, tunnel, incarnation)
                finally:
                    self.holding = False
                if not rejoined:  # its old connections are cut now: the diagnosis takes over from here
                    self._diagnosing.release()
                    self.connection_failed()
                return True
            tunnel.close()
            return False
        return False

    def _probe(self) -> tuple[str, TCPStore, Tunnel] | None:
        """A fresh connection to the first coordinator that answers, its address and tunnel; None if none does."""
        for address in self.addresses:
            try:
                return address, *open_store(address, timeout_s=self.probe_timeout_s, token=self.token)
            except NothingListens:
                continue  # nothing on that port (dead, restarting, or a standby that does not lead)
            except (TunnelError, RuntimeError, OSError):
                continue
        return None

    def _diagnose(self) -> None:
        """Is it only our connection that was cut (the same coordinator answers: leave), or is the coordinator
        gone (hold on until one answers: a new incarnation is joined again; none within ``hold_s``: lost)?"""
        self.holding = True
        deadline = time.monotonic() + self.hold_s
        try:
            while not self._stopping.is_set():
                found = self._probe()
                if found is not None:
                    address, store, tunnel = found
                    try:
                        incarnation = store.get(keys.INCARNATION).decode()
                    except RuntimeError:
                        incarnation = ""
                    if incarnation == self.incarnation:
                        self.give_up("cut", "this worker's connection to the coordinator was cut")
                        return
                    if incarnation and self._rejoin(address, store, tunnel, incarnation):
                        return
                if time.monotonic() > deadline:
                    self.give_up(
                        "coordinator",
                        f"no coordinator at {','.join(self.addresses)} answered within {self.hold_s:.0f} s",
                    )
                    return
                time.sleep(RECONNECT_POLL_S)
        finally:
            self.holding = False

    def _rejoin(self, address: str, store: TCPStore, tunnel: Tunnel, incarnation: str) -> bool:
        """Re-register with a coordinator that replaced the dead one, under the same id; move the watchers. False
        if a store call failed (the search goes on)."""
        try:
            refused = self._readmit(address, store, tunnel)
            if refused is not None:
                self.give_up("cut", refused)
                return True
            self.incarnation = incarnation
            with self._reconnected:
                self.generation += 1
            self._resume(self.generation)
        except RuntimeError as e:
            log.warning("registering with the new coordinator failed (%s); trying again", e)
            return False
        with self._reconnected:
            self._diagnosing.release()
            self._reconnected.notify_all()
        return True

    def give_up(self, lost: str, reason: str) -> None:
        """The verdict: ``lost`` (``"cut"`` or ``"coordinator"``), for ``reason``."""
        log.error("%s", reason)
        self.lost = lost
        self._on_lost(reason)
        self._lost_event.set()
        with self._reconnected:
            self._reconnected.notify_all()


class HeldStore:
    """The worker's store connection for the training thread: a call that fails while the worker holds on
    (the coordinator is being replaced) waits for the new one and is made again there (every call the
    training thread makes is idempotent: get, set, check, delete, compare-and-set). ``current()``: the
    connection now."""

    def __init__(self, current: Callable[[], TCPStore], reconnection: Reconnection) -> None:
        self._current = current
        self._reconnection = reconnection

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            generation = self._reconnection.generation
            try:
                return getattr(self._current(), name)(*args, **kwargs)
            except RuntimeError:
                if not self._reconnection.await_reconnect(generation):
                    raise
                return getattr(self._current(), name)(*args, **kwargs)

        return call
