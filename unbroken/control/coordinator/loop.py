"""The coordinator (one small process per job, never a training worker) and the workers' client of it.

Owns membership. The coordinator hosts the rendezvous store (torch.distributed's TCPStore), admits
workers, watches their heartbeats and the launcher's process-exit reports, and publishes a new membership
epoch whenever a worker dies or joins. It also drains the metrics the workers publish into
``RUN_DIR/metrics.jsonl``.

The store itself listens on 127.0.0.1 on an internal port; the job's public address (127.0.0.1 unless
told otherwise) is served by ``gateway.Gateway``, which admits only clients that prove they hold the
job's token (``UNBROKEN_TOKEN``) and pipes them to the store. Clients connect with ``connect_store``
through an authenticated local tunnel, so every worker in a process group was admitted by the gateway.

The store's keys, who writes and who reads each, are listed in ``control.keys``.

A collective that times out while every heartbeat still arrives (a stalled member, a slow or partitioned
link) is reported by the members that waited (``timeout/<e>/<id>``); the coordinator, the one place that
sees everything, decides within the step: the first time it re-forms the same members (an epoch marked
``reform``: every member abandons the old group and forms a fresh one); if the re-formed group times out
again, the members that never reported either time are declared failed and the rest go on without them,
as after a kill. The job stops only when no majority of the group where it began is left.

With replicas of several ranks (``[parallel]``, ``core.layout``) membership is by whole replicas: the death,
silence or exclusion of any rank removes its replica's every rank in the same epoch, and a replica that
restarts is admitted only once all of its ranks have registered.

Nothing polls at a high rate (the coordinator and the launcher share the workers' cores, so every wake-up
is taken from training). The coordinator sleeps in a store wait on the next ``bell/<n>``; whoever writes
something it must act on rings it. Between rings it wakes every ``heartbeat_timeout_s /
CHECKS_PER_TIMEOUT`` for a quiet tick, one round trip that reads every heartbeat counter and the metrics
sequence; the full pass over registrations, death reports, stop and done runs when the bell rang, and at
least once per heartbeat timeout regardless. Each worker sends a heartbeat (one ``add``) every heartbeat interval on
one connection, and a second thread sleeps in a store wait on the next ``news/<n>`` on another, so a new
epoch or a stop reaches every worker as soon as the store sees it. A hang is declared after
``heartbeat_timeout_s`` of silence, seen at most one heartbeat interval and two ticks later.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unbroken.control.coordinator import bugs
from unbroken.control.coordinator.failslow import SlowRule
from unbroken.control.status.alerts import Alerter
from unbroken.control.status.model import GoodputRecorder, MetricsTee, RunView, SlowRecorder
from unbroken.control.status.progress import describe_error
from unbroken.control.status.server import StatusServer
from unbroken.control.status.tensorboard import open_tensorboard
from unbroken.control.store import keys
from unbroken.control.store.connect import (
    get_int,
    process_failure,
    raised_failure,
    read_json,
    request_stop,
    serve_store,
    wait_key,
)
from unbroken.control.store.durable import StaleWriteError, State, StateStore, StateUnavailableError, Worker
from unbroken.control.store.gateway import Gateway, require_token
from unbroken.core import ckptfiles
from unbroken.core.config import Reduction, RunConfig, SlowPolicy, Workload, to_toml
from unbroken.core.layout import ReplicaLayout
from unbroken.core.numerics import group_fingerprint, refusal
from unbroken.core.records import (
    METRICS_FILE,
    ErrorPhase,
    MetricsFile,
    RecordKind,
    WorkerError,
    decode,
    line_identity,
    make,
    read_records,
)

if TYPE_CHECKING:
    from unbroken.control.host.zygote import ForkedProcess, Zygote
log = logging.getLogger(__name__)

RECENT_LINES = 4096  # metrics lines remembered (their ``line_identity``), to drop one a worker sends again
CHECKS_PER_TIMEOUT = 10  # heartbeat checks (and metrics drains) per heartbeat timeout; events wake it at once
MAX_TICK_S = 0.25
# Joiners are taken in at a "last call": once registrations have been quiet this long, or the first of them has
# waited JOIN_WAIT_MAX_S (a steady trickle cannot hold them back). Every epoch change makes every member form a
# new group, so 64 workers registering within moments of each other join in one change, not 64. A promoted warm
# spare is taken in at once: it replaces one death, and a replacement in under a second is what spares are for.
JOIN_QUIET_S = 0.25
JOIN_WAIT_MAX_S = 2.0
METRIC_HOLE_GRACE_S = 1.0  # a metrics number not written after this long: its writer died (or is stopped)
METRIC_HOLE_FORGET_S = 600.0  # ... and after this long it is not looked for any more
# At a stop for a bug, the wait for the named worker's save while its heartbeats go on: it reaches its leaving
# at its next call into the protocol (a step's compute, a collective's bound), then saves; a training thread
# hung in the user's code never does.
MAX_SAVE_WAIT_S = 600.0
SAVE_RETRY_S = 0.1  # between saves of an epoch while the state store is out of reach
# After a stop the members go on until they see it (a step may commit meanwhile, a checkpoint be written), then
# their senders deliver what they queued and end: the records are taken until every member's heartbeats have
# been quiet this many intervals, for at most STOP_DRAIN_S (half the launcher's grace before it kills).
STOP_QUIET_BEATS = 3
STOP_DRAIN_S = 5.0


class Deposed(Exception):
    """This coordinator no longer leads: another one took over (internal)."""


def _tail_lines(path: Path, nbytes: int = 2**20) -> list[str]:
    """The complete lines among the last ``nbytes`` of ``path`` (none if it does not exist)."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - nbytes))
        lines = f.read().decode(errors="replace").splitlines()
    return lines[1:] if size > nbytes else lines


