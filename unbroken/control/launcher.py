"""The single-machine launcher behind ``unbroken train`` and ``unbroken launch``: a coordinator process and
one host's agent (``control.host.agent``) with N worker processes.

Owns a run on one host: it validates everything before writing anything, prepares the run directory, starts
the coordinator (handing it the listening socket it bound, so a port in use is an error before anything
starts, and keeping it, so a coordinator that dies is replaced at the same address), runs the agent that
starts and watches the workers, shows progress from ``metrics.jsonl``, runs the ``restart`` baseline, and
on Ctrl-C stops every process it started. Checkpoints are written atomically by the workers, so an
interrupted run keeps its last good checkpoint. What the workers run (``WorkerCommand``: the built-in trainer, or a
user's script, and what the host's zygote preloads for it) is the caller's: the launcher names no program.

The job's secret token (``UNBROKEN_TOKEN``, generated here unless the environment already has one) goes
to the coordinator and the workers through their environment; every store connection is authenticated
with it (``gateway``).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.control.console import ConsoleRelay
from unbroken.control.coordinator.loop import spawn_coordinator
from unbroken.control.host.agent import Agent, worker_defaults
from unbroken.control.host.command import WorkerCommand, WorkerFor
from unbroken.control.host.processes import WakePipe, WorkerProcess, wait_for_exit
from unbroken.control.host.spares import check_spares
from unbroken.control.host.supervisor import POLL_S, STOP_GRACE_S
from unbroken.control.launchcheck import launch_warnings
from unbroken.control.status.progress import ProgressView, describe_error, print_summary
from unbroken.control.store.connect import bind_listen_socket
from unbroken.control.store.gateway import TOKEN_ENV, new_token, token_from_env
from unbroken.core import ckptfiles
from unbroken.core.config import RecoveryPolicy, RunConfig, dump_config, replace
from unbroken.core.failures import COORDINATOR_TARGET, FailureSchedule, build_schedule
from unbroken.core.layout import ReplicaLayout
from unbroken.core.records import METRICS_FILE, Quotas, RecordKind, append_records, decode, make

MAX_COORDINATOR_RESTARTS = 10  # a coordinator that keeps dying is a bug, not a fault to ride out


@dataclass(frozen=True)
class LaunchPlan:
    """Everything validated: what to run, where, and the socket the coordinator will listen on."""

    cfg: RunConfig
    run_dir: Path
    workers: int
    resume: bool
    sock: socket.socket
    worker: WorkerCommand  # what each worker runs: the trainer, or a user's script and its arguments
    host: str = "127.0.0.1"
    restart_after_s: float = 0.0  # restart a worker that died (scheduled or not) after this long; 0 = never
    spares: int = 0  # warm spares kept ready beside the workers (control.host.spares)


def default_run_dir(config_name: str) -> Path:
    return Path("runs") / f"{config_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def plan_launch(
    cfg: RunConfig,
    run_dir: Path,
    workers: int,
    resume: bool,
    host: str,
    port: int,
    worker_for: WorkerFor,
    validate: Callable[[RunConfig, Path, bool], RunConfig | None] | None = None,
    spares: int = 0,
) -> LaunchPlan:
    """Validate the launch (``validate`` checks what the workers will run: the trainer's data and model, and
    may return the config with what it learnt, e.g. prepared data's vocabulary); raises ValueError (one line)
    and writes nothing if anything is wrong. Each worker runs ``worker_for(the resolved config)``."""
    if workers < 1:
        raise ValueError(f"--workers = {workers} must be >= 1")
    ReplicaLayout.of(cfg.parallel).replicas_in(workers)  # whole replicas only
    check_spares(spares, ReplicaLayout.of(cfg.parallel))
    if resume:
        if not (run_dir / "config.toml").is_file():
            raise ValueError(f"--resume {run_dir}: not a run directory (no config.toml)")
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(f"output directory {run_dir} exists and is not empty; choose another or use --resume")
    f = cfg.failures
    schedule = build_schedule(
        f.schedule,
        f.mttr_s,
        f.mtbf_s,
        f.seed,
        f.step_time_s,
        workers,
        cfg.train.steps,
        f.scenario,
        f.scenario_hours,
        cfg.train.microbatches,
    )
    if f.mtbf_s > 0 or f.mttr_s > 0 or f.scenario:
        # The resolved config names every event, so the run (and its workers) see exactly what is injected.
        cfg = replace(cfg, failures=replace(f, schedule=schedule.describe(), mtbf_s=0.0, mttr_s=0.0, scenario=""))
    sock = bind_listen_socket(host, port)
    try:
        if validate is not None:
            # ValueError on bad data or checkpoints, before anything is written
            cfg = validate(cfg, run_dir, resume) or cfg
    except BaseException:
        sock.close()
        raise
    return LaunchPlan(cfg, run_dir, workers, resume, sock, worker_for(cfg), host, f.mttr_s, spares)


class Launcher:
    """Runs a validated ``LaunchPlan`` to the end; ``run()`` returns the process exit status.

    The coordinator is a child process serving the plan's listening socket, which the launcher keeps: a
    coordinator that dies before the run is over (``kill -9``, a crash, ``kill:coordinator`` in the schedule)
    is started again at the same address; it recovers from its journal and the workers, who kept training,
    register with it again. The workers are this host's ``Agent``'s."""

    def __init__(self, plan: LaunchPlan, show_progress: bool = True, show_summary: bool = True) -> None:
        self.plan = plan
        self.cfg = plan.cfg
        self.run_dir = plan.run_dir
        self.show_progress = show_progress
        self.show_summary = show_summary
        self.coordinator: WorkerProcess | None = None
        self.interrupted = False
        self.interrupt_reason = "interrupted by the user (Ctrl-C)"
        # Written on an interrupt: the loop's wait for an exit (up to agent.IDLE_WAIT_S) ends at once. A later stop
        # lets the workers commit more steps, whose records a stopping coordinator may no longer append.
        self._interrupts = WakePipe()
        self._metrics_offset = 0
        self._earlier: list[dict[str, Any]] = []  # the records of the run's earlier sessions (--resume)
        self._quotas = Quotas()  # the file's step records with their quotas in full, read in file order
        self._records: list[dict[str, Any]] = []  # this launch's
        self._unshown: list[dict[str, Any]] = []  # of those, the records the progress view has not had yet
        self._failures_seen = 0  # failure records among _records (counted as they arrive)
        self._final_seen = False
        self._stopped_seen = False
        self.failures_handled = 0  # restart policy: failure records already acted on
        self.restarts = 0  # restart policy: relaunches of the whole job
        self.coordinator_restarts = 0
        self.sock = plan.sock
        self.resume = plan.resume
        self.token = token_from_env() or new_token()
        env = {**worker_defaults(self.cfg), **os.environ, "PYTHONUNBUFFERED": "1", TOKEN_ENV: self.token}
        self.env = env
        schedule = FailureSchedule.parse(self.cfg.failures.schedule)
        self.coordinator_kills = sorted(e.step for e in schedule.events if e.targets_coordinator)
        self.agent = Agent(
            list(range(plan.workers)),
            plan.worker,
            env,
            self.run_dir / "logs",
            plan.restart_after_s,
            injections=bool(schedule.events),
            layout=ReplicaLayout.of(self.cfg.parallel),
            spares=plan.spares,
            heartbeat_timeout_s=self.cfg.comm.heartbeat_timeout_s,
            news_relay=self.cfg.coordinator.news_relay,
            heartbeats=self.cfg.comm.heartbeats,
            heartbeat_interval_s=self.cfg.comm.heartbeat_interval_s,
        )
        self.console = ConsoleRelay()  # what the group's leader prints, shown here (every worker's is in its log)
        self.agent.supervisor.console = self.console

    @property
    def workers(self) -> dict[int, WorkerProcess]:
        return self.agent.workers

    # -- processes ----------------------------------------------------------------------------------
    def start_coordinator(self, restore: bool = False) -> None:
        self.coordinator, address = spawn_coordinator(
            self.sock,
            self.run_dir,
            len(self.agent.alive_ids()),
            self.resume,
            self.env,
            restore,
            self.agent.starter.zygote,
        )
        self.agent.connect(address, self.token)

    def _coordinator_up(self) -> bool:
        return self.coordinator is not None and self.coordinator.poll() is None

    def stop_all(self, reason: str) -> None:
        """Ask everyone to stop, wait a grace period, then kill what is left."""
        if self._coordinator_up():
            self.agent.stop_job(reason)
        self.agent.stop_workers(others=[self.coordinator] if self.coordinator else [])

    def _kill_coordinator_if_due(self) -> None:
        """``kill:coordinator,step=N``: SIGKILL the coordinator once step N is committed."""
        if not self.coordinator_kills or not self._coordinator_up():
            return
        committed = max((r["step"] for r in self._records if r.get("type") == RecordKind.STEP), default=-1)
        if committed >= self.coordinator_kills[0]:
            step = self.coordinator_kills.pop(0)
            assert self.coordinator is not None
            self.coordinator.kill()
            self.coordinator.wait()
            event = f"kill:coordinator,step={step}"
            record = make(RecordKind.INJECTED, time.time(), worker=COORDINATOR_TARGET, event=event, kind="kill")
            append_records(self.run_dir, [record])  # the coordinator, the records' writer, is what was killed

    def _restart_coordinator(self, progress: ProgressView) -> bool:
        """The coordinator died before the run ended: start a successor at the same address (it recovers from
        its journal; the workers hold on and register again). False if that is not to be (stopped, done, or
        it keeps dying)."""
        if self._final_seen or self._stopped_seen or self.coordinator_restarts >= MAX_COORDINATOR_RESTARTS:
            return False
        if self.cfg.coordinator.state != "journal":
            return False  # a standby coordinator takes over (etcd): not this launcher's job
        assert self.coordinator is not None
        how = self.coordinator.returncode
        self.coordinator_restarts += 1
        self.agent.link.store = None
        self.start_coordinator(restore=True)
        progress.note(f"the coordinator died (status {how}); a new one took over at the same address")
        return True

    # -- progress -----------------------------------------------------------------------------------
    def _new_records(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        with open(path) as f:
            f.seek(self._metrics_offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self._metrics_offset += len(complete.encode())
        records = [self._quotas.expand(r) for r in map(decode, complete.splitlines()) if r is not None]  # torn: skipped
        self._records += records
        self._unshown += records
        self._failures_seen += sum(1 for r in records if r.get("type") == RecordKind.FAILURE)
        self._final_seen = self._final_seen or any(r.get("type") == RecordKind.FINAL for r in records)
        self._stopped_seen = self._stopped_seen or any(r.get("type") == RecordKind.STOPPED for r in records)
        self.agent.supervisor.finished = self._final_seen
        return records

    def _show(self, progress: ProgressView) -> None:
        """The records read and what the leader printed, to the progress view, in the order of the run. The pipe
        is drained after the records were read: every line the leader printed before a record it published is
        then in hand when that record is, and goes first."""
        records, self._unshown = self._unshown, []
        for line in self.console.drain_lines():
            progress.show(line)
        for record in records:
            progress.update(record)
        progress.tick()

    def _show_errors(self) -> None:
        """After the progress view: the errors among the records it never had (a worker's error is shown, --quiet
        or not, whatever happens)."""
        records, self._unshown = self._unshown, []
        for record in records:
            if record.get("type") == RecordKind.ERROR:
                print(describe_error(record, self.run_dir / "logs"), file=sys.stderr, flush=True)

    def _skip_earlier_records(self) -> None:
        """On ``--resume``: the records already in metrics.jsonl are the earlier sessions'. They count in the
        summary, but are not shown again as if training restarted, and say nothing about this launch (an
        earlier ``final`` or ``stopped`` must not end it)."""
        path = self.run_dir / METRICS_FILE
        if not path.exists():
            return
        data = path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        self._metrics_offset = len(complete)
        lines = complete.decode(errors="replace").splitlines()
        self._earlier = [self._quotas.expand(r) for r in map(decode, lines) if r is not None]

    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        if not self.plan.resume:
            dump_config(self.cfg, self.run_dir)
        else:
            ckptfiles.clean_partial(self.run_dir)  # temporary files of saves that were killed half-way
            self._skip_earlier_records()
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        for warning in launch_warnings(self.cfg, self.plan.workers, self.plan.spares):
            print(warning, file=sys.stderr, flush=True)
        try:
            self.agent.warm()  # the zygote forks the coordinator and the workers once it has imported torch
            self.start_coordinator()
            self.agent.start_all()
            logs = self.run_dir / "logs"
            with ProgressView(self.cfg.train.steps, self.show_progress, self.cfg.train.microbatches, logs) as progress:
                progress.earlier(self._earlier)
                while True:
                    self._new_records()
                    self._show(progress)
                    self._kill_coordinator_if_due()
                    self.agent.tick()
                    if self._needs_restart():
                        self._restart_job(progress)
                        continue
                    if self.interrupted:
                        progress.note("interrupted: stopping every process (the last checkpoint is kept)")
                        self.stop_all(self.interrupt_reason)
                        self._new_records()
                        self._show(progress)
                        return 130
                    assert self.coordinator is not None
                    if self.coordinator.poll() is not None:
                        self._new_records()
                        if not self._restart_coordinator(progress):
                            break
                    if not self._final_seen and self.agent.nobody_left():
                        self.stop_all("every worker exited and none is due to restart")
                        break
                    procs = [*self.agent.processes(), self.coordinator]
                    readable = (self.console.read_fd, *self._interrupts.fds(), *self.agent.wake_fds())
                    wait_for_exit(procs, self.agent.wait_s(), readable)
                self._new_records()
                self._show(progress)
            return self._finish()
        finally:
            signal.signal(signal.SIGINT, previous)
            self._interrupts.close()
            self.agent.close()
            self.sock.close()
            self.console.close()
            for p in [*self.agent.processes(), *([self.coordinator] if self.coordinator else [])]:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def _restart_job(self, progress: ProgressView) -> None:
        """The ``restart`` baseline: stop every process, then start a new coordinator and the survivors
        from the last checkpoint (what checkpoint-and-restart systems do)."""
        t0 = time.monotonic()
        self.stop_all("restarting after a failure (restart policy)")
        self._new_records()
        self._show(progress)
        self.failures_handled = self._failures_seen
        self.restarts += 1
        self.sock.close()
        self.sock = bind_listen_socket(self.plan.host, 0)
        self.resume = True
        self.agent.supervisor.reported = set(self.agent.supervisor.down)
        self.start_coordinator()
        self.agent.start_all()
        alive = self.agent.alive_ids()
        record = make(RecordKind.RESTART, time.time(), workers=alive, stop_and_relaunch_s=time.monotonic() - t0)
        append_records(self.run_dir, [record])
        progress.note(f"restart: relaunched workers {alive} from the last checkpoint")

    def _needs_restart(self) -> bool:
        if self.cfg.recovery.policy is not RecoveryPolicy.RESTART:
            return False
        exited = any(p.poll() not in (None, 0) for w, p in self.workers.items() if w not in self.agent.supervisor.down)
        return self._failures_seen > self.failures_handled or exited

    def _on_sigint(self, _signum: int, _frame: object) -> None:
        self.interrupted = True
        self._interrupts.wake()

    def interrupt(self, reason: str) -> None:
        """Stop the run at the launcher's next look, as Ctrl-C does (exit 130, the last checkpoint kept), for
        ``reason`` (a benchmark that has its figures); callable from another thread."""
        self.interrupt_reason = reason
        self.interrupted = True
        self._interrupts.wake()

    def _finish(self) -> int:
        if self._final_seen:
            at_end = next((r["members"] for r in reversed(self._records) if r.get("type") == RecordKind.MEMBERSHIP), [])
            self.agent.stop_latecomers(at_end)  # restarted too late to rejoin: not part of the run
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in self.workers.values()):
            time.sleep(POLL_S)
        for line in self.console.drain():  # what the leader printed last, after its final step
            print(line, flush=True)
        self._new_records()  # what the workers wrote themselves if the coordinator died
        self._show_errors()
        done = self._final_seen
        assert self.coordinator is not None
        died = self.coordinator.returncode is not None and self.coordinator.returncode < 0
        lost = [r for r in self._records if r.get("type") == RecordKind.COORDINATOR_LOST]
        if not done and (died or lost):
            code = self.coordinator.returncode
            how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit {code}"
            saved = (
                f"the workers saved the state of step {lost[-1]['step']}"
                if lost
                else "the workers could not save; the last checkpoint on disk is kept"
            )
            print(
                f"unbroken: the coordinator died ({how}); {saved}; continue with: "
                f"unbroken train --resume {self.run_dir} --workers {self.plan.workers}",
                file=sys.stderr,
            )
            return 1
        stopped = [r for r in self._records if r.get("type") == RecordKind.STOPPED]
        if not done and stopped:
            # A check that guards the training state failed, or train.nonfinite = stop: the reason is the line.
            print(f"unbroken: error: {stopped[-1]['reason']}", file=sys.stderr)
            return 1
        if done and (problem := self._final_checkpoint_problem()):
            print(f"unbroken: the run finished but {problem}; see {self.run_dir / 'logs'}", file=sys.stderr)
            return 1
        if self.show_summary:
            records = self._earlier + self._records
            print_summary(self.run_dir, records, self.cfg.train.steps)
        if not done:
            print(f"unbroken: the run did not finish; see {self.run_dir / 'logs'}", file=sys.stderr)
            for wid in sorted(self.workers):
                tail = _tail(self.run_dir / "logs" / f"worker-{wid}.log", 3)
                if tail:
                    print(f"  worker {wid}: {tail}", file=sys.stderr)
            return 1
        return 0

    def _final_checkpoint_problem(self) -> str:
        """What is wrong with the final checkpoint a finished run must leave (empty when it verifies)."""
        final = next(r for r in reversed(self._records) if r.get("type") == RecordKind.FINAL)
        try:
            ckptfiles.verify_files(self.run_dir, int(final["step"]))
        except ValueError as e:
            return f"its final checkpoint (step {final['step']}) does not verify: {e}"
        leftovers = ckptfiles.leftovers(self.run_dir)
        if leftovers:
            return f"{len(leftovers)} temporary checkpoint files were left behind ({leftovers[0].name})"
        return ""


def _tail(path: Path, lines: int) -> str:
    if not path.exists():
        return ""
    return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
