"""The per-host agent: one host's workers, its warm spares and the failure schedule's signals, in one loop.

Owns ``Agent``, a short loop over its parts: the ``Supervisor`` (the workers: started, watched, reported the moment
one exits, paused, restarted, stopped; ``control.host.supervisor``), the ``SparePool`` (warm spares: started,
promoted into a dead worker's place, replaced; ``control.host.spares``) and the ``FaultDelivery`` (the failure
schedule's signals, delivered when a worker reaches a scheduled point; ``control.host.faults``), which share the
host's ``ProcessStarter`` (forked by the zygote, or cold; ``control.host.processes``) and its ``CoordinatorLink``
(the coordinator's store; ``control.host.link``). Between looks the agent sleeps on its processes' pidfds (no
polling loop burning a core). Also ``run_agent``, the ``unbroken agent`` command: one host of a multi-host job.

``unbroken train`` runs one agent in the launcher's process; on a cluster, ``unbroken agent`` runs one per host
(under ``srun``, a Kubernetes pod, or by hand): docs/control.md. What the workers run (the command and what the
host's zygote preloads) is its caller's (``WorkerCommand``): the agent names no program of its own.

The agent knows the coordinator only through the store (``control.store.keys``); when the coordinator restarts,
``connect`` points it at the new one.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.control.console import ConsoleRelay
from unbroken.control.host.command import WorkerCommand, WorkerFor
from unbroken.control.host.faults import FaultDelivery
from unbroken.control.host.link import CoordinatorLink
from unbroken.control.host.processes import ProcessStarter, WakePipe, WorkerProcess, wait_for_exit
from unbroken.control.host.spares import SparePool
from unbroken.control.host.supervisor import STOP_GRACE_S, Supervisor
from unbroken.control.member.env import COORDINATOR_ENV
from unbroken.control.member.hostbeat import HostBeats
from unbroken.control.member.news import RELAY_ENV, NewsRelay
from unbroken.control.store import keys
from unbroken.control.store.connect import open_store
from unbroken.control.store.gateway import TOKEN_ENV, Tunnel, TunnelError, require_token
from unbroken.core.config import HeartbeatMode, RunConfig, config_from_toml_text, deterministic_kernels
from unbroken.core.layout import ReplicaLayout
from unbroken.core.logs import init_logger
from unbroken.core.numerics import DETERMINISTIC_ENV
from unbroken.core.records import RecordKind, read_records

log = logging.getLogger(__name__)


class Agent:
    """The workers ``worker_ids`` of this host, each running ``worker``'s command.

    Args:
        env: every process's environment (the agent adds each one's id, the coordinator's address, ...).
        log_dir: where each process's log goes (``worker-N.log``, ``spare-K.log``, ``zygote.log``).
        restart_after_s: restart a worker that died without a scheduled event after this long; 0: never.
        injections: the run has a failure schedule: its workers' events are delivered here.
        own_sessions: each process in a session of its own, or all in the agent's group (``ProcessStarter``).
        spares: warm spares kept beside the workers (whole replicas of ``layout``).
    """

    def __init__(
        self,
        worker_ids: list[int],
        worker: WorkerCommand,
        env: dict[str, str],
        log_dir: Path,
        restart_after_s: float = 0.0,
        injections: bool = False,
        own_sessions: bool = True,
        layout: ReplicaLayout | None = None,
        spares: int = 0,
        heartbeat_timeout_s: float = 2.0,
        news_relay: bool = False,
        heartbeats: HeartbeatMode = HeartbeatMode.WORKER,
        heartbeat_interval_s: float = 0.25,
    ) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.layout = layout or ReplicaLayout()
        # Under ``comm.heartbeats = "host"``: this host's beat board and the thread that passes its workers' beats
        # on to the coordinator (``control.member.hostbeat``).
        self.beats = (
            HostBeats(heartbeat_interval_s, max(1.0, heartbeat_timeout_s)) if heartbeats is HeartbeatMode.HOST else None
        )
        self.news_relay = news_relay  # run this host's relay of the coordinator's news (``control.member.news``)
        self.relay: NewsRelay | None = None  # that relay, from the first connect
        # A worker that reached an injection point writes to this pipe (INJECT_FD_ENV): the agent's wait ends then.
        wake = WakePipe() if injections else None
        self.link = CoordinatorLink()
        self.starter = ProcessStarter(worker, env, log_dir, own_sessions, wake, self.beats)
        self.supervisor = Supervisor(worker_ids, self.starter, self.link, self.layout, restart_after_s)
        self.spares = SparePool(spares, self.supervisor, self.starter, self.link, self.layout)
        self.faults = FaultDelivery(injections, self.supervisor, self.link, self.layout, wake)

    @property
    def env(self) -> dict[str, str]:
        """Every process's environment, before what each start adds."""
        return self.starter.env

    @property
    def workers(self) -> dict[int, WorkerProcess]:
        return self.supervisor.workers

    def connect(self, address: str, token: str, reached: tuple[Any, Tunnel] | None = None) -> None:
        """Talk to the coordinator at ``address`` (again, after it restarted), over ``reached`` (a store
        connection and its tunnel) if given."""
        self.link.attach(address, token, reached)
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
        self.faults.reconnected()

    def warm(self) -> None:
        """Start the zygote that forks this host's processes, if they can be forked (``ProcessStarter.warm``)."""
        self.starter.warm()

    def start_all(self) -> None:
        self.supervisor.start_all()
        self.spares.start_all()

    def tick(self) -> None:
        """One look: scheduled faults to deliver, exits to report, paused, dead or replaced workers to see to."""
        self.faults.deliver()
        self.supervisor.report_exits()
        self.supervisor.continue_paused()
        self.faults.settle_exits()
        self.spares.fill_places()
        for wid in self.supervisor.replace_failed():
            self.faults.forget(wid)
        self.supervisor.see_to_down()

    def wait_s(self) -> float:
        """How long the next wait for an exit may last (``Supervisor.wait_s``)."""
        return self.supervisor.wait_s()

    def wake_fds(self) -> tuple[int, ...]:
        """Descriptors that end the wait for an exit when readable: a worker at an injection point."""
        return self.faults.wake_fds()

    def processes(self) -> list[WorkerProcess]:
        """The workers' processes, then the waiting spares'."""
        return [*self.supervisor.workers.values(), *self.spares.processes()]

    def alive_ids(self) -> list[int]:
        return self.supervisor.alive_ids()

    def nobody_left(self) -> bool:
        return self.supervisor.nobody_left()

    def stop_job(self, reason: str) -> None:
        self.link.stop_job(reason)

    def stop_latecomers(self, members: list[int]) -> list[int]:
        return self.supervisor.stop_latecomers(members)

    def stop_workers(self, grace_s: float = STOP_GRACE_S, others: list[WorkerProcess] | None = None) -> None:
        """End the waiting spares at once (they hold no state), wait ``grace_s`` for the workers (and ``others``)
        to end, then kill what is left."""
        spares = self.spares.processes()
        self.spares.kill_waiting()
        self.supervisor.stop_workers(grace_s, [*spares, *(others or [])])

    def close(self) -> None:
        """End the zygote, the news relay and the host's heartbeats (the workers are this process's children and
        stay so; any still running watch the coordinator themselves, and their beats are no longer passed on)."""
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        if self.beats is not None:
            self.beats.close()
        self.starter.close()
        self.faults.close()