@dataclass
class Stall:
    """A collective that timed out with every heartbeat arriving: what the coordinator did about it."""

    base: tuple[int, ...]  # the members when it began (the majority rule counts from these)
    retry_epoch: int  # the epoch that re-formed them
    suspects: frozenset[int]  # members that did not report the first timeout


class Coordinator:
    """Membership service for one job. ``run()`` loops until the job is done, stopped or abandoned.

    With a state store (``control.statestore``) the hard state is saved before every epoch is published, and
    a coordinator that finds state there is a *restarted* one: it restores the epoch counter and the admitted
    workers, waits up to ``coordinator.rejoin_window_s`` for the last members to register again (they kept
    training meanwhile), and publishes the next epoch with those that came back."""

    def __init__(
        self,
        sock: socket.socket,
        cfg: RunConfig,
        run_dir: Path,
        expected_workers: int,
        resume: bool,
        parent_pid: int | None = None,
        token: str | None = None,
        state: StateStore | None = None,
        restore: bool = False,
    ) -> None:
        self.sock = sock  # the public socket, served by the gateway
        host, port = sock.getsockname()[:2]
        self.address = f"{host}:{port}"
        self.port = port
        self.store, internal_port = serve_store()
        self.token = token if token is not None else require_token()
        self.gateway = Gateway(sock, ("127.0.0.1", internal_port), self.token)
        self.cfg = cfg
        self.layout = ReplicaLayout.of(cfg.parallel)
        self.joining: set[int] = set()  # admitted workers whose replica is not complete yet
        self.joining_since = self.last_registration = 0.0  # the join's last call (JOIN_QUIET_S)
        self.run_dir = run_dir
        self.expected = expected_workers
        self.heartbeat_timeout_s = cfg.comm.heartbeat_timeout_s
        self.join_timeout_s = cfg.comm.join_timeout_s
        self.parent_pid = parent_pid
        self.state_store = state
        prior = state.load() if state is not None else None
        self.incarnation = secrets.token_hex(8)
        self.store.set(keys.CONFIG, to_toml(cfg))
        self.store.set(keys.RUN_DIR, str(run_dir))
        self.store.set(keys.EXPECTED, str(expected_workers))
        self.store.set(keys.INCARNATION, self.incarnation)
        for counter in (keys.METRICS_SEQ, keys.DEATHS, keys.TIMEOUTS):
            self.store.add(counter, 0)  # exists from the start: the quiet tick reads them with the heartbeats
        # What the dead/<id> and timeout/<e>/<id> keys said at the last look, and the (count, epoch, members)
        # it was taken at: looked at again only when one of those moved (one read a tick, not one per member).
        self._deaths_seen: tuple[int, int, tuple[int, ...]] | None = None
        self._timeouts_seen: tuple[int, int, tuple[int, ...]] | None = None
        self._timeouts_reported: set[int] = set()
        self.deaths_count = self.timeouts_count = 0
        self.rung = 0
        self.news_rung = get_int(self.store, keys.doorbell_seq(keys.NEWS))  # the workers' doorbell, last rung here
        self.next_registration = 1
        self.next_worker_id = 0
        self.admitted: dict[int, dict[str, Any]] = {}
        # Exact mode: the fingerprint every member shares (core.numerics), fixed when the first epoch forms (after
        # a restart: the first member that comes back); a joiner that differs is refused.
        self.exact = cfg.recovery.reduction is Reduction.EXACT
        self.fingerprint: dict[str, str] | None = None
        self.refused: set[int] = set()
        self.members: tuple[int, ...] = ()
        self.epoch = 0
        self.committed_step = -1
        self.saved_step = -1
        self.heartbeats: dict[int, tuple[int, float]] = {}
        self._watched_at = time.monotonic()  # when the heartbeats were last looked at
        self.tick_s = min(MAX_TICK_S, self.heartbeat_timeout_s / CHECKS_PER_TIMEOUT)
        self.next_metric = 1
        self.hole_since: dict[int, float] = {}  # metrics numbers taken but not written yet -> first seen so
        self.passed_holes: dict[int, float] = {}  # ... and those passed over -> when
        self.recent_lines: collections.deque[str] = collections.deque(maxlen=RECENT_LINES)
        self.recent_set: set[str] = set()
        for line in _tail_lines(run_dir / METRICS_FILE):
            self._remember(line_identity(line))
        self.view = RunView(cfg.train.steps, expected_workers, run_dir)
        records = read_records(run_dir)
        self.view.extend(records)  # a restarted coordinator's view starts where the run is
        # Workers' exceptions, in the order reported (core.bugs tells a bug from a failing host). Those of the
        # run so far count: a restarted coordinator, the restart policy's relaunch and a --resume go on with them
        # (a bug not fixed stops the run the first time it raises again; a fix moves or removes the place).
        self.errors = [WorkerError.from_record(r) for r in records if r.get("type") == RecordKind.ERROR]
        self.next_error = 1
        self.error_hole_since: dict[int, float] = {}
        self.raised: dict[int, WorkerError] = {}  # members that reported an exception: dead, to be removed
        self.bug: str | None = None  # the stop line when an error repeated
        self.saver: int | None = None  # the member named to save the state it holds at that stop
        tensorboard = open_tensorboard(run_dir, cfg.metrics.tensorboard)
        self.metrics = MetricsTee(MetricsFile(run_dir), self.view, tensorboard)
        self.metrics.sinks.append(GoodputRecorder(self.metrics, cfg.metrics.goodput_every, records))
        self.alerter = Alerter(cfg.metrics, str(run_dir))
        if self.alerter.enabled:
            self.metrics.sinks.append(self.alerter)
        # Fail-slow workers to exclude (recovery.slow = "exclude"), removed at the next look for the dead; and
        # those that may not come back (recovery.slow_rejoin = false), refused at registration.
        self.slow_exclusions: dict[int, str] = {}
        self.barred: dict[int, str] = {}
        self.slow_rejoin = cfg.recovery.slow_rejoin
        # recovery.slow = "rebalance": the workload every epoch published carries while a worker is fail-slow.
        self.workload_override = ""
        self.rebalance_due: str | None = None  # the override to publish at the next look ("" switches it off)
        if cfg.recovery.slow is not SlowPolicy.OFF:
            self.metrics.sinks.append(self._slow_recorder(cfg, records))
        self.started = time.monotonic()
        self.stopping = threading.Event()
        self.stall: Stall | None = None
        self.first_timeout: dict[int, float] = {}  # epoch -> when its first timeout report was seen
        # A restarted coordinator: the members it waits for, and those that came back.
        self.restored: tuple[int, ...] = ()
        self.returned: set[int] = set()
        self.recover_until = 0.0
        # A new launch of a run continues its epoch numbers (the journal refuses older ones); only a coordinator
        # that replaces a dead one (``restore``) waits for the members it left.
        self.epoch_floor = prior.epoch if prior is not None else 0
        if restore and prior is not None and prior.epoch > 0:
            self.epoch, self.restored, self.committed_step = prior.epoch, prior.members, prior.committed_step
            self.saved_step = self.committed_step
            self.next_worker_id = prior.next_worker_id
            self.admitted = {w: {"host": v.host, "pid": v.pid} for w, v in prior.admitted.items()}
            self.recover_until = time.monotonic() + cfg.coordinator.rejoin_window_s
            record = {"epoch": prior.epoch, "members": list(prior.members), "reason": "restored", "reform": False}
            self.store.set(keys.epoch(prior.epoch), json.dumps(record))
            resume = False  # the workers hold the state; a joiner receives it from them
        self.store.set(keys.EPOCH, str(self.epoch))
        self.store.set(keys.RESUME, "1" if resume else "0")
        self.status: StatusServer | None = None
        if cfg.coordinator.status_port >= 0:
            c = cfg.coordinator
            self.status = StatusServer(self.view, host=c.status_host, port=c.status_port, token=self.token).start()
        self.emit(
            RecordKind.COORDINATOR,
            incarnation=self.incarnation,
            restored_epoch=self.epoch if self.restored else 0,
            address=self.address,
            status=self.status.url if self.status is not None else "",
        )
        if self.restored:
            log.warning("restarted: epoch %d, waiting for members %s to return", self.epoch, list(self.restored))

    # -- output -------------------------------------------------------------------------------------
    def emit(self, kind: RecordKind, **fields: Any) -> None:
        self.metrics.write(make(kind, time.time(), **fields))

    # -- membership ---------------------------------------------------------------------------------
    def _admit_new(self) -> list[int]:
        joined = []
        seq = get_int(self.store, keys.REGISTER_SEQ)
        while self.next_registration <= seq:
            n = self.next_registration
            if not self.store.check([keys.register(n)]):
                break  # the worker incremented the counter but has not written its request yet
            request = read_json(self.store, keys.register(n))
            wid = request.get("worker_id", -1)
            # Before the first epoch an admitted id may register again: a restart of a process that died
            # (its death was reported) keeps its id; anything else is a duplicate and gets a fresh one.
            replaced = wid in self.admitted and self.epoch == 0 and self.store.check([keys.dead(wid)])
            returning = bool(request.get("returning")) and wid in self.restored and wid not in self.returned
            taken = wid in self.members or (wid in self.admitted and not replaced and self.epoch == 0)
            if wid is None or wid < 0 or (taken and not returning):
                wid = max([self.next_worker_id, *[w + 1 for w in self.admitted]])
            # A worker that died may come back under its old id (the launcher restarts it so).
            self.next_worker_id = max(self.next_worker_id, wid + 1)
            self.admitted[wid] = request
            self.heartbeats[wid] = (get_int(self.store, keys.heartbeat(wid)), time.monotonic())
            self.store.delete_key(keys.dead(wid))
            self.store.delete_key(keys.refused(wid))
            fingerprint = request.get("fingerprint") or {}
            self.emit(
                RecordKind.ADMITTED,
                worker=wid,
                host=str(request.get("host", "")),
                fingerprint=fingerprint,
                start_s=request.get("start_s"),
                start_cpu_s=request.get("start_cpu_s"),
                forked=bool(request.get("forked")),
            )
            if self.exact and self.fingerprint is None and (returning or self.epoch > 0):
                self.fingerprint = fingerprint  # a restarted coordinator: the state's holders define the group
            line = refusal(wid, fingerprint, self.fingerprint) if self.exact and self.fingerprint else None
            line = self.barred.get(wid, line)
            if line is not None and not returning:
                self._refuse(wid, line)  # before its id is answered, so it learns at registration
            self.store.set(keys.register_late(n), "1" if self.epoch > 0 and not returning else "0")
            self.store.set(keys.register_id(n), str(wid))
            if returning:
                self.returned.add(wid)  # a member that kept the state through the coordinator's restart
            elif line is None:
                joined.append(wid)
            self.next_registration += 1
        return joined

    def _promoted_spare(self, wid: int) -> bool:
        """Whether ``wid`` registered as a warm spare promoted to a dead worker's place: it is taken in at once,
        not at the joiners' last call (it replaces a death its agent has just reported, and is already built)."""
        return self.admitted.get(wid, {}).get("spare") is not None

    def _refuse(self, wid: int, line: str) -> None:
        """Keep ``wid`` out of the membership (exact mode, another fingerprint): it reads why and leaves."""
        self.refused.add(wid)
        self.store.set(keys.refused(wid), line)
        self.emit(RecordKind.REFUSED, worker=wid, reason=line)
        log.warning("%s", line)
        self.announce()

    def _start_members(self) -> tuple[int, ...]:
        """The first epoch's members: every admitted worker; under exact mode only those whose fingerprint is
        the one most of them share (the others are refused)."""
        admitted = [w for w in self.admitted if w not in self.refused]
        if not self.exact or not admitted:
            return tuple(admitted)
        fingerprints = {w: self.admitted[w].get("fingerprint") or {} for w in admitted}
        self.fingerprint = dict(group_fingerprint(fingerprints))
        members = []
        for wid in admitted:
            line = refusal(wid, fingerprints[wid], self.fingerprint)
            if line is None:
                members.append(wid)
            else:
                self._refuse(wid, line)
        return tuple(members)

    def _read_counters(self) -> tuple[list[int], int]:
        """Every member's heartbeat counter and the metrics sequence, in one round trip (every one of those
        counters exists: ``get_int`` created each heartbeat counter at admission); the death and timeout
        report counts in the same trip (``deaths_count``, ``timeouts_count``)."""
        counters = [keys.METRICS_SEQ, keys.DEATHS, keys.TIMEOUTS]
        raw = self.store.multi_get([*(keys.heartbeat(wid) for wid in self.members), *counters])
        self.deaths_count, self.timeouts_count = int(raw[-2]), int(raw[-1])
        return [int(r) for r in raw[:-3]], int(raw[-3])

    def _slow_recorder(self, cfg: RunConfig, records: list[dict[str, Any]]) -> SlowRecorder:
        """The fail-slow rule's sink (``recovery.slow``), which hands this coordinator the workers to exclude and the
        workload's switches; ``records``: the run's so far."""
        r = cfg.recovery
        rule = SlowRule(r.slow_window, r.slow_windows, r.slow_ratio)
        act = (self._exclude_slow, self._rebalance, r.workload, self.layout.size)
        return SlowRecorder(self.metrics, rule, records, r.slow, cfg.train.steps, *act)

    def _rebalance(self, on: bool) -> None:
        """Switch the throughput workload on (a worker is fail-slow) or off (none is any more), from the next
        epoch on: published at the next look (``SlowRecorder``, on this thread while draining)."""
        self.rebalance_due = str(Workload.THROUGHPUT) if on else ""

    def _exclude_slow(self, unit: int, why: str) -> None:
        """A fail-slow worker (of replicas of several ranks, replica ``unit``: its first rank, whose removal takes
        the replica down) to remove like a failed one (``SlowRecorder``, on this thread while draining). Never the
        group's leader: the recorder rebalances around it instead, and this holds whatever the recorder saw."""
        wid = self.layout.workers_of(unit)[0]
        if wid in self.members and wid != min(self.members):
            self.slow_exclusions[wid] = why
            if not self.slow_rejoin:
                for w in self.layout.workers_of(unit):
                    self.barred[w] = f"worker {w} was excluded as fail-slow and recovery.slow_rejoin = false"

    def _dead(self, counts: list[int], reported: bool) -> dict[int, str]:
        """Members that died: reported by the launcher (looked up only when ``reported`` may have news) or
        silent for longer than the heartbeat timeout."""
        dead: dict[int, str] = {}
        now = time.monotonic()
        # The reports are read only when their count (or the membership) moved since the last read; a report
        # adds to the count after writing its key, and the count was read before the keys, so none is missed.
        looked = (self.deaths_count, self.epoch, self.members)
        reported = reported and looked != self._deaths_seen
        if reported:
            self._deaths_seen = looked
        # Silence is evidence only for the time the coordinator was watching: after a gap of its own (its
        # process not scheduled on an overloaded host, paused), the counters it last saw are stale, so they
        # count from now (found by chaos seed 2060 under a load of 12 on 2 cores: every worker "died").
        blind = now - self._watched_at > self.heartbeat_timeout_s / 2
        self._watched_at = now
        for wid in [w for w in self.slow_exclusions if w not in self.members]:
            del self.slow_exclusions[wid]  # it died or left meanwhile
        for wid, count in zip(self.members, counts, strict=True):
            if wid in self.slow_exclusions:
                dead[wid] = self.slow_exclusions.pop(wid)
                continue
            if wid in self.raised:  # its process is ending (its exit, reported next, is not news)
                dead[wid] = raised_failure(self.raised.pop(wid).headline())
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

    def _failure_record(self, wid: int, why: str) -> None:
        """A failure, with its detection latency when the launcher recorded when it delivered the fault."""
        extra: dict[str, Any] = {}
        now = time.time()
        if self.store.check([keys.injected(wid)]):
            injected = read_json(self.store, keys.injected(wid))
            extra = {"event": injected["event"], "detection_s": now - injected["time"]}
            self.store.delete_key(keys.injected(wid))
        self.metrics.write(make(RecordKind.FAILURE, now, worker=wid, why=why, epoch=self.epoch, **extra))

    def drain_until_members_quiet(self, limit_s: float = STOP_DRAIN_S) -> None:
        """Take the members' records until each one's heartbeats have stopped for ``STOP_QUIET_BEATS`` intervals
        (its sender ends after delivering what it queued), or ``limit_s`` has passed (a member still in a long
        step, or hung). Without it a stop lost the records of a step committed while the members learnt of it."""
        quiet_s = STOP_QUIET_BEATS * self.cfg.comm.heartbeat_interval_s
        deadline = time.monotonic() + limit_s
        seen: dict[int, tuple[int, float]] = {}  # member -> (its heartbeat count, when that count was first read)
        while True:
            counts, seq = self._read_counters()
            self._drain_metrics(seq)
            now = time.monotonic()
            for wid, count in zip(self.members, counts, strict=True):
                if seen.get(wid, (None, now))[0] != count:
                    seen[wid] = (count, now)
            if all(now - since >= quiet_s for _, since in seen.values()) or now >= deadline:
                return
            time.sleep(self.cfg.comm.heartbeat_interval_s / 2)

    def _drain_metrics(self, seq: int | None = None, final: bool = False) -> None:
        """Append the queued records in sequence order. A writer takes its number (``add``) and then writes
        the record (``set``): one killed in between leaves a number that never fills. Such a hole holds the
        queue for ``METRIC_HOLE_GRACE_S`` (a live writer fills it in microseconds, and waiting keeps the file
        in order), then is passed over and looked at again on every pass, so a writer that was only stopped
        still gets its record in, late; ``final`` (the run is over) passes every hole at once."""
        if seq is None:
            seq = get_int(self.store, keys.METRICS_SEQ)
        now = time.monotonic()
        for hole, since in list(self.passed_holes.items()):
            if self.store.check([keys.metrics(hole)]):
                self._append_metric(keys.metrics(hole))
                del self.passed_holes[hole]
            elif now - since > METRIC_HOLE_FORGET_S:
                del self.passed_holes[hole]
        while self.next_metric <= seq:
            key = keys.metrics(self.next_metric)
            if not self.store.check([key]):
                since = self.hole_since.setdefault(self.next_metric, now)
                if not final and now - since < METRIC_HOLE_GRACE_S:
                    break
                log.warning("metrics record %d was never written (its writer died?); going on without it",
                            self.next_metric)  # fmt: skip
                self.passed_holes[self.next_metric] = now
            else:
                self._append_metric(key)
            self.hole_since.pop(self.next_metric, None)
            self.next_metric += 1

    def _append_metric(self, key: str) -> None:
        line = self.store.get(key).decode()
        record = decode(line)  # once: the dedup, the file, the live views and the committed step all take it
        identity = line_identity(line, record)
        if identity not in self.recent_set:  # a worker sends its recent records again to a new coordinator
            self.metrics.write_line(line, record)
            self._remember(identity)
            if record is not None and record["type"] == RecordKind.STEP and not record.get("skipped"):
                self.committed_step = max(self.committed_step, int(record["step"]))
        self.store.delete_key(key)

    def _remember(self, line: str) -> None:
        if len(self.recent_lines) == self.recent_lines.maxlen:
            self.recent_set.discard(self.recent_lines[0])
        self.recent_lines.append(line)
        self.recent_set.add(line)

    def save_state(self, epoch: int, members: tuple[int, ...], must: bool = True) -> None:
        """Write the hard state ahead of publishing ``epoch`` (an epoch number is then never handed out twice,
        whatever happens to this process); a deposed coordinator (etcd) stops here.

        While the store cannot be reached (etcd electing its leader, or this host cut off from its majority), a
        save that an epoch waits for (``must``) is tried again for as long as this coordinator's lease lasts, and
        a coordinator whose lease ran out meanwhile stops acting (``Deposed``): it publishes nothing it could
        not save. Any other save is left to the next pass."""
        if self.state_store is None:
            self.saved_step = self.committed_step
            return
        state = State(
            epoch=epoch,
            members=tuple(sorted(members)),
            committed_step=self.committed_step,
            data_cursor=self.committed_step + 1,
            admitted={w: Worker(str(r.get("host", "")), int(r.get("pid", 0))) for w, r in self.admitted.items()},
            next_worker_id=max([self.next_worker_id, *(w + 1 for w in self.admitted)]),
        )
        while True:
            try:
                self.state_store.save(state)
                break
            except StaleWriteError as e:
                log.error("another coordinator leads now (%s); stepping down", e)
                self.stopping.set()
                raise Deposed from e
            except StateUnavailableError as e:
                if not self.state_store.is_leader():
                    log.error("the state store is out of reach and this coordinator's lease ran out; stepping down")
                    self.stopping.set()
                    raise Deposed from e
                if not must:
                    log.warning("the state store is out of reach (%s); saving on a later pass", e)
                    return
                log.warning("the state store is out of reach (%s); epoch %d waits until it is saved", e, epoch)
                time.sleep(SAVE_RETRY_S)
        self.saved_step = state.committed_step

    def announce(self, epoch_record: str = "") -> None:
        """Ring the workers' doorbell, after publishing an epoch, a refusal or a stop. A ring is two calls (the
        count, then its key); one whose key never came (its ringer gone between them) would hold every watcher
        waiting on that key, so each count since this coordinator's last ring gets its key now. The ring of an
        epoch holds its record (as ``keys.epoch`` does), every other ring nothing: a watcher's get of the next
        ring waits for it and returns the epoch's record (``newsrelay.next_news``), one call per member at every
        epoch change."""
        n = self.store.add(keys.doorbell_seq(keys.NEWS), 1)
        for k in range(self.news_rung + 1, n + 1):
            self.store.set(keys.doorbell(keys.NEWS, k), epoch_record if k == n else "")
        self.news_rung = n

    def publish(self, members: tuple[int, ...], reason: str, reform: bool = False) -> None:
        epoch = max(self.epoch, self.epoch_floor) + 1
        self.save_state(epoch, members)
        self.epoch = epoch
        self.members = tuple(sorted(members))

        record = {"epoch": self.epoch, "members": list(self.members), "reason": reason, "reform": reform}
        if self.workload_override:
            record["workload"] = self.workload_override
        text = json.dumps({**record, "time": time.time()})
        self.store.set(keys.epoch(self.epoch), text)
        self.store.set(keys.EPOCH, str(self.epoch))
        self.announce(text)
        self.emit(RecordKind.MEMBERSHIP, **record, elapsed_s=time.monotonic() - self.started)
        log.info("epoch %d: members %s (%s)", self.epoch, list(self.members), reason)

    def stop(self, reason: str) -> bool:
        """Stop the job for ``reason``; True if it is the reason kept (nobody stopped it for another before)."""
        first = request_stop(self.store, reason)
        self.stopping.set()
        self.announce()
        return first

    # -- workers' exceptions ------------------------------------------------------------------------
    def _take_errors(self) -> list[WorkerError]:
        """The exceptions reported since the last look (``keys.error``), each recorded as it is read. A number
        taken but never written (its writer was killed in between) is passed over after a grace period."""
        new: list[WorkerError] = []
        seq = get_int(self.store, keys.ERROR_SEQ)
        while self.next_error <= seq:
            n, key = self.next_error, keys.error(self.next_error)
            if self.store.check([key]):
                try:
                    new.append(WorkerError.decode(self.store.get(key).decode()))
                except ValueError as e:
                    log.warning("error report %d is unreadable (%s); ignored", n, e)
                self.store.delete_key(key)
            elif time.monotonic() - self.error_hole_since.setdefault(n, time.monotonic()) < METRIC_HOLE_GRACE_S:
                break  # taken a moment ago: its writer is about to write it
            self.error_hole_since.pop(n, None)
            self.next_error += 1
        for error in new:
            record = error.record(time.time())
            self.metrics.write(record)
            log.error("%s", describe_error(record, self.run_dir / "logs"))  # a multi-host job's console
        return new

    def _judge_errors(self) -> bool:
        """Take the new error reports: a member that raised is dead (``_dead``); an error that repeats an earlier
        one (``core.bugs``) stops the job (True)."""
        for error in self._take_errors():
            if error.worker in self.members:
                self.raised[error.worker] = error
            same = bugs.repeated(self.errors, error)
            self.errors.append(error)
            if same:
                self._stop_for_bug(same)
                return True
        return False

    def _stop_for_bug(self, errors: list[WorkerError]) -> None:
        """Stop the job: the error repeated (a bug, not a failure). The lowest member that did not raise holds a
        good state (the last committed step) and is named to save it before it leaves; with none left, the
        worker that just raised does, unless it raised inside a commit (its optimizer may have stepped half-way):
        before or after a commit its state is the last committed step's too. The stop line then says which
        checkpoint is the last good one (``_await_saved``). Replicas of several ranks keep the last checkpoint
        on disk (their ranks would have to save together)."""
        line = bugs.stop_line(errors)
        raisers = {e.worker for e in self.errors}
        healthy = [w for w in self.members if w not in raisers]
        new = errors[-1]
        if self.layout.size == 1:
            if healthy:
                self.saver = min(healthy)
            elif new.worker in self.members and new.phase not in (ErrorPhase.COMMIT, ErrorPhase.SETUP):
                self.saver = new.worker  # it waits for this answer before it ends
        if self.saver is not None:
            self.store.set(keys.STOP_SAVER, str(self.saver))  # before the stop: whoever sees the stop can read it
        log.error("stopping: %s", line)
        if self.stop(line):
            self.bug = line

    def _await_saved(self) -> str:
        """After a stop for a bug: the words naming the last good checkpoint, from the member named to save the
        state once it has (waiting while its heartbeats arrive, so a save of any length is waited for and a
        saver that dies is not), else as the run directory shows them."""
        if self.saver is not None:
            key, counted = keys.heartbeat(self.saver), (-1, time.monotonic())
            deadline = time.monotonic() + MAX_SAVE_WAIT_S
            while not self.store.check([keys.STOP_SAVED]):
                count, now = get_int(self.store, key), time.monotonic()
                if count != counted[0]:
                    counted = (count, now)
                if now - counted[1] > self.heartbeat_timeout_s or now > deadline:
                    log.warning("worker %d did not say what it saved; naming the newest checkpoint", self.saver)
                    break
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    break
                self._drain_metrics()
                wait_key(self.store, keys.STOP_SAVED, self.tick_s)
            else:
                return self.store.get(keys.STOP_SAVED).decode()
        return ckptfiles.last_checkpoint_words(self.run_dir)

    def _retrying(self) -> bool:
        """The current epoch re-formed a stalled group: a second timeout in it excludes, not re-forms."""
        return self.stall is not None and self.stall.retry_epoch == self.epoch

    def _timeouts(self) -> set[int] | None:
        """Members that reported a timed-out collective of the current epoch, once it is time to decide (every
        member reported, or a window passed since the first report); None before that. The window is half a
        heartbeat timeout before a re-formation (cheap, and it changes nothing if wrong) and a whole one before
        an exclusion: a member that is only slow (still computing when the others' collective timed out)
        reports late, and must not be excluded for it."""
        looked = (self.timeouts_count, self.epoch, self.members)
        if looked != self._timeouts_seen:  # read the reports only when their count or the epoch moved
            self._timeouts_seen = looked
            self._timeouts_reported = {w for w in self.members if self.store.check([keys.timeout(self.epoch, w)])}
        reported = set(self._timeouts_reported)
        if not reported:
            return None
        now = time.monotonic()
        first = self.first_timeout.setdefault(self.epoch, now)
        window = self.heartbeat_timeout_s if self._retrying() else self.heartbeat_timeout_s / 2
        if len(reported) < len(self.members) and now - first < window:
            return None
        return reported

    def _decide_stall(self, reported: set[int]) -> None:
        """A collective of the current epoch timed out while every heartbeat arrives (no member died)."""
        suspects = frozenset(self.members) - reported
        if not self._retrying():
            self.stall = Stall(self.members, self.epoch + 1, suspects)
            self.emit(
                RecordKind.STALL,
                epoch=self.epoch,
                reported=sorted(reported),
                suspects=sorted(suspects),
                decision="re-form",
            )
            self.publish(
                self.members,
                f"a collective of epoch {self.epoch} timed out (reported by {sorted(reported)}); re-forming",
                reform=True,
            )
            return
        stalled = frozenset(self.layout.with_replicas((suspects & self.stall.suspects) or suspects))
        survivors = tuple(w for w in self.members if w not in stalled)
        if not stalled or 2 * len(survivors) <= len(self.stall.base):
            why = (
                f"collectives keep timing out among {list(self.members)} although every heartbeat arrives"
                if not stalled
                else f"after excluding {sorted(stalled)} no majority of {list(self.stall.base)} would be left"
            )
            self.emit(
                RecordKind.STALL,
                epoch=self.epoch,
                reported=sorted(reported),
                suspects=sorted(suspects),
                decision="stop",
            )
            self.stop(f"{why}; stopping (the last checkpoint is kept)")
            return
        self.emit(
            RecordKind.STALL, epoch=self.epoch, reported=sorted(reported), suspects=sorted(stalled), decision="exclude"
        )
        self.publish(survivors, "stalled twice: " + ", ".join(str(w) for w in sorted(stalled)))
        for wid in sorted(stalled):
            self._failure_record(wid, f"stalled in the collectives of epochs {self.epoch - 1} and {self.epoch}")
        self.stall = None

    def run(self) -> int:
        """Admit the expected workers, publish epochs, drain metrics; return 0 when the job is done."""
        start_deadline = time.monotonic() + self.join_timeout_s
        rung, ticks = True, 0
        try:
            while not self.stopping.is_set():
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    self.stop("the launcher died")
                    self.drain_until_members_quiet()  # the members read the stop before the store goes away
                    break
                # Everything but silence is announced by the bell; a full pass once per heartbeat timeout
                # anyway, in case a ringer died between writing its news and ringing.
                full = rung or ticks % CHECKS_PER_TIMEOUT == 0
                joined = self._admit_new() if full else []
                if full and self._judge_errors():
                    break
                counts, metrics_seq = self._read_counters()
                if self.epoch == 0:
                    if len(self.admitted) >= self.expected:
                        self.publish(self._start_members(), "start")
                    elif time.monotonic() > start_deadline:
                        self.stop(
                            f"only {len(self.admitted)} of {self.expected} workers joined "
                            f"within {self.join_timeout_s:.0f} s"
                        )
                        break
                elif self.restored and not self.members:
                    if set(self.restored) <= self.returned or time.monotonic() > self.recover_until:
                        self._end_restore(joined)
                        joined = []
                else:
                    dead = self._dead(counts, reported=full)
                    if dead:
                        down = set(self.layout.with_replicas(dead))  # a rank's death takes its replica down
                        survivors = tuple(w for w in self.members if w not in down)
                        if not survivors:
                            self.publish((), "every worker died")
                            self.stop("every worker died")
                            break
                        self.publish(survivors, "died: " + ", ".join(str(w) for w in sorted(dead)))
                        for wid, why in dead.items():
                            self._failure_record(wid, why)
                    elif full and (reported := self._timeouts()) is not None:
                        self._decide_stall(reported)
                    if self.rebalance_due is not None and not dead:
                        self.workload_override, self.rebalance_due = self.rebalance_due, None
                        on = f"workload {self.workload_override} (a worker is fail-slow)"
                        self.publish(self.members, on if self.workload_override else "workload back to the config's")
                    now = time.monotonic()
                    if joined:
                        self.joining_since = self.joining_since if self.joining else now
                        self.last_registration = now
                    self.joining |= set(joined)
                    ready = [w for w in self.layout.whole(self.joining) if w not in self.members]
                    last_call = now - self.last_registration >= JOIN_QUIET_S
                    if not (last_call or now - self.joining_since >= JOIN_WAIT_MAX_S):
                        ready = [w for w in ready if self._promoted_spare(w)]
                    elif ready:
                        self.joining_since = now  # the ranks of a replica still incomplete wait anew
                    if ready:
                        self.joining -= set(ready)
                        self.publish((*self.members, *ready), "joined: " + ", ".join(str(w) for w in ready))
                self._drain_metrics(metrics_seq)
                if self.state_store is not None:
                    if not self.state_store.is_leader():
                        log.error("this coordinator no longer leads (its lease expired); stepping down")
                        break
                    if self.committed_step != self.saved_step and self.epoch > 0 and self.members:
                        self.save_state(self.epoch, self.members, must=False)
                if full and self.store.check([keys.STOP]):
                    self.announce()  # a stop written by the launcher or a worker: tell everyone now
                    self.drain_until_members_quiet()
                    break
                if full and self.store.check([keys.DONE]):
                    self._drain_metrics(final=True)
                    break
                # Pending timeout reports are decided on the next full pass, at most a tick away.
                wait_s = self.tick_s
                rung = wait_key(self.store, keys.doorbell(keys.BELL, self.rung + 1), wait_s)
                if rung:
                    self.rung = get_int(self.store, keys.doorbell_seq(keys.BELL))
                elif self.first_timeout.get(self.epoch) is not None:
                    rung = True
                ticks += 1
        except Deposed:
            pass
        finally:
            if self.bug is not None:
                self.bug += "; " + self._await_saved()
                log.error("stopped: %s", self.bug)
            self._drain_metrics(final=True)
            if self.store.check([keys.STOP]) and not self.store.check([keys.DONE]):
                # A launcher that sees every worker gone may write its own reason over a stop for a bug.
                self.emit(RecordKind.STOPPED, reason=self.bug or self.store.get(keys.STOP).decode())
            gw = self.gateway
            self.emit(
                RecordKind.GATEWAY,
                admitted=gw.admitted,
                rejected=gw.rejected,
                timed_out=gw.timed_out,
                dropped=gw.dropped,
            )
            self.metrics.close()
            if self.status is not None:
                self.status.close()
        return 0 if self.store.check([keys.DONE]) else 1

    def _end_restore(self, joined: list[int]) -> None:
        """A restarted coordinator: publish the next epoch with the members that came back (and any joiner);
        those that did not are failures like any other."""
        back = self.layout.whole(w for w in self.restored if w in self.returned)  # whole replicas only
        gone = [w for w in self.restored if w not in back]
        self.restored = ()
        members = (*back, *joined)
        reason = "coordinator restarted: " + (", ".join(map(str, back)) or "nobody") + " came back"
        if gone:
            reason += "; " + ", ".join(map(str, gone)) + " did not"
        self.publish(members, reason)  # with nobody, an epoch of no members (as when every worker died)
        for wid in gone:
            self._failure_record(wid, "did not come back to the restarted coordinator")
        if not members:
            self.stop("no worker came back to the restarted coordinator")


