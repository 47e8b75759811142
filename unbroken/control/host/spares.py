"""A host's warm spares: started beside the workers, promoted into a dead worker's place, replaced.

Owns ``SparePool``: each spare is a process running the workers' command without a worker id, which builds
everything a worker builds and then waits outside the group for the id of a dead worker (``UNBROKEN_SPARE``, its
index; ``UNBROKEN_DEVICE_INDEX``, its device on the host). Once a dead worker is no longer a member, the oldest live
spare is told its id (``keys.spare``): it joins under that id in the next epoch and receives the state, and a new
spare is started in its stead. A spare that dies while it waits is started again, a bounded number of times. Each
start, death and promotion is a ``spare`` record. Also ``check_spares``: how many spares a layout can use.

With replicas of several ranks, spares come as whole replicas: the spares k0 .. k0 + size - 1 (k0 a multiple of the
replica's size) form one, of their own incarnation, rank k - k0 each; a spare replica takes the place of a replica
once every rank of it has ended (``Supervisor.replica_ended``).
"""

from __future__ import annotations

import logging
import secrets
import time

from unbroken.control.host.link import CoordinatorLink
from unbroken.control.host.processes import ProcessStarter, WorkerProcess
from unbroken.control.host.supervisor import Supervisor
from unbroken.control.member.env import COORDINATOR_ENV, DEVICE_INDEX_ENV, LOCAL_WORKERS_ENV, SPARE_ENV, WORKER_ID_ENV
from unbroken.control.store import keys
from unbroken.control.store.connect import exit_reason
from unbroken.core.layout import INCARNATION_ENV, ReplicaLayout
from unbroken.core.records import RecordKind, SpareState, make

log = logging.getLogger(__name__)

MAX_SPARE_DEATHS = 3  # per spare: a host whose spares keep dying while they wait stops starting them


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


