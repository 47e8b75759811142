"""The single-machine launcher behind ``unbroken train``: one coordinator process and N worker processes.

Owns process lifetimes on this host: it validates everything before writing anything, prepares the run
directory, starts the coordinator (handing it the listening socket it bound, so a port in use is an
error before anything starts) and the workers, reports each worker's exit to the coordinator (the
fastest failure detector there is), shows progress from ``metrics.jsonl``, and on Ctrl-C stops every
process it started. Checkpoints are written atomically by the workers, so an interrupted run keeps its
last good checkpoint.

The job's secret token (``UNBROKEN_TOKEN``, generated here unless the environment already has one) goes
to the coordinator and the workers through their environment; every store connection is authenticated
with it (``gateway``). If the coordinator dies, the workers checkpoint the last committed step and exit;
the launcher then exits non-zero with a one-line hint naming ``--resume``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.control import keys
from unbroken.control.client import COORDINATOR_ENV, LOCAL_WORKERS_ENV, WORKER_ID_ENV
from unbroken.control.coordinator import spawn_coordinator
from unbroken.control.gateway import TOKEN_ENV, new_token, token_from_env
from unbroken.control.progress import ProgressView, print_summary
from unbroken.control.store import bind_listen_socket, connect_store, publish_record, ring
from unbroken.core import ckptfiles
from unbroken.core.config import RecoveryPolicy, RunConfig, dump_config, replace
from unbroken.core.failures import FATAL_KINDS, FailureKind, build_schedule, parse_event
from unbroken.core.records import RecordKind, append_records, decode, make

POLL_S = 0.005
# The main loop's period without injections (progress updates); a process exit wakes it at once. The
# launcher shares the workers' cores: every wake-up is taken from training.
IDLE_WAIT_S = 0.25
STOP_GRACE_S = 10.0
TRAINER = (sys.executable, "-m", "unbroken.train")  # the built-in trainer's worker


@dataclass(frozen=True)
class LaunchPlan:
    """Everything validated: what to run, where, and the socket the coordinator will listen on."""

    cfg: RunConfig
    run_dir: Path
    workers: int
    resume: bool
    sock: socket.socket
    command: tuple[str, ...]  # what each worker runs: the trainer, or a user's script and its arguments
    host: str = "127.0.0.1"
    restart_after_s: float = 0.0  # restart a worker that died (scheduled or not) after this long; 0 = never


def default_run_dir(config_name: str) -> Path:
    return Path("runs") / f"{config_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def plan_launch(
    cfg: RunConfig,
    run_dir: Path,
    workers: int,
    resume: bool,
    host: str,
    port: int,
    command: tuple[str, ...] = TRAINER,
    validate: Callable[[RunConfig, Path, bool], None] | None = None,
) -> LaunchPlan:
    """Validate the launch (``validate`` checks what the workers will run: the trainer's data and model);
    raises ValueError (one line) and writes nothing if anything is wrong."""
    if workers < 1:
        raise ValueError(f"--workers = {workers} must be >= 1")
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
            validate(cfg, run_dir, resume)  # ValueError on bad data or checkpoints, before anything is written
    except BaseException:
        sock.close()
        raise
    return LaunchPlan(cfg, run_dir, workers, resume, sock, tuple(command), host, f.mttr_s)


class Launcher:
    """Runs a validated ``LaunchPlan`` to the end; ``run()`` returns the process exit status."""

    def __init__(self, plan: LaunchPlan, show_progress: bool = True, show_summary: bool = True) -> None:
        self.plan = plan
        self.cfg = plan.cfg
        self.run_dir = plan.run_dir
        self.show_progress = show_progress
        self.show_summary = show_summary
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self.reported: set[int] = set()
        self.interrupted = False
        self.address = ""
        self.store: Any = None
        self._metrics_offset = 0
        self._records: list[dict[str, Any]] = []
        self._failures_seen = 0  # failure records among _records (counted as they arrive)
        self._final_seen = False
        self.down: dict[int, dict[str, Any]] = {}  # workers we killed or stopped, and when they come back
        self.failures_handled = 0  # restart policy: failure records already acted on
        self.fired: set[str] = set()  # injected events (each fires once, across restarts too)
        self.restarts = 0
        self.sock = plan.sock
        self.resume = plan.resume
        self.token = token_from_env() or new_token()
        # c10d logs a C++ stack trace for every bounded store wait that times out: keep its errors only.
        self.env = {"TORCH_CPP_LOG_LEVEL": "ERROR", **os.environ, "PYTHONUNBUFFERED": "1", TOKEN_ENV: self.token}
        self.last_event: dict[int, Any] = {}  # the latest event injected into each worker
        self.pauses: dict[int, float] = {}  # paused workers and when to SIGCONT them

    # -- processes ----------------------------------------------------------------------------------
    def _python(self) -> list[str]:
        return [sys.executable, "-m", "unbroken"]

    def start_coordinator(self) -> None:
        self.coordinator, self.address = spawn_coordinator(
            self.sock, self.run_dir, len(self.alive_ids()), self.resume, self.env
        )
        self.store = connect_store(self.address, token=self.token)
        for event in self.fired:
            self.store.set(keys.fired(event), "1")

    def start_worker(self, worker_id: int) -> None:
        log_path = self.run_dir / "logs" / f"worker-{worker_id}.log"
        env = {
            **self.env,
            COORDINATOR_ENV: self.address,
            WORKER_ID_ENV: str(worker_id),
            LOCAL_WORKERS_ENV: str(self.plan.workers),
        }
        with open(log_path, "ab") as out:
            self.workers[worker_id] = subprocess.Popen(
                list(self.plan.command),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        self.reported.discard(worker_id)

    def alive_ids(self) -> list[int]:
        return [w for w in range(self.plan.workers) if w not in self.down]

    def _deliver_injections(self) -> None:
        """A worker that reached a scheduled failure point waits there; deliver the real signal now."""
        if not self.cfg.failures.schedule or not self._coordinator_up() or self._finished():
            return
        for wid, proc in self.workers.items():
            if proc.poll() is not None or wid in self.down or wid in self.pauses:
                continue
            key = keys.inject(wid)
            try:
                if not self.store.check([key]):
                    continue
                info = json.loads(self.store.get(key))
                event = parse_event(info["event"])
                now = time.time()
                if event.kind in FATAL_KINDS and not self._other_members_alive(wid):
                    # A cluster never loses its last copy of the state to a scheduled failure (the paper's
                    # 32 ranks never all fail); random schedules plan in expected time and can overlap.
                    self.store.set(keys.fired(info["event"]), "1")
                    self.store.set(keys.skip(wid), "1")
                    self.store.delete_key(key)
                    why = "no other member of the group is alive: it would lose the training state"
                    record = make(RecordKind.INJECTION_SKIPPED, now, worker=wid, event=info["event"], why=why)
                    publish_record(self.store, record)
                    continue
                self.store.delete_key(key)
                self.store.set(keys.injected(wid), json.dumps({"event": info["event"], "time": now}))
                self.store.set(keys.fired(info["event"]), "1")
                self.fired.add(info["event"])
                record = make(RecordKind.INJECTED, now, worker=wid, event=info["event"], kind=str(event.kind))
                publish_record(self.store, record)
            except RuntimeError:
                self.store = None  # the coordinator is shutting down: stop asking (each failed call logs a trace)
                return
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
                "seen": len(self._records),
            }

    def _other_members_alive(self, wid: int) -> bool:
        """Whether a member of the newest epoch other than ``wid`` is alive (not killed, paused or exited)."""
        assert self.store is not None
        members = json.loads(self.store.get(keys.epoch(int(self.store.get(keys.EPOCH)))))["members"]
        return any(
            w != wid and w not in self.down and w not in self.pauses and self.workers[w].poll() is None for w in members
        )

    def _manage_down(self) -> None:
        """Continue paused workers; kill hung workers once the coordinator excluded them; restart downed
        workers after their MTTR (a worker that left after a pause or a cut is down from its exit on, and so
        is one that died without a scheduled event, e.g. killed from outside, when ``restart_after_s`` is set)."""
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
                    self.down[wid] = {
                        "rejoin": event.rejoin_after_s,
                        "at": now,
                        "hung": False,
                        "seen": len(self._records),
                    }
        if self.plan.restart_after_s > 0 and not self._finished():
            for wid, proc in self.workers.items():
                if wid not in self.down and wid not in self.pauses and proc.poll() not in (None, 0):
                    # Died without a scheduled event (killed from outside, excluded after a stop): a cluster's
                    # scheduler would replace it.
                    self.last_event.pop(wid, None)
                    self.down[wid] = {
                        "rejoin": self.plan.restart_after_s,
                        "at": now,
                        "hung": False,
                        "seen": len(self._records),
                    }
        for wid, info in list(self.down.items()):
            proc = self.workers[wid]
            if info["hung"] and proc.poll() is None:
                later = self._records[info["seen"] :]
                if any(r.get("type") == "failure" and r.get("worker") == wid for r in later):
                    proc.kill()
                    proc.wait()
                    self.reported.add(wid)  # already excluded; its exit is not news
                continue
            rejoin = info["rejoin"]
            if rejoin is not None and proc.poll() is not None and now >= info["at"] + rejoin and self._coordinator_up():
                del self.down[wid]
                self.start_worker(wid)

    def _report_exits(self) -> None:
        if not self._coordinator_up() or self._finished():
            return  # nobody left to tell, or the workers are leaving because the run is over
        for wid, proc in self.workers.items():
            code = proc.poll()
            if code is not None and code != 0 and wid not in self.reported:  # 0: finished the run
                self.reported.add(wid)
                self._store_set(keys.dead(wid), "killed by SIGKILL" if code == -9 else f"exited with status {code}")

    def _nobody_left(self) -> bool:
        """No worker process runs and none is due to restart (e.g. every one failed before joining)."""
        restarts = any(info["rejoin"] is not None for info in self.down.values())
        return not self._finished() and not restarts and all(p.poll() is not None for p in self.workers.values())

    def _finished(self) -> bool:
        return self._final_seen

    def _coordinator_up(self) -> bool:
        return self.store is not None and self.coordinator is not None and self.coordinator.poll() is None

    def _store_set(self, key: str, value: str) -> None:
        if not self._coordinator_up():
            return
        try:
            self.store.set(key, value)
            ring(self.store)
        except RuntimeError:
            self.store = None  # the coordinator is gone; nothing left to tell

    def stop_all(self, reason: str) -> None:
        """Ask everyone to stop, wait a grace period, then kill what is left."""
        self._store_set(keys.STOP, reason)
        for info in self.down.values():
            info["hung"] = False  # a stopped process is killed below like the rest
        deadline = time.monotonic() + STOP_GRACE_S
        procs = [*self.workers.values(), *([self.coordinator] if self.coordinator else [])]
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(POLL_S)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

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
        records = [r for r in map(decode, complete.splitlines()) if r is not None]  # torn lines are skipped
        self._records += records
        self._failures_seen += sum(1 for r in records if r.get("type") == "failure")
        self._final_seen = self._final_seen or any(r.get("type") == "final" for r in records)
        return records

    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        if not self.plan.resume:
            dump_config(self.cfg, self.run_dir)
        else:
            ckptfiles.clean_partial(self.run_dir)  # temporary files of saves that were killed half-way
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        started = time.monotonic()
        try:
            self.start_coordinator()
            for wid in range(self.plan.workers):
                self.start_worker(wid)
            with ProgressView(self.cfg.train.steps, self.show_progress) as progress:
                while True:
                    for record in self._new_records():
                        progress.update(record)
                    self._deliver_injections()
                    self._report_exits()
                    self._manage_down()
                    if self._needs_restart():
                        self._restart_job(progress)
                        continue
                    if self.interrupted:
                        progress.note("interrupted: stopping every process (the last checkpoint is kept)")
                        self.stop_all("interrupted by the user (Ctrl-C)")
                        self._new_records()
                        return 130
                    assert self.coordinator is not None
                    if self.coordinator.poll() is not None:
                        break
                    if self._nobody_left():
                        self.stop_all("every worker exited and none is due to restart")
                        break
                    # Injections need a prompt answer (the worker waits at its phase to be signalled).
                    self._wait_for_exit(POLL_S if self.cfg.failures.schedule else IDLE_WAIT_S)
                for record in self._new_records():
                    progress.update(record)
            return self._finish(time.monotonic() - started)
        finally:
            signal.signal(signal.SIGINT, previous)
            for p in [*self.workers.values(), *([self.coordinator] if self.coordinator else [])]:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def _restart_job(self, progress: ProgressView) -> None:
        """The ``restart`` baseline: stop every process, then start a new coordinator and the survivors
        from the last checkpoint (what checkpoint-and-restart systems do)."""
        t0 = time.monotonic()
        self.stop_all("restarting after a failure (restart policy)")
        self._new_records()
        self.failures_handled = self._failures_seen
        self.restarts += 1
        self.sock = bind_listen_socket(self.plan.host, 0)
        self.resume = True
        self.reported = set(self.down)
        self.start_coordinator()
        for wid in self.alive_ids():
            self.start_worker(wid)
        record = make(
            RecordKind.RESTART, time.time(), workers=self.alive_ids(), stop_and_relaunch_s=time.monotonic() - t0
        )
        append_records(self.run_dir, [record])
        progress.note(f"restart: relaunched workers {self.alive_ids()} from the last checkpoint")

    def _needs_restart(self) -> bool:
        if self.cfg.recovery.policy is not RecoveryPolicy.RESTART:
            return False
        exited = any(p.poll() not in (None, 0) for w, p in self.workers.items() if w not in self.down)
        return self._failures_seen > self.failures_handled or exited

    def _wait_for_exit(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s``, waking as soon as a process we started exits (Linux pidfds; elsewhere
        a plain sleep). The workers share the machine's cores: a busy launcher would slow them down."""
        procs = [p for p in (*self.workers.values(), self.coordinator) if p is not None and p.returncode is None]
        fds: list[int] = []
        try:
            for p in procs:
                fds.append(os.pidfd_open(p.pid))
            select.select(fds, [], [], timeout_s)
        except (AttributeError, OSError):
            time.sleep(timeout_s)
        finally:
            for fd in fds:
                os.close(fd)

    def _on_sigint(self, _signum: int, _frame: object) -> None:
        self.interrupted = True

    def _finish(self, wall_s: float) -> int:
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in self.workers.values()):
            time.sleep(POLL_S)
        self._new_records()  # what the workers wrote themselves if the coordinator died
        done = self._finished()
        assert self.coordinator is not None
        died = self.coordinator.returncode is not None and self.coordinator.returncode < 0
        lost = [r for r in self._records if r.get("type") == "coordinator_lost"]
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
            print_summary(self.run_dir, self._records, wall_s, self.cfg.train.steps)
        if self.cfg.metrics.tensorboard:
            from unbroken.control.tensorboard import write_tensorboard

            write_tensorboard(self.run_dir, self._records)
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
            ckptfiles.read_verified(self.run_dir, int(final["step"]))
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