def worker_defaults(cfg: RunConfig) -> dict[str, str]:
    """The environment a worker starts with unless the user's environment says otherwise: c10d's errors only
    (it logs a C++ stack trace for every bounded store wait that times out), and under deterministic kernels
    (``train.deterministic``) what cuBLAS must read before it starts (``core.numerics``)."""
    env = {"TORCH_CPP_LOG_LEVEL": "ERROR"}
    if deterministic_kernels(cfg):
        env.update(DETERMINISTIC_ENV)
    return env


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


def run_agent(args: argparse.Namespace, worker_for: WorkerFor) -> int:
    """``unbroken agent --coordinator HOST:PORT --workers K [--train | SCRIPT.py ARGS]``: start this host's K
    workers (ids ``node_rank * K`` .. ``+ K - 1``), each running ``worker_for(the run's config)``, and look after
    them until the run ends."""
    token = require_token()
    if args.workers < 1:
        raise ValueError(f"--workers = {args.workers} must be >= 1")
    rank = node_rank(args.node_rank)
    init_logger(f"agent {rank}")
    addresses = [a.strip() for a in args.coordinator.split(",") if a.strip()]
    if not addresses:
        raise ValueError("--coordinator needs HOST:PORT (a comma-separated list for standby coordinators)")
    started = time.time()
    store, _tunnel, address = _reach(addresses, token, args.wait_s)
    cfg = config_from_toml_text(store.get(keys.CONFIG).decode())
    run_dir = Path(store.get(keys.RUN_DIR).decode())
    agent = _host_agent(args, cfg, rank, token, addresses, worker_for(cfg), run_dir)
    agent.warm()
    agent.connect(address, token)
    agent.env[COORDINATOR_ENV] = ",".join(addresses)
    agent.link.address = ",".join(addresses)
    agent.supervisor.console = console = ConsoleRelay()  # the leader's prints, on the console of the host that runs it
    agent.start_all()
    log.info("agent %d: workers %s, coordinator %s", rank, agent.supervisor.ids, address)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    while not stop["now"]:
        for line in console.drain():
            print(line, flush=True)
        agent.tick()
        hold_s = cfg.coordinator.hold_s
        if agent.link.store is None and not _reconnect(agent, addresses, token, hold_s, run_dir, started):
            break
        if _run_over(agent) or agent.nobody_left():
            break
        wait_for_exit(agent.processes(), agent.wait_s(), (console.read_fd, *agent.wake_fds()))
    agent.stop_workers()
    agent.close()
    for line in console.drain():
        print(line, flush=True)
    console.close()
    return _host_status(agent, rank)