class SparePool:
    """``count`` warm spares for ``supervisor``'s workers, started by ``starter``."""

    def __init__(
        self, count: int, supervisor: Supervisor, starter: ProcessStarter, link: CoordinatorLink, layout: ReplicaLayout
    ) -> None:
        check_spares(count, layout)
        self.count = count
        self.supervisor = supervisor
        self.starter = starter
        self.link = link
        self.layout = layout
        self.waiting: dict[int, WorkerProcess] = {}  # warm spares by index, not yet promoted
        self.incarnations: dict[int, str] = {}  # a spare replica's (by its first index // size)
        self.next_spare = 0
        self.deaths = 0  # spares that died while they waited
        # The host's device index of each spare (the workers' come from their ids): the first spares take the
        # ones after the workers'; a spare started to replace a promoted one takes the dead worker's.
        workers = len(supervisor.ids)
        self.devices: dict[int, int] = {}
        self.free_devices = list(range(workers, workers + count))
        self.worker_devices = {wid: i for i, wid in enumerate(supervisor.ids)}  # a promoted spare keeps its own

    def start_all(self) -> None:
        for _ in range(self.count // self.layout.size):
            self.start()

    def start(self) -> None:
        """Start warm spare ``next_spare`` (with replicas of several ranks, a whole spare replica: ``layout.size``
        spares that form their replica's process group and build their parts of the model together)."""
        size = self.layout.size
        first = self.next_spare
        self.next_spare += size
        if size > 1:
            self.incarnations[first // size] = secrets.token_hex(4)
        for k in range(first, first + size):
            self.devices[k] = device = self.free_devices.pop(0)
            env = {**self.starter.env, COORDINATOR_ENV: self.link.address, SPARE_ENV: str(k)}
            env |= {LOCAL_WORKERS_ENV: str(len(self.supervisor.ids)), DEVICE_INDEX_ENV: str(device)}
            if size > 1:
                env[INCARNATION_ENV] = self.incarnations[first // size]
            env.pop(WORKER_ID_ENV, None)
            self.waiting[k] = proc = self.starter.start(env, f"spare-{k}.log")
            record = make(RecordKind.SPARE, time.time(), spare=k, state=SpareState.STARTED, worker=-1, pid=proc.pid)
            self.link.record(record)

    def processes(self) -> list[WorkerProcess]:
        return list(self.waiting.values())

    def kill_waiting(self) -> None:
        """End the waiting spares at once: they hold no state (one may still be importing torch)."""
        for spare in self.waiting.values():
            if spare.poll() is None:
                spare.kill()

    def replace_dead(self) -> None:
        """A spare that died while it waited (not one that left because the run is over) is started again, on
        its device (a spare replica whole: its other ranks are ended first, their group has lost a rank); after
        ``MAX_SPARE_DEATHS`` x the spares' count of such deaths (a host that cannot start one) no more are
        started."""
        size = self.layout.size
        for first in sorted({k - k % size for k in self.waiting}):
            ranks = [k for k in range(first, first + size) if k in self.waiting]
            died = {k: code for k in ranks if (code := self.waiting[k].poll()) not in (None, 0)}
            if not died:
                continue
            for k, code in died.items():
                pid, why = self.waiting[k].pid, exit_reason(code)
                self.link.record(
                    make(RecordKind.SPARE, time.time(), spare=k, state=SpareState.EXITED, worker=-1, pid=pid, why=why)
                )
            for k in ranks:
                proc = self.waiting.pop(k)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                self.free_devices.append(self.devices.pop(k))
            self.incarnations.pop(first // size, None)
            self.deaths += len(died)
            k, code = next(iter(died.items()))
            if self.deaths > MAX_SPARE_DEATHS * self.count:
                log.warning("spare %d exited with status %s; too many spares died: starting no more", k, code)
                continue
            log.warning("spare %d exited with status %s while it waited: starting another", k, code)
            self.start()

    def fill_places(self) -> None:
        """Once the job has an epoch, each dead worker's place goes to a spare. Each death is reported
        (``Supervisor.report_exits``): its spare registers once the coordinator has removed it (``ft.process``
        waits for that epoch; a member's id would get another id)."""
        if not self.waiting or self.supervisor.finished or self.link.store is None:
            return
        self.replace_dead()
        paused = self.supervisor.pauses
        dead = [w for w, p in self.supervisor.workers.items() if p.poll() not in (None, 0) and w not in paused]
        for wid in dead if dead and self.link.newest_members() is not None else []:
            if self.supervisor.workers[wid].poll() is None:
                continue  # a rank of a replica a spare replica has just taken the place of
            if not self.promote(wid):
                break

    def promote(self, wid: int) -> bool:
        """Dead worker ``wid`` (no longer a member) is replaced by the oldest live spare, which joins under its id
        in the next epoch and receives the state; a new spare is started in its stead. With replicas of several
        ranks, once every rank of ``wid``'s replica has ended, the oldest whole spare replica takes the replica's
        place, each spare the worker of its rank. False: no spare to take it (yet)."""
        self.replace_dead()
        if not self.waiting or self.link.store is None:
            return False
        size = self.layout.size
        first = min(self.waiting)
        replica = self.layout.replica_of(wid)
        if size > 1:
            if not self.supervisor.replica_ended(wid):
                return False  # a rank of the replica still runs: it leaves (or is ended) first
            self.supervisor.incarnations[replica] = self.incarnations.pop(first // size)
        places = {first + self.layout.rank_of(w): w for w in self.layout.workers_of(replica)}
        for k, worker in places.items():
            proc = self.waiting.pop(k)
            self.free_devices.append(self.worker_devices[worker])
            self.worker_devices[worker] = self.devices.pop(k)
            self.link.tell(keys.spare(k), str(worker))
            self.supervisor.adopt(worker, proc)
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            note = f"[agent] {stamp} worker {worker} continues as spare {k} (logs/spare-{k}.log)"
            with open(self.starter.log_dir / f"worker-{worker}.log", "a") as log_file:
                log_file.write(note + "\n")
            promoted = make(
                RecordKind.SPARE, time.time(), spare=k, state=SpareState.PROMOTED, worker=worker, pid=proc.pid
            )
            self.link.record(promoted)
            log.info("spare %d takes the place of worker %d", k, worker)
        self.start()
        return True
