"""The coordinator (one small process per job, never a training worker): the membership loop, and the process
that runs it (``spawn_coordinator``, ``run_coordinator``).

Owns membership. The coordinator hosts the rendezvous store (torch.distributed's TCPStore), admits workers, watches
their heartbeats and the launcher's process-exit reports, and publishes a new membership epoch whenever a worker
dies or joins. The store itself listens on 127.0.0.1 on an internal port; the job's public address (127.0.0.1 unless
told otherwise) is served by ``store.gateway.Gateway``, which admits only clients that prove they hold the job's
token (``UNBROKEN_TOKEN``) and pipes them to the store. The store's keys, who writes and who reads each, are listed
in ``control.store.keys``.

``Coordinator.run`` is a loop of ticks; each is a short sequence of named calls over collaborators that each own one
concern and are tested alone:

- ``join.Admission``: registrations, refusals, the first epoch's members, the joiners' last call;
- ``errors.ErrorJudge``: the workers' exceptions, a bug (the job stops) or a failing host (a death);
- ``watch.Watch``: the heartbeats and the death and timeout reports, read in one round trip a tick;
- ``stall.StallJudge``: a collective that timed out while every heartbeat arrives (re-form, exclude, stop);
- ``slow.SlowRecorder`` and ``slow.FailSlowActions``: the fail-slow policy (``recovery.slow``);
- ``restore.Restore``: a restarted coordinator waiting for the members it left;
- ``epochs.Epochs``: the epochs published, the hard state saved ahead of each, the workers' doorbell;
- ``drain.MetricsDrain``: the workers' records into ``RUN_DIR/metrics.jsonl`` and the live sinks;
- ``stop.Stop``: the job's stop, the launcher's death, the end of the run.

With replicas of several ranks (``[parallel]``, ``core.layout``) membership is by whole replicas: the death,
silence or exclusion of any rank removes its replica's every rank in the same epoch, and a replica that restarts is
admitted only once all of its ranks have registered.

Nothing polls at a high rate (the coordinator and the launcher share the workers' cores, so every wake-up is taken
from training). The coordinator sleeps in a store wait on the next ``bell/<n>``; whoever writes something it must
act on rings it. Between rings it wakes every ``heartbeat_timeout_s / CHECKS_PER_TIMEOUT`` for a quiet tick, one
round trip that reads every heartbeat counter and the metrics sequence; the full pass over registrations, death
reports, stop and done runs when the bell rang, and at least once per heartbeat timeout regardless. Each worker
sends a heartbeat (one ``add``) every heartbeat interval on one connection, and a second thread sleeps in a store
wait on the next ``news/<n>`` on another, so a new epoch or a stop reaches every worker as soon as the store sees
it. A hang is declared after ``heartbeat_timeout_s`` of silence, seen at most one heartbeat interval and two ticks
later.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unbroken.control.coordinator.drain import MetricsDrain, open_sinks
from unbroken.control.coordinator.epochs import Deposed, Epochs, save_hard_state
from unbroken.control.coordinator.errors import ErrorJudge
from unbroken.control.coordinator.join import Admission
from unbroken.control.coordinator.restore import Restore
from unbroken.control.coordinator.slow import FailSlowActions
from unbroken.control.coordinator.stall import StallAction, StallJudge
from unbroken.control.coordinator.stop import STOP_DRAIN_S, Stop, drain_until_quiet
from unbroken.control.coordinator.watch import Watch
from unbroken.control.status.model import RunView
from unbroken.control.status.server import StatusServer
from unbroken.control.store import keys
from unbroken.control.store.connect import get_int, read_json, serve_store, wait_key
from unbroken.control.store.durable import State, StateStore, Worker
from unbroken.control.store.gateway import Gateway, require_token
from unbroken.core.config import Reduction, RunConfig, SlowPolicy, to_toml
from unbroken.core.layout import ReplicaLayout
from unbroken.core.records import RecordKind, make, read_records

if TYPE_CHECKING:
    from unbroken.control.host.zygote import ForkedProcess, Zygote
log = logging.getLogger(__name__)

CHECKS_PER_TIMEOUT = 10  # heartbeat checks (and metrics drains) per heartbeat timeout; events wake it at once
MAX_TICK_S = 0.25


class Coordinator:
    """Membership service for one job. ``run()`` loops until the job is done, stopped or abandoned.

    With a state store (``control.store.durable``) the hard state is saved before every epoch is published, and a
    coordinator that finds state there is a *restarted* one: it restores the epoch counter and the admitted
    workers, waits up to ``coordinator.rejoin_window_s`` for the last members to register again (they kept
    training meanwhile), and publishes the next epoch with those that came back (``restore.Restore``)."""

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
        host, self.port = sock.getsockname()[:2]
        self.address = f"{host}:{self.port}"
        self.store, internal_port = serve_store()
        self.token = token if token is not None else require_token()
        self.gateway = Gateway(sock, ("127.0.0.1", internal_port), self.token)
        self.cfg, self.run_dir, self.expected, self.state_store = cfg, run_dir, expected_workers, state
        self.layout = ReplicaLayout.of(cfg.parallel)
        self.heartbeat_timeout_s = cfg.comm.heartbeat_timeout_s
        self.tick_s = min(MAX_TICK_S, self.heartbeat_timeout_s / CHECKS_PER_TIMEOUT)
        self.incarnation = secrets.token_hex(8)
        prior = state.load() if state is not None else None
        self.restore = Restore.of(prior, restore, cfg.coordinator.rejoin_window_s)
        self.store.set(keys.CONFIG, to_toml(cfg))
        self.store.set(keys.RUN_DIR, str(run_dir))
        self.store.set(keys.EXPECTED, str(expected_workers))
        self.store.set(keys.INCARNATION, self.incarnation)
        self.watch = Watch(self.store, self.heartbeat_timeout_s)
        floor = prior.epoch if prior is not None else 0
        self.epochs = Epochs(self.store, self.save_state, self.emit, self.restore.epoch, floor)
        self.stops = Stop(self.store, self.epochs.announce, parent_pid)
        self.stopping = self.stops.stopping
        self.rung = 0  # the coordinator's doorbell, last answered
        self.view = RunView(cfg.train.steps, expected_workers, run_dir)
        records = read_records(run_dir)
        self.view.extend(records)  # a restarted coordinator's view starts where the run is
        self.metrics = open_sinks(cfg, run_dir, self.view, records)
        self.drain = MetricsDrain(self.store, self.metrics, run_dir, self.restore.committed_step)
        self.saved_step = self.restore.committed_step  # the committed step of the hard state last saved
        self.errors = ErrorJudge(self.store, self.metrics.write, self.stop, self.layout, run_dir, records)
        self.failslow = FailSlowActions(self.layout, cfg.recovery.slow_rejoin, lambda: self.members)
        if cfg.recovery.slow is not SlowPolicy.OFF:
            self.metrics.sinks.append(self.failslow.recorder(cfg, self.metrics, records))
        self.stalls = StallJudge(self.heartbeat_timeout_s, self.layout)
        exact = cfg.recovery.reduction is Reduction.EXACT
        self.admission = Admission(
            self.store, self.layout, exact, self.emit, self.epochs.announce, self.watch, self.restore,
            self.failslow.barred,
        )  # fmt: skip
        self._open(resume)

    def _open(self, resume: bool) -> None:
        """Publish where the run is (a restarted coordinator: the epoch it restored, the workers hold the state), start
        the status page, and record this coordinator."""
        restored = list(self.restore.restored)
        if self.restore.epoch > 0:  # it replaces a dead coordinator (of an epoch with no members, if all had died)
            record = {"epoch": self.epoch, "members": restored, "reason": "restored", "reform": False}
            self.store.set(keys.epoch(self.epoch), json.dumps(record))
            resume = False  # the workers hold the state; a joiner receives it from them
        self.store.set(keys.EPOCH, str(self.epoch))
        self.store.set(keys.RESUME, "1" if resume else "0")
        self.status: StatusServer | None = None
        if self.cfg.coordinator.status_port >= 0:
            c = self.cfg.coordinator
            self.status = StatusServer(self.view, host=c.status_host, port=c.status_port, token=self.token).start()
        self.emit(
            RecordKind.COORDINATOR,
            incarnation=self.incarnation,
            restored_epoch=self.epoch if restored else 0,
            address=self.address,
            status=self.status.url if self.status is not None else "",
        )
        if restored:
            log.warning("restarted: epoch %d, waiting for members %s to return", self.epoch, restored)

    # -- what the collaborators share -----------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.epochs.epoch

    @property
    def members(self) -> tuple[int, ...]:
        return self.epochs.members

    def emit(self, kind: RecordKind, **fields: Any) -> None:
        self.metrics.write(make(kind, time.time(), **fields))

    def publish(self, members: tuple[int, ...], reason: str, reform: bool = False) -> None:
        """Publish the next epoch of ``members`` (with the fail-slow policy's workload, when it switched it)."""
        self.epochs.publish(members, reason, reform, self.failslow.workload_override)

    def announce(self) -> None:
        """Ring the workers' doorbell (``Epochs.announce``)."""
        self.epochs.announce()

    def stop(self, reason: str) -> bool:
        """Stop the job for ``reason``; True if it is the reason kept (nobody stopped it for another before)."""
        return self.stops.request(reason)

    def save_state(self, epoch: int, members: tuple[int, ...], must: bool = True) -> None:
        """Write the hard state ahead of publishing ``epoch`` (``epochs.save_hard_state``)."""
        if self.state_store is None:
            self.saved_step = self.drain.committed_step
            return
        committed = self.drain.committed_step
        admitted = self.admission.admitted
        state = State(
            epoch=epoch,
            members=tuple(sorted(members)),
            committed_step=committed,
            data_cursor=committed + 1,
            admitted={w: Worker(str(r.get("host", "")), int(r.get("pid", 0))) for w, r in admitted.items()},
            next_worker_id=self.admission.next_id(),
        )
        if save_hard_state(self.state_store, state, must, self.stopping):
            self.saved_step = committed

    def drain_until_members_quiet(self, limit_s: float = STOP_DRAIN_S) -> None:
        """Take the members' records until their heartbeats end (``stop.drain_until_quiet``)."""
        interval_s = self.cfg.comm.heartbeat_interval_s
        drain_until_quiet(self.watch, lambda seq: self.drain.drain(seq), self.members, interval_s, limit_s)

    # -- the loop --------------------------------------------------------------------------------------
    def run(self) -> int:
        """Admit the expected workers, publish epochs, drain metrics; return 0 when the job is done."""
        try:
            self._loop()
        except Deposed:
            pass
        finally:
            self._close()
        return 0 if self.stops.done() else 1

    def _loop(self) -> None:
        start_deadline = time.monotonic() + self.cfg.comm.join_timeout_s
        rung, ticks = True, 0
        while not self.stopping.is_set():
            if not self.stops.launcher_alive():
                self.stop("the launcher died")
                self.drain_until_members_quiet()  # the members read the stop before the store goes away
                return
            # Everything but silence is announced by the bell; a full pass once per heartbeat timeout anyway, in
            # case a ringer died between writing its news and ringing.
            full = rung or ticks % CHECKS_PER_TIMEOUT == 0
            joined = self.admission.admit_new(self.epoch, self.members) if full else []
            if full and self.errors.judge(self.members):
                return
            counts, metrics_seq = self.watch.read(self.members)
            if not self._membership(full, counts, joined, start_deadline):
                return
            self.drain.drain(metrics_seq)
            if not self._keep_state() or (full and self._ended()):
                return
            rung = self._sleep()
            ticks += 1

    def _membership(self, full: bool, counts: list[int], joined: list[int], start_deadline: float) -> bool:
        """This tick's membership decision: the start, the end of a restarted coordinator's wait, or the members'
        deaths, stalls, workload switch and joins. False when the loop ends."""
        if self.epoch == 0:
            return self._start(start_deadline)
        if self.restore.waiting and not self.members:
            if self.restore.due(time.monotonic()):
                self._end_restore(joined)
            return True
        removed = {**self.errors.removals(self.members), **self.failslow.removals(self.members)}
        dead = self.watch.dead(self.epoch, self.members, counts, reported=full, removed=removed)
        if dead and not self._remove(dead):
            return False
        if not dead and full:
            self._judge_stall()
        if not dead and (switched := self.failslow.workload_due()) is not None:
            self.publish(self.members, switched)
        if ready := self.admission.ready(joined, self.members, time.monotonic()):
            self.publish((*self.members, *ready), "joined: " + ", ".join(str(w) for w in ready))
        return True

    def _start(self, deadline: float) -> bool:
        """Before the first epoch: publish it once every expected worker registered; stop at the join deadline."""
        admitted = len(self.admission.admitted)
        if admitted >= self.expected:
            self.publish(self.admission.start_members(), "start")
        elif time.monotonic() > deadline:
            self.stop(f"only {admitted} of {self.expected} workers joined within {self.cfg.comm.join_timeout_s:.0f} s")
            return False
        return True

    def _remove(self, dead: dict[int, str]) -> bool:
        """Publish the epoch without ``dead`` (and their replicas); False when nobody is left (the job stops)."""
        down = set(self.layout.with_replicas(dead))  # a rank's death takes its replica down
        survivors = tuple(w for w in self.members if w not in down)
        if not survivors:
            self.publish((), "every worker died")
            self.stop("every worker died")
            return False
        self.publish(survivors, "died: " + ", ".join(str(w) for w in sorted(dead)))
        for wid, why in dead.items():
            self._failure_record(wid, why)
        return True

    def _judge_stall(self) -> None:
        """Timeout reports of the current epoch, once due: re-form, exclude or stop (``stall.StallJudge``)."""
        reports = self.watch.timeouts(self.epoch, self.members)
        reported = self.stalls.due(self.epoch, self.members, reports, time.monotonic())
        if reported is None:
            return
        decision = self.stalls.decide(self.epoch, self.members, reported)
        self.emit(RecordKind.STALL, **decision.fields())
        if decision.action is StallAction.STOP:
            self.stop(decision.line)
            return
        self.publish(decision.members, decision.line, reform=decision.action is StallAction.REFORM)
        for wid in decision.excluded:
            self._failure_record(wid, decision.failure_why())

    def _end_restore(self, joined: list[int]) -> None:
        """A restarted coordinator: publish the next epoch with the members that came back (and any joiner); those
        that did not are failures like any other."""
        end = self.restore.end(self.layout, joined)
        self.publish(end.members, end.reason)  # with nobody, an epoch of no members (as when every worker died)
        for wid in end.gone:
            self._failure_record(wid, "did not come back to the restarted coordinator")
        if not end.members:
            self.stop("no worker came back to the restarted coordinator")

    def _failure_record(self, wid: int, why: str) -> None:
        """A failure, with its detection latency when the launcher recorded when it delivered the fault."""
        extra: dict[str, Any] = {}
        now = time.time()
        if self.store.check([keys.injected(wid)]):
            injected = read_json(self.store, keys.injected(wid))
            extra = {"event": injected["event"], "detection_s": now - injected["time"]}
            self.store.delete_key(keys.injected(wid))
        self.metrics.write(make(RecordKind.FAILURE, now, worker=wid, why=why, epoch=self.epoch, **extra))

    def _keep_state(self) -> bool:
        """With a state store: the newest committed step saved; False when this coordinator no longer leads."""
        if self.state_store is None:
            return True
        if not self.state_store.is_leader():
            log.error("this coordinator no longer leads (its lease expired); stepping down")
            return False
        if self.drain.committed_step != self.saved_step and self.epoch > 0 and self.members:
            self.save_state(self.epoch, self.members, must=False)
        return True

    def _ended(self) -> bool:
        """A stop written by anyone (the members are told now, and their last records taken), or the run done."""
        if self.stops.requested():
            self.announce()  # a stop written by the launcher or a worker: tell everyone now
            self.drain_until_members_quiet()
            return True
        if self.stops.done():
            self.drain.drain(final=True)
            return True
        return False

    def _sleep(self) -> bool:
        """Sleep until the doorbell rings or a tick passes; whether the next pass is a full one (it rang, or a
        timeout report waits for its decision, at most a tick away)."""
        rung = wait_key(self.store, keys.doorbell(keys.BELL, self.rung + 1), self.tick_s)
        if rung:
            self.rung = get_int(self.store, keys.doorbell_seq(keys.BELL))
        return rung or self.stalls.pending(self.epoch)

    def _close(self) -> None:
        """The end of the loop, however it ended: the words of a stop for a bug, the last records, the stop and
        gateway records; the metrics file and the status page closed."""
        errors = self.errors
        if errors.bug is not None:
            words = errors.saved_words(
                self.heartbeat_timeout_s, self.tick_s, self.drain.drain, self.stops.launcher_alive
            )
            errors.bug += "; " + words
            log.error("stopped: %s", errors.bug)
        self.drain.drain(final=True)
        if self.stops.requested() and not self.stops.done():
            # A launcher that sees every worker gone may write its own reason over a stop for a bug.
            self.emit(RecordKind.STOPPED, reason=errors.bug or self.stops.reason())
        gw = self.gateway
        self.emit(RecordKind.GATEWAY, admitted=gw.admitted, rejected=gw.rejected, timed_out=gw.timed_out,
                  dropped=gw.dropped)  # fmt: skip
        self.metrics.close()
        if self.status is not None:
            self.status.close()


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