def _host_agent(
    args: argparse.Namespace,
    cfg: RunConfig,
    rank: int,
    token: str,
    addresses: list[str],
    worker: WorkerCommand,
    run_dir: Path,
) -> Agent:
    """The agent of host ``rank`` for the run of ``cfg`` (``unbroken agent``'s options in ``args``): its workers in
    the agent's process group (the host's loss takes them all), restarted after ``failures.mttr_s``."""
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
    return Agent(
        list(range(rank * args.workers, (rank + 1) * args.workers)),
        worker,
        env,
        log_dir,
        cfg.failures.mttr_s,
        bool(cfg.failures.schedule),
        own_sessions=False,
        layout=layout,
        spares=args.spares,
        heartbeat_timeout_s=cfg.comm.heartbeat_timeout_s,
        news_relay=cfg.coordinator.news_relay,
        heartbeats=cfg.comm.heartbeats,
        heartbeat_interval_s=cfg.comm.heartbeat_interval_s,
    )


def _reconnect(agent: Agent, addresses: list[str], token: str, hold_s: float, run_dir: Path, started: float) -> bool:
    """The coordinator is gone: reach whichever of ``addresses`` leads now, within ``hold_s``. False: this host's
    workers are to stop (none answered, or the run finished meanwhile)."""
    try:
        finished = lambda: run_ended(run_dir, started)  # noqa: E731 - read between attempts
        reached, tunnel, address = _reach(addresses, token, hold_s, finished)
    except ValueError:
        log.error("no coordinator answered within %.0f s; stopping this host's workers", hold_s)
        return False
    except RunEnded as e:
        # This host was cut off (or its coordinator connection lost) as the run finished: the coordinator is gone,
        # and the run's records (a shared run directory) say how it ended.
        log.info("the coordinator is gone and the run finished (step %d); stopping this host's workers", e.step)
        agent.supervisor.finished = True
        agent.stop_latecomers(e.members)
        return False
    agent.connect(address, token, (reached, tunnel))
    return True


def _run_over(agent: Agent) -> bool:
    """Whether the run finished or was stopped (the coordinator's keys say); a finished run's workers that are
    not among its last members are stopped at once."""
    if agent.link.call(lambda s: s.check([keys.DONE]) or s.check([keys.STOP])):
        agent.supervisor.finished = True
        members = agent.link.newest_members() if agent.link.call(lambda s: s.check([keys.DONE])) else None
        if members is not None:
            agent.stop_latecomers(members)
    return agent.supervisor.finished


def _host_status(agent: Agent, rank: int) -> int:
    """The agent's exit status: 0 only if the run finished and every worker ended with 0 (a worker stopped because
    the run finished without it, restarted or cut off too late, is no failure)."""
    sup = agent.supervisor
    codes = [p.returncode for w, p in sup.workers.items() if w not in sup.late]
    if any(codes) or not sup.finished:
        ended = ", ".join(f"{wid}: {p.returncode}" for wid, p in sup.workers.items())
        log.warning("agent %d: the run %s; exit statuses of the workers: %s", rank,
                    "finished" if sup.finished else "did not finish", ended)  # fmt: skip
    # Every worker ended with 0 only if the run finished (the coordinator may have died just after).
    return 0 if (sup.finished or codes) and not any(codes) else 1


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
