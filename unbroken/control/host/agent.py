"""The per-host agent: the workers of one host, started, watched and replaced.

Owns the worker processes of a host: it starts them (``UNBROKEN_COORDINATOR``, ``UNBROKEN_WORKER_ID``,
``UNBROKEN_LOCAL_WORKERS`` in their environment), sleeps on their pidfds (no polling loop burning a core) and
tells the coordinator the moment one exits (``dead/<id>``: the fastest failure detector there is), delivers the
failure schedule's signals to them when they reach a scheduled point, continues paused ones, kills a hung
one once the coordinator has excluded it, and restarts a replaced worker after its delay (it then rejoins
with live state transfer). ``unbroken train`` runs one agent in the launcher's process; on a cluster,
``unbroken agent`` runs one per host (under ``srun``, a Kubernetes pod, or by hand): docs/control.md.

With replicas of several ranks (``[parallel]``), a replica's ranks are on one host and are started, and
restarted, together: each start of a replica gets a new incarnation (``UNBROKEN_REPLICA_INCARNATION``, the
name of its own process group's rendezvous), and a replica whose rank died is started again only once every
one of its ranks has ended (the others leave by themselves when the membership removes the replica).

The agent knows the coordinator only through the store (``control.keys``); when the coordinator restarts,
``connect`` points it at the new one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.control.console import CONSOLE_ENV, ConsoleRelay
from unbroken.control.host import zygote
from unbroken.control.member.client import (
    COORDINATOR_ENV,
    DEVICE_INDEX_ENV,
    INJECT_FD_ENV,
    LOCAL_WORKERS_ENV,
    SPARE_ENV,
    STARTED_AT_ENV,
    WORKER_ID_ENV,
)
from unbroken.control.member.hostbeat import HOST_BEAT_ENV, HostBeats
from unbroken.control.member.news import RELAY_ENV, NewsRelay
from unbroken.control.store import keys
from unbroken.control.store.connect import (
    CallGuard,
    exit_reason,
    open_store,
    publish_record,
    report_death,
    request_stop,
    ring,
)
from unbroken.control.store.gateway import TOKEN_ENV, Tunnel, TunnelError, require_token
from unbroken.core.config import (
    HeartbeatMode,
    Reduction,
    RunConfig,
    config_from_toml_text,
    deterministic_kernels,
)
from unbroken.core.failures import FATAL_KINDS, FailureKind, parse_event
from unbroken.core.layout import INCARNATION_ENV, ReplicaLayout
from unbroken.core.logs import init_logger
from unbroken.core.numerics import DETERMINISTIC_ENV
from unbroken.core.records import RecordKind, SpareState, make, read_records
from unbroken.ft.stops import EXIT_STOPPED
from unbroken.train.hf import worker_imports

log = logging.getLogger(__name__)

POLL_S = 0.005  # the shortest wait: a restart or the end of a pause due sooner is waited for this long
IDLE_WAIT_S = 0.25  # the longest; a process exit, or a worker at an injection point (INJECT_FD_ENV), wakes it at once
FULL_LOOK_EVERY = 8  # looks (at most IDLE_WAIT_S apart) between reads of every worker's injection key, rung or not
# A store call of the agent's that takes longer than this is cut (the coordinator's host unreachable): the agent
# then looks for a coordinator again, the same one or an etcd standby.
CALL_LIMIT_S = 10.0
STOP_GRACE_S = 10.0
MAX_SPARE_DEATHS = 3  # per spare: a host whose spares keep dying while they wait stops starting them

WorkerProcess = subprocess.Popen[bytes] | zygote.ForkedProcess


class Agent:
    """The workers ``worker_ids`` of this host, each running ``command``."""

    def __init__(
        self,
        worker_ids: list[int],
        command: tuple[str, ...],
        env: dict[str, str],
        log_dir: Path,
        restart_after_s: float = 0.0,
        injections: bool = False,
        own_sessions: bool = True,
        layout: ReplicaLayout | None = None,
        spares: int = 0,
        fold_kernels: bool = False,
        preload: tuple[str, ...] = (),
        heartbeat_timeout_s: float = 2.0,
        news_relay: bool = False,
        heartbeats: HeartbeatMode = HeartbeatMode.WORKER,
        heartbeat_interval_s: float = 0.25,
    ) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # Under ``comm.heartbeats = "host"``: this host's beat board and the thread that passes its workers' beats
        # on to the coordinator (``control.hostbeat``).
        self.beats = (
            HostBeats(heartbeat_interval_s, max(1.0, heartbeat_timeout_s)) if heartbeats is HeartbeatMode.HOST else None
        )
        self.news_relay = news_relay  # run this host's relay of the coordinator's news (``control.newsrelay``)
        self.fold_kernels = fold_kernels  # the zygote loads the exact fold's kernels (exact mode)
        self.preload = preload  # and imports these modules, which the workers import beyond the trainer's own
        self.layout = layout or ReplicaLayout()
        check_spares(spares, self.layout)
        self.num_spares = spares
        # Warm spares by index, not yet promoted. With replicas of several ranks they come as whole replicas: the
        # spares k0 .. k0 + size - 1 (k0 a multiple of the replica's size) form one, of incarnation
        # ``spare_incarnations[k0 // size]``, rank k - k0 each.
        self.spares: dict[int, WorkerProcess] = {}
        self.spare_incarnations: dict[int, str] = {}
        self.next_spare = 0
        self.spare_deaths = 0  # spares that died while they waited
        # The host's device index of each spare (the workers' come from their ids): the first spares take the
        # ones after the workers'; a spare started to replace a promoted one takes the dead worker's.
        self.spare_devices: dict[int, int] = {}
        self.free_devices = list(range(len(worker_ids), len(worker_ids) + spares))
        self.worker_devices = {wid: i for i, wid in enumerate(worker_ids)}  # a promoted spare keeps its own
        self.incarnations: dict[int, str] = {}  # replica -> the incarnation its running ranks were started with
        self.ids = list(worker_ids)
        self.command = command
        self.env = env
        self.log_dir = log_dir
        self.restart_after_s = restart_after_s
        self.injections = injections
        # A worker that reached an injection point writes to this pipe (INJECT_FD_ENV): the agent's wait ends then.
        self.injected = WakePipe() if injections else None
        # True: each worker in a session of its own (a terminal's Ctrl-C reaches only the launcher, which stops
        # them in order); False: the workers share the agent's process group, so the host's loss (``kill -9``
        # of the group) takes them all, as a machine that dies would.
        self.own_sessions = own_sessions
        self.address = ""
        self.store: Any = None
        self.tunnel: Tunnel | None = None
        self.guard = CallGuard(CALL_LIMIT_S)
        self.finished = False  # the run is over: exits are not failures, nobody is restarted
        self.workers: dict[int, WorkerProcess] = {}
        self.reported: set[int] = set()
        self.down: dict[int, dict[str, Any]] = {}  # workers killed or stopped, and when they come back
        self.pauses: dict[int, float] = {}  # paused workers and when to SIGCONT them
        self.last_event: dict[int, Any] = {}  # the latest event injected into each worker
        self.completed = False  # the run finished (not stopped): its last members are known
        self.late: set[int] = set()  # workers stopped because the run finished without them
        self.refused: set[int] = set()  # ids the coordinator refused: not restarted
        self.fired: set[str] = set()  # injected events (each fires once, across coordinator restarts too)
        self._rung: int | None = None  # the injection bell's count at the last look at the workers' keys
        self._looks = 0
        # What the group's leader prints, for this process's console (``control.console``); None: logs only.
        self.console: ConsoleRelay | None = None
        self.zygote: zygote.Zygote | None = None
        self._zygote_tried = False
        self.relay: NewsRelay | None = None  # this host's relay of the coordinator's news, from the first connect

    # -- the coordinator ---------------------------------------------------------------------------
    def connect(self, address: str, token: str, reached: tuple[Any, Tunnel] | None = None) -> None:
        """Talk to the coordinator at ``address`` (again, after it restarted), over ``reached`` (a store
        connection and its tunnel) if given."""
        self.address = address
        self.store, self.tunnel = reached if reached is not None else open_store(address, token=token)
        self._rung = None  # a new coordinator's store counts from 0
        if self.relay is None and self.news_relay:
            try:
                self.relay = NewsRelay(max(1.0, self.heartbeat_timeout_s))
            except OSError as e:  # no Unix socket here: each worker watches the coordinator itself
                log.warning("no news relay on this host (%s); each worker watches the coordinator", e)
        if self.relay is not None:
            self.env[RELAY_ENV] = self.relay.path
            self.relay.follow(address, token)
        if self.beats is not None:
            self.beats.follow(address, token)
        for event in self.fired:
            self._call(lambda s, e=event: s.set(keys.fired(e), "1"))

    def _call(self, fn: Any, *args: Any) -> Any:
        """A store call; None (and no more calls until ``connect``) if the coordinator is gone."""
        if self.store is None:
            return None
        store = self.store
        try:
            return self.guard.call(self.tunnel, lambda: fn(store, *args))
        except RuntimeError:
            self.store = None  # the coordinator is gone or restarting; the owner reconnects
            return None

    def _tell(self, key: str, value: str) -> None:
        self._call(lambda s: (s.set(key, value), ring(s)))

    def stop_job(self, reason: str) -> None:
        """Ask every process of the job to stop, unless someone already did: the first reason is the one the
        coordinator records (a worker's own line, not "every worker exited" that follows from it)."""
        self._call(request_stop, reason)

    def newest_members(self) -> list[int] | None:
        def read(s: Any) -> list[int]:
            return json.loads(s.get(keys.epoch(int(s.get(keys.EPOCH)))))["members"]

        return self._call(read)

    # -- processes ----------------------------------------------------------------------------------
    def start_worker(self, worker_id: int) -> None:
        env = {
            **self.env,
            COORDINATOR_ENV: self.address,
            WORKER_ID_ENV: str(worker_id),
            LOCAL_WORKERS_ENV: str(len(self.ids)),
            STARTED_AT_ENV: repr(time.time()),
        }
        if self.layout.size > 1:
            env[INCARNATION_ENV] = self.incarnations[self.layout.replica_of(worker_id)]
        fds: tuple[int, ...] = ()
        if self.console is not None:  # worker 0 speaks for the job until the group forms, on its first start only
            env[CONSOLE_ENV] = self.console.env(worker_id == 0 and worker_id not in self.workers)
            fds = (self.console.write_fd,)
        self.workers[worker_id] = self._start(env, f"worker-{worker_id}.log", fds)
        self.reported.discard(worker_id)

    def _start(self, env: dict[str, str], log_name: str, fds: tuple[int, ...] = ()) -> WorkerProcess:
        """A process running the workers' command: forked by the zygote when it can, else started cold."""
        log_path = self.log_dir / log_name
        if self.injected is not None:
            env = {**env, INJECT_FD_ENV: str(self.injected.write_fd)}
            fds = (*fds, self.injected.write_fd)
        if self.beats is not None:
            env = {**env, HOST_BEAT_ENV: self.beats.env_for_new_process()}
        self.warm()
        process = self.zygote.fork(list(self.command), env, log_path, self.own_sessions, fds) if self.zygote else None
        if process is None:
            with open(log_path, "ab") as out:
                process = subprocess.Popen(
                    list(self.command),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=self.own_sessions,
                    env=env,
                    pass_fds=fds,
                )
        if self.beats is not None:
            self.beats.bind(env[HOST_BEAT_ENV], process)
        return process

    def start_spare(self) -> None:
        """Start warm spare ``next_spare``: a worker process without an id, which builds everything a worker
        builds and then waits outside the group for the id of a dead worker (``promote``). With replicas of
        several ranks, a whole spare replica: ``layout.size`` spares that form their replica's process group and
        build their parts of the model together."""
        size = self.layout.size
        first = self.next_spare
        self.next_spare += size
        if size > 1:
            self.spare_incarnations[first // size] = secrets.token_hex(4)
        for k in range(first, first + size):
            self.spare_devices[k] = device = self.free_devices.pop(0)
            env = {**self.env, COORDINATOR_ENV: self.address, SPARE_ENV: str(k)}
            env |= {LOCAL_WORKERS_ENV: str(len(self.ids)), DEVICE_INDEX_ENV: str(device)}
            if size > 1:
                env[INCARNATION_ENV] = self.spare_incarnations[first // size]
            env.pop(WORKER_ID_ENV, None)
            self.spares[k] = proc = self._start(env, f"spare-{k}.log")
            record = make(RecordKind.SPARE, time.time(), spare=k, state=SpareState.STARTED, worker=-1, pid=proc.pid)
            self._record(record)

    def warm(self) -> None:
        """Start the zygote that forks this host's workers (``control.zygote``), once, if they can be forked: its
        imports run while the caller goes on (start it before anything slow, e.g. the coordinator)."""
        if self._zygote_tried:
            return
        self._zygote_tried = True
        if zygote.forkable(self.command, self.env) and zygote.enabled(self.env):
            try:
                self.zygote = zygote.Zygote(self.env, self.log_dir / "zygote.log", self.fold_kernels, self.preload)
            except OSError as e:
                log.warning("workers start cold: %s", e)

    def close(self) -> None:
        """End the zygote, the news relay and the host's heartbeats (the workers are this process's children and
        stay so; any still running watch the coordinator themselves, and their beats are no longer passed on)."""
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        if self.beats is not None:
            self.beats.close()
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None
        if self.injected is not None:
            self.injected.close()  # a worker still running gets EPIPE on a wake: it ignores it

    def wake_fds(self) -> tuple[int, ...]:
        """Descriptors that end the wait for an exit (``wait_for_exit``) when readable: a worker at an injection
        point."""
        return self.injected.fds() if self.injected is not None else ()

    def start_all(self) -> None:
        for replica in self.layout.replicas(self.alive_ids()):
            self.incarnations[replica] = secrets.token_hex(4)
        for wid in self.alive_ids():
            self.start_worker(wid)
        for _ in range(self.num_spares // self.layout.size):
            self.start_spare()

    def _record(self, record: dict[str, Any]) -> None:
        self._call(lambda s: publish_record(s, record))

    def replace_dead_spares(self) -> None:
        """A spare that died while it waited (not one that left because the run is over) is started again, on
        its device (a spare replica whole: its other ranks are ended first, their group has lost a rank); after
        ``MAX_SPARE_DEATHS`` x the spares' count of such deaths (a host that cannot start one) no more are
        started."""
        size = self.layout.size
        for first in sorted({k - k % size for k in self.spares}):
            ranks = [k for k in range(first, first + size) if k in self.spares]
            died = {k: code for k in ranks if (code := self.spares[k].poll()) not in (None, 0)}
            if not died:
                continue
            for k, code in died.items():
                pid, why = self.spares[k].pid, exit_reason(code)
                self._record(
                    make(RecordKind.SPARE, time.time(), spare=k, state=SpareState.EXITED, worker=-1, pid=pid, why=why)
                )
            for k in ranks:
                proc = self.spares.pop(k)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                self.free_devices.append(self.spare_devices.pop(k))
            self.spare_incarnations.pop(first // size, None)
            self.spare_deaths += len(died)
            k, code = next(iter(died.items()))
            if self.spare_deaths > MAX_SPARE_DEATHS * self.num_spares:
                log.warning("spare %d exited with status %s; too many spares died: starting no more", k, code)
                continue
            log.warning("spare %d exited with status %s while it waited: starting another", k, code)
            self.start_spare()

    def promote(self, wid: int) -> bool:
        """Dead worker ``wid`` (no longer a member) is replaced by the oldest live spare, which joins under its id
        in the next epoch and receives the state; a new spare is started in its stead. With replicas of several
        ranks, once every rank of ``wid``'s replica has ended, the oldest whole spare replica takes the replica's
        place, each spare the worker of its rank. False: no spare to take it (yet)."""
        self.replace_dead_spares()
        if not self.spares or self.store is None:
            return False
        size = self.layout.size
        first = min(self.spares)
        if size > 1:
            if not self._replica_ended(wid):
                return False  # a rank of the replica still runs: it leaves (or is ended) first
            replica = self.layout.replica_of(wid)
            self.incarnations[replica] = self.spare_incarnations.pop(first // size)
        places = {first + self.layout.rank_of(w): w for w in self.layout.workers_of(self.layout.replica_of(wid))}
        for k, worker in places.items():
            proc = self.spares.pop(k)
            self.free_devices.append(self.worker_devices[worker])
            self.worker_devices[worker] = self.spare_devices.pop(k)
            self._tell(keys.spare(k), str(worker))
            self.workers[worker] = proc
            self.reported.discard(worker)
            self.down.pop(worker, None)
            self.last_event.pop(worker, None)
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            note = f"[agent] {stamp} worker {worker} continues as spare {k} (logs/spare-{k}.log)"
            with open(self.log_dir / f"worker-{worker}.log", "a") as log_file:
                log_file.write(note + "\n")
            promoted = make(
                RecordKind.SPARE, time.time(), spare=k, state=SpareState.PROMOTED, worker=worker, pid=proc.pid
            )
            self._record(promoted)
            log.info("spare %d takes the place of worker %d", k, worker)
        self.start_spare()
        return True

    def _restart(self, wid: int) -> None:
        """Start ``wid`` again (a replica of several ranks: all of its ranks, under a new incarnation)."""
        log.info("restarting worker %d (it ended with status %s)", wid, self.workers[wid].returncode)
        if self.layout.size == 1:
            self.start_worker(wid)
            return
        replica = self.layout.replica_of(wid)
        self.incarnations[replica] = secrets.token_hex(4)
        for mate in self.layout.workers_of(replica):
            self.down.pop(mate, None)
            self.last_event.pop(mate, None)
            self.start_worker(mate)

    def _replica_ended(self, wid: int) -> bool:
        """Every rank of ``wid``'s replica has ended (a replica restarts only whole); a rank still running once
        the membership excludes it (it hangs) is killed."""
        running = [m for m in self.layout.workers_of(self.layout.replica_of(wid)) if self.workers[m].poll() is None]
        if not running:
            return True
        members = self.newest_members()
        for mate in running:
            if members is not None and mate not in members and mate not in self.pauses:
                self.workers[mate].kill()
                self.workers[mate].wait()
                self.reported.add(mate)  # already excluded; its exit is not news
        return all(self.workers[m].poll() is not None for m in running)

    def alive_ids(self) -> list[int]:
        return [w for w in self.ids if w not in self.down]

    def processes(self) -> list[WorkerProcess]:
        """The workers' processes, then the waiting spares'."""
        return [*self.workers.values(), *self.spares.values()]

    def tick(self) -> None:
        """One look: scheduled faults to deliver, exits to report, paused or replaced workers to see to."""
        self.deliver_injections()
        self.report_exits()
        self.manage_down()

    def wait_s(self) -> float:
        """How long the next wait for an exit may last: ``IDLE_WAIT_S`` (an exit or a worker at an injection point
        ends it sooner), and no longer than until the next restart or the end of a pause falls due."""
        wait = IDLE_WAIT_S
        dues = [info["at"] + info["rejoin"] for info in self.down.values() if info["rejoin"] is not None]
        dues += self.pauses.values()
        if dues:
            wait = min(wait, max(POLL_S, min(dues) - time.monotonic()))
        return wait

    def _drain_wakes(self) -> bool:
        """Whether a worker reached an injection point since the last look (the pipe emptied)."""
        return self.injected is not None and self.injected.drain()

    def deliver_injections(self) -> None:
        """A worker that reached a scheduled failure point waits there; deliver the real signal now."""
        if not self.injections or self.store is None or self.finished:
            return
        woken = self._drain_wakes()
        # One store call a look: the workers' keys are read when the bell rang since the last look, when a worker
        # woke the agent, and every FULL_LOOK_EVERY looks anyway (a ring lost with a coordinator that died between
        # a key and its ring).
        rung = self._call(lambda s: s.add(keys.INJECT_BELL, 0))
        self._looks += 1
        if rung is None or (rung == self._rung and not woken and self._looks % FULL_LOOK_EVERY):
            return
        self._rung = rung
        for wid, proc in self.workers.items():
            if proc.poll() is not None or wid in self.down or wid in self.pauses:
                continue
            key = keys.inject(wid)
            info = self._call(lambda s, k=key: json.loads(s.get(k)) if s.check([k]) else None)
            if info is None:
                continue
            event = parse_event(info["event"])
            now = time.time()
            if event.kind in FATAL_KINDS and not self._other_members_alive(wid):
                # A cluster never loses its last copy of the state to a scheduled failure (the paper's 32 ranks
                # never all fail); random schedules plan in expected time and can overlap.
                why = "no other member of the group is alive: it would lose the training state"
                record = make(RecordKind.INJECTION_SKIPPED, now, worker=wid, event=info["event"], why=why)

                def skip(s: Any, e: str = info["event"], w: int = wid, k: str = key, r: Any = record) -> None:
                    s.set(keys.fired(e), "1")
                    s.set(keys.skip(w), "1")
                    s.delete_key(k)
                    publish_record(s, r)

                self._call(skip)
                continue
            record = make(RecordKind.INJECTED, now, worker=wid, event=info["event"], kind=str(event.kind))

            def take(s: Any, e: str = info["event"], w: int = wid, k: str = key, r: Any = record) -> bool:
                s.delete_key(k)
                s.set(keys.injected(w), json.dumps({"event": e, "time": r["time"]}))
                s.set(keys.fired(e), "1")
                publish_record(s, r)
                return True

            if not self._call(take):
                return
            self.fired.add(info["event"])
            self.last_event[wid] = event
            if event.kind is FailureKind.CUT:
                continue  # the worker cuts its own connections; its exit is handled like any other
            os.kill(proc.pid, signal.SIGKILL if event.kind is FailureKind.KILL else signal.SIGSTOP)
            if event.kind is FailureKind.PAUSE:
                self.pauses[wid] = time.monotonic() + event.seconds
                continue
            self.down[wid] = {
                "rejoin": event.rejoin_after_s,
                "at": time.monotonic(),
                "hung": event.kind is FailureKind.HANG,
            }

    def _other_members_alive(self, wid: int) -> bool:
        """Whether a member of the newest epoch other than ``wid`` is alive (not killed, paused or exited
        here; a member on another host counts as alive until the coordinator removes it)."""
        members = self.newest_members() or []
        replica = self.layout.replica_of(wid)
        return any(
            self.layout.replica_of(w) != replica
            and (
                w not in self.workers
                or (w not in self.down and w not in self.pauses and self.workers[w].poll() is None)
            )
            for w in members
        )

    def manage_down(self) -> None:
        """Continue paused workers; kill hung workers once the coordinator excluded them; restart downed
        workers after their delay (a worker that left after a pause, a cut or a stall is down from its exit
        on, and so is one that died without a scheduled event, e.g. killed from outside, when
        ``restart_after_s`` is set)."""
        now = time.monotonic()
        for wid, until in list(self.pauses.items()):
            if now >= until:
                del self.pauses[wid]
                if self.workers[wid].poll() is None:
                    os.kill(self.workers[wid].pid, signal.SIGCONT)
        for wid, event in list(self.last_event.items()):
            proc = self.workers[wid]
            if wid not in self.down and wid not in self.pauses and proc.poll() not in (None, 0):
                del self.last_event[wid]
                if event.rejoin_after_s is not None and event.kind in (
                    FailureKind.PAUSE,
                    FailureKind.CUT,
                    FailureKind.STALL,
                ):
                    self.down[wid] = {"rejoin": event.rejoin_after_s, "at": now, "hung": False}
        if self.spares and not self.finished and self.store is not None:
            self.replace_dead_spares()
            dead = [w for w, p in self.workers.items() if p.poll() not in (None, 0) and w not in self.pauses]
            # Once the job has an epoch. Each death is reported (report_exits): its spare registers once the
            # coordinator has removed it (ft.process waits for that epoch; a member's id would get another id).
            for wid in dead if dead and self.newest_members() is not None else []:
                if self.workers[wid].poll() is None:
                    continue  # a rank of a replica a spare replica has just taken the place of
                if not self.promote(wid):
                    break
        if self.restart_after_s > 0 and not self.finished:
            for wid, proc in self.workers.items():
                if wid not in self.down and wid not in self.pauses and proc.poll() not in (None, 0):
                    # Died without a scheduled event (killed from outside, excluded after a stop): a cluster's
                    # scheduler would replace it; not one the coordinator refused (it would be refused again).
                    self.last_event.pop(wid, None)
                    if wid in self.refused or self._refused(wid):
                        self.refused.add(wid)
                        continue
                    self.down[wid] = {"rejoin": self.restart_after_s, "at": now, "hung": False}
        for wid, info in list(self.down.items()):
            proc = self.workers[wid]
            if info["hung"] and proc.poll() is None:
                members = self.newest_members()
                if members is not None and wid not in members:
                    proc.kill()
                    proc.wait()
                    self.reported.add(wid)  # already excluded; its exit is not news
                continue
            rejoin = info["rejoin"]
            due = rejoin is not None and now >= info["at"] + rejoin
            if due and proc.poll() is not None and self.store is not None and not self.finished:
                if self.layout.size > 1 and not self._replica_ended(wid):
                    continue
                del self.down[wid]
                self._restart(wid)

    def _refused(self, wid: int) -> bool:
        """The coordinator refused ``wid`` (``keys.refused``: another fingerprint, or barred as fail-slow)."""
        try:
            return self.store is not None and self.store.check([keys.refused(wid)])
        except RuntimeError:
            return False  # the coordinator is gone: restart as usual

    def report_exits(self) -> None:
        if self.store is None or self.finished:
            return  # nobody to tell (yet), or the workers are leaving because the run is over
        for wid, proc in self.workers.items():
            code = proc.poll()
            if code is not None and code != 0 and wid not in self.reported:  # 0: finished the run
                self.reported.add(wid)
                self._call(report_death, wid, exit_reason(code))

    def nobody_left(self) -> bool:
        """No worker process runs and none is due to restart (e.g. every one failed before joining)."""
        restarts = any(info["rejoin"] is not None for info in self.down.values())
        # A worker that failed since the last look (while this agent waited for its coordinator, say) is restarted
        # at the next one, unless the coordinator refused it.
        unseen = self.restart_after_s > 0 and any(
            p.poll() not in (None, 0) and w not in self.down and w not in self.refused for w, p in self.workers.items()
        )
        return not restarts and not unseen and all(p.poll() is not None for p in self.workers.values())

    def stop_latecomers(self, members: list[int]) -> list[int]:
        """The run finished: stop at once the workers still running that are not among its last ``members``
        (restarted too late to rejoin), rather than wait for them to find the coordinator gone; each one's log
        says so in one line. Returns their ids."""
        self.completed = True
        late = [w for w, p in self.workers.items() if p.poll() is None and w not in members]
        # One that already left on its own for the same reason (restarted while its host was cut off, it could not
        # join: EXIT_STOPPED) was not in the run's end either.
        self.late.update(w for w, p in self.workers.items() if p.poll() == EXIT_STOPPED and w not in members)
        self.late.update(late)
        for wid in late:
            self.workers[wid].kill()
            self.workers[wid].wait()
            self.reported.add(wid)
            note = logging.LogRecord(__name__, logging.INFO, __file__, 0, "%s", None, None)
            note.msg = f"the run finished before worker {wid} rejoined (it was restarted too late): stopped it"
            line = logging.Formatter("[agent] %(asctime)s %(levelname)s %(name)s: %(message)s").format(note)
            with open(self.log_dir / f"worker-{wid}.log", "a") as log_file:
                log_file.write(line + "\n")
        return late

    def stop_workers(self, grace_s: float = STOP_GRACE_S, others: list[WorkerProcess] | None = None) -> None:
        """Wait ``grace_s`` for the workers (and ``others``) to end, then kill what is left."""
        for info in self.down.values():
            info["hung"] = False
        for spare in self.spares.values():  # holds no state: no grace (it may still be importing torch)
            if spare.poll() is None:
                spare.kill()
        procs = [*self.processes(), *(others or [])]
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(POLL_S)
        if self.completed:
            # The run finished without them (one cut off from the coordinator as it ended cannot learn so): like
            # a latecomer, stopping it is no failure.
            stragglers = [w for w, p in self.workers.items() if p.poll() is None]
            if stragglers:
                log.info("the run finished; workers %s had not ended %.0f s later: stopped them", stragglers, grace_s)
            self.late.update(stragglers)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def check_spares(spares: int, layout: ReplicaLayout) -> None:
    """ValueError (one line) unless ``spares`` warm spares can serve workers of ``layout`` (whole replicas)."""
    if spares < 0:
        raise ValueError(f"--spares = {spares} must be >= 0")
    if spares % layout.size:
        raise ValueError(
            f"--spares = {spares} with replicas of {layout.size} ranks (parallel.shard = {layout.shard} x "
            f"parallel.pipeline = {layout.pipeline} x parallel.tensor = {layout.tensor}): spares come as whole "
            f"replicas, use a multiple of {layout.size}"
        )


def worker_defaults(cfg: RunConfig) -> dict[str, str]:
    """The environment a worker starts with unless the user's environment says otherwise: c10d's errors only
    (it logs a C++ stack trace for every bounded store wait that times out), and under deterministic kernels
    (``train.deterministic``) what cuBLAS must read before it starts (``core.numerics``)."""
    env = {"TORCH_CPP_LOG_LEVEL": "ERROR"}
    if deterministic_kernels(cfg):
        env.update(DETERMINISTIC_ENV)
    return env


class WakePipe:
    """A pipe that ends a ``wait_for_exit`` early: another thread, a signal handler or a child process (given
    ``write_fd``) writes to it; the waiter empties it. Both ends are non-blocking: a full pipe already wakes it."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)

    def fds(self) -> tuple[int, ...]:
        """The descriptor to wait on (none once closed)."""
        return (self.read_fd,) if self.read_fd >= 0 else ()

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake is pending anyway) or closed (the waiter is gone)
            os.write(self.write_fd, b"!")

    def drain(self) -> bool:
        """Empty it; whether anything was written since the last drain."""
        woken = False
        while self.read_fd >= 0:
            try:
                if not os.read(self.read_fd, 4096):
                    break
            except BlockingIOError:
                break
            woken = True
        return woken

    def close(self) -> None:
        if self.read_fd >= 0:
            os.close(self.read_fd)
            os.close(self.write_fd)
            self.read_fd = self.write_fd = -1


def wait_for_exit(procs: list[WorkerProcess], timeout_s: float, readable: tuple[int, ...] = ()) -> None:
    """Sleep up to ``timeout_s``, waking as soon as one of ``procs`` exits (Linux pidfds; elsewhere a plain
    sleep) or one of the ``readable`` descriptors has data. The workers share the host's cores: a busy agent
    would slow them down. A process that exited is reaped here (``poll``, which sets its ``returncode``): the
    pidfd of an unreaped one stays readable and would end every later wait at once."""
    running = [p for p in procs if p.returncode is None]
    if any(p.poll() is not None for p in running):
        return  # one exited since the caller last looked
    fds: list[int] = []
    try:
        for p in running:
            fds.append(os.pidfd_open(p.pid))
        select.select([*fds, *readable], [], [], timeout_s)
    except (AttributeError, OSError):
        time.sleep(timeout_s)
    finally:
        for fd in fds:
            os.close(fd)
        for p in running:
            p.poll()


# ---------------------------------------------------------------------------------------------------------
# ``unbroken agent``: one host of a multi-host job


def node_rank(given: int | None) -> int:
    """This host's rank among the agents: ``--node-rank``, else ``SLURM_NODEID``, ``GROUP_RANK`` or
    ``NODE_RANK`` (what srun, torchrun and Kubernetes indexed jobs set), else 0."""
    if given is not None:
        return given
    for name in ("SLURM_NODEID", "GROUP_RANK", "NODE_RANK", "JOB_COMPLETION_INDEX"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def run_agent(args: argparse.Namespace) -> int:
    """``unbroken agent --coordinator HOST:PORT --workers K [--train | SCRIPT.py ARGS]``: start this host's K
    workers (ids ``node_rank * K`` .. ``+ K - 1``) and look after them until the run ends."""
    token = require_token()
    if args.workers < 1:
        raise ValueError(f"--workers = {args.workers} must be >= 1")
    rank = node_rank(args.node_rank)
    init_logger(f"agent {rank}")
    addresses = [a.strip() for a in args.coordinator.split(",") if a.strip()]
    if not addresses:
        raise ValueError("--coordinator needs HOST:PORT (a comma-separated list for standby coordinators)")
    if args.script is None:
        command: tuple[str, ...] = (sys.executable, "-m", "unbroken.train")
    else:
        script = Path(args.script)
        if not script.is_file():
            raise ValueError(f"script {args.script} does not exist; unbroken agent [options] [SCRIPT.py [ARGS ...]]")
        command = (sys.executable, str(script.resolve()), *args.args)
    started = time.time()
    store, _tunnel, address = _reach(addresses, token, args.wait_s)
    cfg = config_from_toml_text(store.get(keys.CONFIG).decode())
    run_dir = Path(store.get(keys.RUN_DIR).decode())
    log_dir = Path(args.log_dir or run_dir / "logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**worker_defaults(cfg), **os.environ, "PYTHONUNBUFFERED": "1", TOKEN_ENV: token}
    env[COORDINATOR_ENV] = ",".join(addresses)
    layout = ReplicaLayout.of(cfg.parallel)
    if args.workers % layout.size:
        raise ValueError(
            f"--workers = {args.workers}: a host runs whole replicas of {layout.size} ranks (parallel.shard x "
            f"parallel.pipeline x parallel.tensor); use a multiple of {layout.size}"
        )
    ids = list(range(rank * args.workers, (rank + 1) * args.workers))
    agent = Agent(
        ids,
        command,
        env,
        log_dir,
        cfg.failures.mttr_s,
        bool(cfg.failures.schedule),
        own_sessions=False,
        layout=layout,
        spares=args.spares,
        fold_kernels=cfg.recovery.reduction is Reduction.EXACT,
        preload=worker_imports(cfg.model.hf_config) if args.script is None else (),
        heartbeat_timeout_s=cfg.comm.heartbeat_timeout_s,
        news_relay=cfg.coordinator.news_relay,
        heartbeats=cfg.comm.heartbeats,
        heartbeat_interval_s=cfg.comm.heartbeat_interval_s,
    )
    agent.warm()
    agent.connect(address, token)
    agent.env[COORDINATOR_ENV] = ",".join(addresses)
    agent.address = ",".join(addresses)
    agent.console = console = ConsoleRelay()  # the leader's prints, on the console of the host that runs it
    agent.start_all()
    log.info("agent %d: workers %s, coordinator %s", rank, ids, address)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    while not stop["now"]:
        for line in console.drain():
            print(line, flush=True)
        agent.tick()
        if agent.store is None:
            try:
                finished = lambda: run_ended(run_dir, started)  # noqa: E731 - read between attempts
                reached, tunnel, address = _reach(addresses, token, cfg.coordinator.hold_s, finished)
            except ValueError:
                log.error("no coordinator answered within %.0f s; stopping this host's workers", cfg.coordinator.hold_s)
                break
            except RunEnded as e:
                # This host was cut off (or its coordinator connection lost) as the run finished: the coordinator
                # is gone, and the run's records (a shared run directory) say how it ended.
                log.info("the coordinator is gone and the run finished (step %d); stopping this host's workers", e.step)
                agent.finished = True
                agent.stop_latecomers(e.members)
                break
            agent.connect(address, token, (reached, tunnel))
        if agent._call(lambda s: s.check([keys.DONE]) or s.check([keys.STOP])):
            agent.finished = True
            members = agent.newest_members() if agent._call(lambda s: s.check([keys.DONE])) else None
            if members is not None:
                agent.stop_latecomers(members)
        if agent.finished or agent.nobody_left():
            break
        wait_for_exit(agent.processes(), agent.wait_s(), (console.read_fd, *agent.wake_fds()))
    agent.stop_workers()
    agent.close()
    for line in console.drain():
        print(line, flush=True)
    console.close()
    # A worker stopped because the run finished without it (it was restarted or cut off too late) is no failure.
    codes = [p.returncode for w, p in agent.workers.items() if w not in agent.late]
    if any(codes) or not agent.finished:
        ended = ", ".join(f"{wid}: {p.returncode}" for wid, p in agent.workers.items())
        log.warning("agent %d: the run %s; exit statuses of the workers: %s", rank,
                    "finished" if agent.finished else "did not finish", ended)  # fmt: skip
    # Every worker ended with 0 only if the run finished (the coordinator may have died just after).
    return 0 if (agent.finished or codes) and not any(codes) else 1


class RunEnded(Exception):
    """The coordinator is gone because the run finished: its last step and members, from its final record."""

    def __init__(self, step: int, members: list[int]) -> None:
        super().__init__(f"the run finished at step {step}")
        self.step, self.members = step, members


def run_ended(run_dir: Path, since: float) -> RunEnded | None:
    """The run's end, if its records (``run_dir``, where this host can read it) hold a final record written
    after ``since`` (a resumed run's directory holds the final records of the runs before it)."""
    final = [r for r in read_records(run_dir, RecordKind.FINAL) if r["time"] > since]
    if not final:
        return None
    return RunEnded(int(final[-1]["step"]), sorted(int(w) for w in final[-1]["checksums"]))


def _reach(
    addresses: list[str], token: str, wait_s: float, finished: Callable[[], RunEnded | None] = lambda: None
) -> tuple[Any, Tunnel, str]:
    """A store connection to whichever of ``addresses`` answers first (the leading coordinator); raises
    ``finished()``'s answer if it has one while none does."""
    deadline = time.monotonic() + wait_s
    last = ""
    while True:
        if (end := finished()) is not None:
            raise end
        for address in addresses:
            try:
                return *open_store(address, timeout_s=5.0, token=token), address
            except (TunnelError, RuntimeError, OSError) as e:
                last = f"{address}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        if time.monotonic() > deadline:
            raise ValueError(f"no coordinator answered within {wait_s:.0f} s ({last})")
        time.sleep(0.2)
