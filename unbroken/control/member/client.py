"""A worker's client of the coordinator: the one way a worker reaches the control plane.

``CoordinatorClient`` is a facade over collaborators, each in a module of its own and testable alone:
``connections`` (its store connections), ``registration`` (admission), ``heartbeat`` (the sender thread: beats,
and between them the records of ``outbox``, the metrics delivery), ``watch`` (the news watch: epochs and the stop,
from the host's relay or the store), ``job`` and ``groups`` (the job's keys and the group notes it reads and
writes), and ``reconnect`` (holding on when the coordinator is lost, and moving to another incarnation of it).
The facade owns the order in which they are made, the three threads it runs per connection (the sender, the news
watcher, the stall watch), and the move of those threads to a coordinator that replaced a dead one.

The names other packages import from here (the worker's environment, ``Refused``, ``Epoch``, ...) are kept here
too; each is owned by the module named in ``__all__``'s comment.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore

from unbroken.control.member.connections import Connections
from unbroken.control.member.env import (  # owned by env
    COORDINATOR_ENV,
    DEVICE_INDEX_ENV,
    FORKED_ENV,
    INJECT_FD_ENV,
    LOCAL_WORKERS_ENV,
    RUN_DIR_ENV,
    SPARE_ENV,
    STARTED_AT_ENV,
    WORKER_ID_ENV,
    addresses_of,
)
from unbroken.control.member.groups import LEFT_CHECK_S, GroupNotes
from unbroken.control.member.heartbeat import STALL_HEADER, Heartbeat, thread_stacks
from unbroken.control.member.hostbeat import WorkerBeat
from unbroken.control.member.job import Epoch, JobKeys
from unbroken.control.member.news import RELAY_ENV
from unbroken.control.member.outbox import MetricsOutbox
from unbroken.control.member.reconnect import HeldStore, Reconnection
from unbroken.control.member.registration import Refused, register, start_cost
from unbroken.control.member.watch import NewsWatch
from unbroken.control.store import keys
from unbroken.control.store.connect import STORE_TIMEOUT_S, read_json
from unbroken.control.store.gateway import Tunnel, require_token
from unbroken.core.records import WorkerError

__all__ = [
    "COORDINATOR_ENV",
    "DEVICE_INDEX_ENV",
    "FORKED_ENV",
    "INJECT_FD_ENV",
    "LEFT_CHECK_S",  # groups
    "LOCAL_WORKERS_ENV",
    "RUN_DIR_ENV",
    "SPARE_ENV",
    "STALL_HEADER",  # heartbeat
    "STARTED_AT_ENV",
    "WORKER_ID_ENV",
    "CoordinatorClient",
    "Epoch",  # job
    "Refused",  # registration
    "addresses_of",  # env
    "start_cost",  # registration
    "thread_stacks",  # heartbeat
]

log = logging.getLogger(__name__)


class CoordinatorClient:
    """A worker's view of the coordinator: registration, heartbeats, the current epoch, metrics.

    When the connection fails, the client finds out why (``lost``): ``"cut"`` if the coordinator that
    admitted this worker still answers (only this worker's connection was cut: it leaves, the job goes on);
    if it does not, the client holds on for ``hold_s`` while a coordinator comes back, and is ``lost =
    "coordinator"`` only if none does. ``news_relay``: the socket of this host's news relay (default: from
    ``UNBROKEN_NEWS_RELAY``, which the agent sets; none: the client watches the coordinator itself).
    ``host_beat``: this process's slot on its host's beat board (default: from ``UNBROKEN_HOST_BEAT``, which an
    agent sets under ``comm.heartbeats = "host"``; none: the client sends its heartbeats itself). ``spare``: the
    index of the warm spare this process was, promoted to ``worker_id`` (its registration says so, and the
    coordinator admits it without the joiners' last call).
    """

    def __init__(
        self,
        address: str,
        worker_id: int | None,
        heartbeat_interval_s: float = 0.25,
        heartbeat_timeout_s: float = 2.0,
        token: str | None = None,
        hold_s: float = 60.0,
        fingerprint: dict[str, str] | None = None,
        news_relay: str | None = None,
        host_beat: WorkerBeat | None = None,
        spare: int | None = None,
    ) -> None:
        self.addresses = addresses_of(address)
        self.fingerprint = dict(fingerprint or {})  # what decides this worker's bits (core.numerics)
        self.token = token or require_token()
        self.hold_s = hold_s
        self.spare = spare
        self._stopping = threading.Event()  # the client closes: every thread ends at its next look
        self._threads: list[threading.Thread] = []
        host_beat = host_beat if host_beat is not None else WorkerBeat.from_env()
        self.heartbeat = Heartbeat(heartbeat_interval_s, heartbeat_timeout_s, host_beat)
        self.outbox = MetricsOutbox()
        probe_s = max(1.0, heartbeat_timeout_s)
        self.reconnection = Reconnection(
            self.addresses, self.token, hold_s, probe_s, self._stopping, self._readmit, self._resume, self._lost
        )
        self.store: Any = HeldStore(self._current, self.reconnection)
        self.connections = Connections(self.addresses, self.token, probe_s, hold_s)
        self.worker_id, self.late = self._register(worker_id, returning=False)
        current = self.connections.store
        self.reconnection.incarnation = current.get(keys.INCARNATION).decode()
        epoch = int(current.get(keys.EPOCH))
        members = frozenset(read_json(current, keys.epoch(epoch))["members"]) if epoch else frozenset()
        relay = news_relay if news_relay is not None else os.environ.get(RELAY_ENV) or None
        self.news = NewsWatch(self.worker_id, epoch, members, relay, self._stopping)
        self.job = JobKeys(self.store, self._current, self.worker_id)
        self.groups = GroupNotes(self._current, self.worker_id)
        self._start_watchers(self.reconnection.generation)

    # -- what the worker knows -----------------------------------------------------------------------
    @property
    def lost(self) -> str | None:
        """``"cut"`` or ``"coordinator"`` once the client gave up on the coordinator (``reconnect``), else None."""
        return self.reconnection.lost

    @property
    def holding(self) -> bool:
        """Whether the client is looking for a coordinator now (its connection failed)."""
        return self.reconnection.holding

    @property
    def incarnation(self) -> str:
        return self.reconnection.incarnation

    @property
    def address(self) -> str:
        return self.connections.address

    @property
    def stopped(self) -> str | None:
        """Why the run stops for this worker (the job's stop, or the client lost), None while it goes on."""
        return self.news.stopped

    @property
    def latest_epoch(self) -> int:
        return self.news.latest_epoch

    @property
    def excluded(self) -> bool:
        return self.news.excluded

    @property
    def on_epoch(self) -> Callable[[int, tuple[int, ...]], None] | None:
        """Called by the news watcher with (epoch, members) of each newest epoch it reads (the step protocol forms
        the epoch's group ahead of need): must be quick and must not raise."""
        return self.news.on_epoch

    @on_epoch.setter
    def on_epoch(self, callback: Callable[[int, tuple[int, ...]], None] | None) -> None:
        self.news.on_epoch = callback

    @property
    def relayed(self) -> bool:
        """Whether the news watcher takes the news from this host's relay now."""
        return self.news.relay is not None

    def removed_since(self, epoch: int, members: tuple[int, ...]) -> bool:
        """True if an epoch newer than ``epoch`` removed one of ``members`` (cheap: the watcher's cache)."""
        return self.news.removed_since(epoch, members)

    # -- the job's keys (job.JobKeys) and the group notes (groups.GroupNotes) -------------------------
    def config_toml(self) -> str:
        return self.job.config_toml()

    def run_dir(self) -> Path:
        return self.job.run_dir()

    def current_epoch(self) -> int:
        return self.job.current_epoch()

    def epoch_record(self, epoch: int) -> Epoch:
        return self.job.epoch_record(epoch)

    def stop_reason(self) -> str | None:
        return self.job.stop_reason()

    def refusal(self) -> str | None:
        return self.job.refusal()

    def wait_for_epoch(self, timeout_s: float, after: int = 0) -> Epoch | None:
        return self.job.wait_for_epoch(timeout_s, after, self.news.note_epoch)

    def done(self) -> bool:
        return self.job.done()

    def mark_done(self) -> None:
        self.job.mark_done()

    def stop_job(self, reason: str) -> bool:
        return self.job.stop_job(reason)

    def report_error(self, error: WorkerError) -> bool:
        return self.job.report_error(error)

    def named_to_save(self) -> bool:
        return self.job.named_to_save()

    def tell_saved(self, words: str) -> None:
        self.job.tell_saved(words)

    def announce_forming(self, epoch: int) -> None:
        self.groups.announce_forming(epoch)

    def left_for_newer(self, epoch: int, members: tuple[int, ...]) -> bool:
        return self.groups.left_for_newer(epoch, members)

    def report_timeout(self, epoch: int) -> None:
        self.groups.report_timeout(epoch)

    # -- metrics (outbox.MetricsOutbox) ---------------------------------------------------------------
    def publish_metrics(self, record: dict[str, Any]) -> None:
        """Queue ``record`` for the coordinator's metrics.jsonl; the sender thread delivers it."""
        self.outbox.put(record)

    def flush_metrics(self, timeout_s: float = STORE_TIMEOUT_S) -> bool:
        """Wait until every record queued so far is in the store; False if that did not happen in time
        (the connection failed and no coordinator came back)."""
        return self.outbox.flush(lambda: self.lost is not None, timeout_s)

    # -- waits ---------------------------------------------------------------------------------------
    def wait_removed(self, timeout_s: float) -> bool:
        """Whether this worker was removed from the membership or the run is stopping, waiting up to
        ``timeout_s`` for the news (a replica-mate's death is seen by the coordinator within a heartbeat
        timeout)."""
        return _wait_until(lambda: self.excluded or self.stopped is not None or self.lost is not None, timeout_s)

    def wait_stopped(self, timeout_s: float) -> bool:
        """Wait (bounded) until the job's stop is seen; True if it was."""
        return _wait_until(lambda: self.stopped is not None, timeout_s)

    def wait_lost(self, timeout_s: float) -> str | None:
        """After a store call failed: wait (bounded) for the verdict; None if the connection is fine again."""
        return self.reconnection.wait_lost(timeout_s)

    def new_connection(self) -> TCPStore:
        """Another connection to the store, for a blocking user such as a group's rendezvous (``Connections``)."""
        return self.connections.new_connection()

    # -- the threads of a connection, and the move to another coordinator ------------------------------
    def _current(self) -> TCPStore:
        return self.connections.store

    def _register(self, worker_id: int | None, returning: bool) -> tuple[int, bool]:
        """Ask the coordinator for admission; (the admitted id, whether this worker joins a running job)."""
        return register(self.connections.store, worker_id, returning, self.fingerprint, self.spare)

    def _start_watchers(self, generation: int) -> None:
        """Three threads on connection ``generation``: the sender (a heartbeat every interval and the queued
        metrics records), the news watcher (asleep in a wait for the next news) and the stall watch."""
        self.heartbeat.restart()  # the sender beats at once: a late beat is counted from here
        self._threads = [
            threading.Thread(target=self._send, args=(generation,), name="heartbeat+metrics", daemon=True),
            threading.Thread(target=self._watch_news, args=(generation,), name="epoch-watch", daemon=True),
            threading.Thread(
                target=self.reconnection.watch_for_successor,
                args=(generation, self.heartbeat),
                name="stall-watch",
                daemon=True,
            ),
        ]
        for thread in self._threads:
            thread.start()

    def _send(self, generation: int) -> None:
        try:
            self.heartbeat.run(self.connections.sender_store, self.worker_id, self.outbox)
        except RuntimeError:
            self.reconnection.connection_failed(generation)

    def _watch_news(self, generation: int) -> None:
        try:
            self.news.run(self.connections.news_store, self.reconnection.incarnation)
        except RuntimeError:
            self.reconnection.connection_failed(generation)

    def _readmit(self, address: str, store: TCPStore, tunnel: Tunnel) -> str | None:
        """Register again, under the same id, with the coordinator at ``address`` that replaced the dead one (its
        ``store`` and ``tunnel``), its old connections cut and their threads ended; None once re-admitted, else
        why not (a RuntimeError: a store call failed)."""
        log.warning("the coordinator was replaced (now at %s); registering again as worker %d", address, self.worker_id)
        self.connections.cut()
        self.news.drop_relay()  # the new watcher connects to it again, and takes only the new coordinator's news
        for thread in self._threads[:2]:  # the sender and the news watcher (the stall watch ends at the new generation)
            thread.join(timeout=self.reconnection.probe_timeout_s + 1.0)
        self.connections.adopt(address, store, tunnel)
        self.connections.open_watchers()
        worker_id, _late = self._register(self.worker_id, returning=True)
        if worker_id != self.worker_id:
            return f"the new coordinator admitted this worker as {worker_id}, not {self.worker_id}"
        return None

    def _resume(self, generation: int) -> None:
        """Re-admitted: send again what the dead coordinator may not have written (the new one drops duplicates),
        and start the threads of connection ``generation``."""
        self.outbox.resend_recent()
        self._start_watchers(generation)

    def _lost(self, reason: str) -> None:
        self.news.note_stop(reason)

    def close(self) -> None:
        """Stop the threads (the sender delivers what was queued, then ends; the news watcher's wait is ended
        by its connection's end, ``Connections.end_news_wait``); joined so that no thread is inside a store call
        while the interpreter shuts down."""
        self.outbox.close()
        self._stopping.set()
        self.connections.end_news_wait()
        self.news.drop_relay()
        self.connections.close()
        # The diagnosis of a lost connection makes store calls too (it ends at its next look, at ``_stopping``).
        diagnosis = self.reconnection.diagnosis
        for thread in [*self._threads, *([diagnosis] if diagnosis is not None else [])]:
            thread.join(timeout=max(1.0, 4 * self.heartbeat.interval_s) + self.reconnection.probe_timeout_s)


def _wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout_s`` has passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