START_TIMEOUT_S = 60.0


def spawn_coordinator(
    sock: socket.socket,
    run_dir: Path,
    workers: int,
    resume: bool,
    env: dict[str, str],
    restore: bool = False,
    zygote: Zygote | None = None,
) -> tuple[subprocess.Popen[bytes] | ForkedProcess, str]:
    """Start ``unbroken coordinator`` as a child process serving ``sock`` (a copy is handed over; the caller
    keeps its own, to start a successor at the same address, or closes it) for the run in ``run_dir`` (its
    config.toml written); returns the process and the job's address once it listens. Its log is
    ``run_dir/logs/coordinator.log``; it exits if this process dies. Forked by ``zygote`` if one is given (it
    has imported torch already: the caller must be the zygote's agent, a child subreaper); started cold if the
    zygote cannot."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    address_file = run_dir / "coordinator.json"
    fd = sock.fileno()
    cmd = [sys.executable, "-m", "unbroken", "coordinator", "--listen-fd", str(fd), "--run-dir", str(run_dir)]
    cmd += ["--workers", str(workers), "--parent-pid", str(os.getpid()), "--address-file", str(address_file)]
    if resume:
        cmd.append("--resume")
    if restore:
        cmd.append("--restore")
    address_file.unlink(missing_ok=True)  # a previous run's address
    env = {"TORCH_CPP_LOG_LEVEL": "ERROR", **env}  # c10d logs a stack trace for every bounded wait that ends
    proc = zygote.fork(cmd, env, logs / "coordinator.log", new_session=True, fds=(fd,)) if zygote else None
    if proc is None:
        with open(logs / "coordinator.log", "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, pass_fds=(fd,), start_new_session=True, env=env
            )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not address_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the coordinator did not start; see {logs / 'coordinator.log'}")
        time.sleep(0.005)
    return proc, json.loads(address_file.read_text())["address"]


def run_coordinator(coordinator: Coordinator, address_file: Path | None) -> int:
    """Run ``coordinator`` until the job ends; SIGTERM/SIGINT ask every worker to stop first."""

    def on_signal(signum: int, _frame: object) -> None:
        coordinator.stop(f"coordinator received signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if address_file is not None:
        tmp = address_file.with_suffix(".tmp")
        status = coordinator.status.address if coordinator.status is not None else ""
        tmp.write_text(json.dumps({"address": coordinator.address, "pid": os.getpid(), "status": status}))
        os.replace(tmp, address_file)
    code = coordinator.run()
    # Let workers read the final keys before the store goes away.
    time.sleep(0.5)
    coordinator.gateway.close()
    return code
