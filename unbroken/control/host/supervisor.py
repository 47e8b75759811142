"""The workers of one host: started, watched, paused, restarted and stopped.

Owns ``Supervisor``: the host's worker processes by id (``UNBROKEN_COORDINATOR``, ``UNBROKEN_WORKER_ID``,
``UNBROKEN_LOCAL_WORKERS`` in their environment), which of them are down (killed or stopped, and when each comes
back) or paused (until when), the report of each exit to the coordinator (``dead/<id>``: the fastest failure detector
there is), the kill of a hung worker once the coordinator has excluded it, and the restart of a downed worker after
its delay (it then rejoins with live state transfer; a worker that died without a scheduled event is restarted after
``restart_after_s`` when that is set, unless the coordinator refused it). At the run's end it stops the workers the
run finished without, and stops the rest after a grace.

With replicas of several ranks (``[parallel]``), a replica's ranks are on one host and are started, and
restarted, together: each start of a replica gets a new incarnation (``UNBROKEN_REPLICA_INCARNATION``, the
name of its own process group's rendezvous), and a replica whose rank died is started again only once every
one of its ranks has ended (the others leave by themselves when the membership removes the replica).

It decides nothing about faults or spares: the delivery of the failure schedule (``control.host.faults``) pauses or
downs workers through ``pause`` and ``put_down``; the spare pool (``control.host.spares``) hands a promoted spare
over through ``adopt``.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import time
from typing import Any

from unbroken.control.console import CONSOLE_ENV, ConsoleRelay
from unbroken.control.host.link import CoordinatorLink
from unbroken.control.host.processes import ProcessStarter, WorkerProcess
from unbroken.control.member.env import COORDINATOR_ENV, LOCAL_WORKERS_ENV, STARTED_AT_ENV, WORKER_ID_ENV
from unbroken.control.store.connect import exit_reason, report_death
from unbroken.core.exits import EXIT_STOPPED
from unbroken.core.layout import INCARNATION_ENV, ReplicaLayout

log = logging.getLogger(__name__)

POLL_S = 0.005  # the shortest wait: a restart or the end of a pause due sooner is waited for this long
IDLE_WAIT_S = 0.25  # the longest; a process exit, or a worker at an injection point (INJECT_FD_ENV), wakes it at once
STOP_GRACE_S = 10.0


class Supervisor:
    """The workers ``ids`` of this host, started by ``starter``, reported over ``link``."""

    def __init__(
        self,
        ids: list[int],
        starter: ProcessStarter,
        link: CoordinatorLink,
        layout: ReplicaLayout,
        restart_after_s: float = 0.0,
    ) -> None:
        self.ids = list(ids)
        self.starter = starter
        self.link = link
        self.layout = layout
        self.restart_after_s = restart_after_s
        # What the group's leader prints, for this process's console (``control.console``); None: logs only.
        self.console: ConsoleRelay | None = None
        self.workers: dict[int, WorkerProcess] = {}
        self.reported: set[int] = set()
        self.down: dict[int, dict[str, Any]] = {}  # workers killed or stopped, and when they come back
        self.pauses: dict[int, float] = {}  # paused workers and when to SIGCONT them
        self.incarnations: dict[int, str] = {}  # replica -> the incarnation its running ranks were started with
        self.finished = False  # the run is over: exits are not failures, nobody is restarted
        self.completed = False  # the run finished (not stopped): its last members are known
        self.late: set[int] = set()  # workers stopped because the run finished without them
        self.refused: set[int] = set()  # ids the coordinator refused: not restarted

    # -- starts ---------------------------------------------------------------------------------------
    def start_all(self) -> None:
        for replica in self.layout.replicas(self.alive_ids()):
            self.incarnations[replica] = secrets.token_hex(4)
        for wid in self.alive_ids():
            self.start_worker(wid)

    def start_worker(self, worker_id: int) -> None:
        env = {
            **self.starter.env,
            COORDINATOR_ENV: self.link.address,
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
        self.workers[worker_id] = self.starter.start(env, f"worker-{worker_id}.log", fds)
        self.reported.discard(worker_id)

    def restart(self, wid: int) -> None:
        """Start ``wid`` again (a replica of several ranks: all of its ranks, under a new incarnation)."""
        log.info("restarting worker %d (it ended with status %s)", wid, self.workers[wid].returncode)
        if self.layout.size == 1:
            self.start_worker(wid)
            return
        replica = self.layout.replica_of(wid)
        self.incarnations[replica] = secrets.token_hex(4)
        for mate in self.layout.workers_of(replica):
            self.down.pop(mate, None)
            self.start_worker(mate)

    def adopt(self, wid: int, proc: WorkerProcess) -> None:
        """``proc`` (a promoted spare) now runs worker ``wid``."""
        self.workers[wid] = proc
        self.reported.discard(wid)
        self.down.pop(wid, None)

    # -- states -----------------------------------------------------------------------------------------
    def alive_ids(self) -> list[int]:
        return [w for w in self.ids if w not in self.down]

    def out(self, wid: int) -> bool:
        """Whether ``wid`` is down or paused (its exit, or its silence, is already accounted for)."""
        return wid in self.down or wid in self.pauses

    def failed(self) -> list[int]:
        """Workers whose process ended with a failure and that are neither down nor paused."""
        return [w for w, p in self.workers.items() if p.poll() not in (None, 0) and not self.out(w)]

    def pause(self, wid: int, until: float) -> None:
        """``wid`` was stopped (SIGSTOP) and is continued at ``until`` (``time.monotonic``)."""
        self.pauses[wid] = until

    def put_down(self, wid: int, rejoin: float | None, hung: bool = False, at: float | None = None) -> None:
        """``wid`` is down from ``at`` (now) and restarted ``rejoin`` s later (None: never); a ``hung`` one is
        killed once the coordinator excluded it."""
        self.down[wid] = {"rejoin": rejoin, "at": time.monotonic() if at is None else at, "hung": hung}

    def replica_ended(self, wid: int) -> bool:
        """Every rank of ``wid``'s replica has ended (a replica restarts only whole); a rank still running once
        the membership excludes it (it hangs) is killed."""
        running = [m for m in self.layout.workers_of(self.layout.replica_of(wid)) if self.workers[m].poll() is None]
        if not running:
            return True
        members = self.link.newest_members()
        for mate in running:
            if members is not None and mate not in members and mate not in self.pauses:
                self.workers[mate].kill()
                self.workers[mate].wait()
                self.reported.add(mate)  # already excluded; its exit is not news
        return all(self.workers[m].poll() is not None for m in running)

    def nobody_left(self) -> bool:
        """No worker process runs and none is due to restart (e.g. every one failed before joining)."""
        restarts = any(info["rejoin"] is not None for info in self.down.values())
        # A worker that failed since the last look (while this agent waited for its coordinator, say) is restarted
        # at the next one, unless the coordinator refused it.
        unseen = self.restart_after_s > 0 and any(
            p.poll() not in (None, 0) and w not in self.down and w not in self.refused for w, p in self.workers.items()
        )
        return not restarts and not unseen and all(p.poll() is not None for p in self.workers.values())

    def wait_s(self) -> float:
        """How long the next wait for an exit may last: ``IDLE_WAIT_S`` (an exit or a worker at an injection point
        ends it sooner), and no longer than until the next restart or the end of a pause falls due."""
        wait = IDLE_WAIT_S
        dues = [info["at"] + info["rejoin"] for info in self.down.values() if info["rejoin"] is not None]
        dues += self.pauses.values()
        if dues:
            wait = min(wait, max(POLL_S, min(dues) - time.monotonic()))
        return wait

    # -- the looks ----------------------------------------------------------------------------------------
    def report_exits(self) -> None:
        if self.link.store is None or self.finished:
            return  # nobody to tell (yet), or the workers are leaving because the run is over
        for wid, proc in self.workers.items():
            code = proc.poll()
            if code is not None and code != 0 and wid not in self.reported:  # 0: finished the run
                self.reported.add(wid)
                self.link.call(report_death, wid, exit_reason(code))

    def continue_paused(self) -> None:
        """Continue (SIGCONT) the paused workers whose pause is over."""
        now = time.monotonic()
        for wid, until in list(self.pauses.items()):
            if now >= until:
                del self.pauses[wid]
                if self.workers[wid].poll() is None:
                    os.kill(self.workers[wid].pid, signal.SIGCONT)

    def replace_failed(self) -> list[int]:
        """With ``restart_after_s`` set: a worker that died without a scheduled event (killed from outside, excluded
        after a stop) is down, and restarted after that delay, as a cluster's scheduler would replace it; not one
        the coordinator refused (it would be refused again). Returns the ids seen to (put down or refused)."""
        if self.restart_after_s <= 0 or self.finished:
            return []
        now = time.monotonic()
        failed = self.failed()
        for wid in failed:
            if wid in self.refused or self.link.refused(wid):
                self.refused.add(wid)
                continue
            self.put_down(wid, self.restart_after_s, at=now)
        return failed

    def see_to_down(self) -> None:
        """Kill the hung workers the coordinator has excluded; restart the downed workers whose delay is over (a
        replica once all of its ranks have ended)."""
        now = time.monotonic()
        for wid, info in list(self.down.items()):
            proc = self.workers[wid]
            if info["hung"] and proc.poll() is None:
                members = self.link.newest_members()
                if members is not None and wid not in members:
                    proc.kill()
                    proc.wait()
                    self.reported.add(wid)  # already excluded; its exit is not news
                continue
            rejoin = info["rejoin"]
            due = rejoin is not None and now >= info["at"] + rejoin
            if due and proc.poll() is not None and self.link.store is not None and not self.finished:
                if self.layout.size > 1 and not self.replica_ended(wid):
                    continue
                del self.down[wid]
                self.restart(wid)

    # -- the end --------------------------------------------------------------------------------------------
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
            note = logging.LogRecord(log.name, logging.INFO, __file__, 0, "%s", None, None)
            note.msg = f"the run finished before worker {wid} rejoined (it was restarted too late): stopped it"
            line = logging.Formatter("[agent] %(asctime)s %(levelname)s %(name)s: %(message)s").format(note)
            with open(self.starter.log_dir / f"worker-{wid}.log", "a") as log_file:
                log_file.write(line + "\n")
        return late

    def stop_workers(self, grace_s: float = STOP_GRACE_S, others: list[WorkerProcess] | None = None) -> None:
        """Wait ``grace_s`` for the workers (and ``others``) to end, then kill what is left."""
        for info in self.down.values():
            info["hung"] = False
        procs = [*self.workers.values(), *(others or [])]
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
