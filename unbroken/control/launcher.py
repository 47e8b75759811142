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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.control.gateway import TOKEN_ENV, new_token, token_from_env
from unbroken.control.progress import ProgressView, print_summary
from unbroken.control.store import bind_listen_socket, connect_store, publish_record, ring
from unbroken.core.config import RunConfig, dump_config, replace
from unbroken.core.failures import FATAL_KINDS, FailureKind, build_schedule, parse_event
from unbroken.ft import checkpoint as ckpt

POLL_S = 0.005
# The main loop's period without injections (progress updates); a process exit wakes it at once. The
# launcher shares the workers' cores: every wake-up is taken from training.
IDLE_WAIT_S = 0.25
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class LaunchPlan:
    """Everything validated: what to run, where, and the socket the coordinator will listen on."""

    cfg: RunConfig
    run_dir: Path
    workers: int
    resume: bool
    sock: socket.socket
    host: str = "127.0.0.1"


def default_run_dir(config_name: str) -> Path:
    return Path("runs") / f"{config_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def validate_vocab(cfg: RunConfig) -> None:
    """Vocabulary mismatch between the tokenizer and ``model.vocab_size``, checked before any work."""
    if cfg.model.vocab_size == 0:
        return
    if cfg.data.tokenizer:
        from unbroken.train.data import load_tokenizer

        vocab = load_tokenizer(cfg.data.tokenizer).get_vocab_size()
    else:
        vocab = cfg.data.vocab_size
    if cfg.model.vocab_size < vocab:
        raise ValueError(
            f"vocabulary mismatch: the tokenizer has {vocab} tokens but model.vocab_size = "
            f"{cfg.model.vocab_size}; set model.vocab_size = 0 (from the tokenizer) or >= {vocab}"
        )


def check_resumable(cfg: RunConfig, run_dir: Path, corpus: Any) -> None:
    """ValueError (one line) unless RUN_DIR has a checkpoint that verifies and fits this model and data."""
    import hashlib

    import torch

    from unbroken.train.model import Transformer, model_args

    loaded = ckpt.load_latest(run_dir, log_rejections=False)  # the workers report rejections in the metrics
    if loaded is None:
        rejected = ckpt.list_checkpoints(run_dir)
        if not rejected:
            raise ValueError(
                f"--resume {run_dir}: no checkpoint in {ckpt.checkpoint_dir(run_dir)} "
                "(the run stopped before its first one); start the run again"
            )
        raise ValueError(
            f"--resume {run_dir}: none of the {len(rejected)} checkpoints is usable "
            f"(newest: step {rejected[0]} is damaged or incomplete); the files are left as they are"
        )
    args = model_args(
        cfg.model.flavour,
        vocab_size=cfg.model.vocab_size or corpus.vocab_size,
        n_kv_heads=cfg.model.n_kv_heads,
        max_seq_len=cfg.data.seq_len,
    )
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    model_state = loaded.state.get("model")
    found = {k: tuple(v.shape) for k, v in model_state.items()} if isinstance(model_state, dict) else {}
    if found != expected:
        diff = sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
        first = diff[0] if diff else "model"
        raise ValueError(
            f"--resume {run_dir}: checkpoint step {loaded.step} is for a different model shape "
            f"({first}: checkpoint {found.get(first)}, config {expected.get(first)}); resume with the run's own config"
        )
    saved_sha = loaded.state.get("tokenizer_sha256")
    if saved_sha is not None:
        sha = hashlib.sha256(Path(corpus.tokenizer_path).read_bytes()).hexdigest()
        if sha != saved_sha:
            raise ValueError(
                f"--resume {run_dir}: checkpoint step {loaded.step} was trained with another tokenizer "
                f"(sha256 {saved_sha[:12]}, the data now uses {sha[:12]}); resume with the run's own data settings"
            )


def plan_launch(cfg: RunConfig, run_dir: Path, workers: int, resume: bool, host: str, port: int) -> LaunchPlan:
    """Validate the launch; raises ValueError (one line) and writes nothing if anything is wrong."""
    if workers < 1:
        raise ValueError(f"--workers = {workers} must be >= 1")
    if resume:
        if not (run_dir / "config.toml").is_file():
            raise ValueError(f"--resume {run_dir}: not a run directory (no config.toml)")
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(f"output directory {run_dir} exists and is not empty; choose another or use --resume")
    validate_vocab(cfg)
    f = cfg.failures
    schedule = build_schedule(
        f.schedule, f.mttr_s, f.mtbf_s, f.seed, f.step_time_s, workers, cfg.train.steps, f.scenario, f.scenario_hours
    )
    if f.mtbf_s > 0 or f.mttr_s > 0 or f.scenario:
        # The resolved config names every event, so the run (and its workers) see exactly what is injected.
        cfg = replace(cfg, failures=replace(f, schedule=schedule.describe(), mtbf_s=0.0, mttr_s=0.0, scenario=""))
    sock = bind_listen_socket(host, port)
    try:
        from unbroken.train.data import check_vocab, prepare_corpus

        corpus = prepare_corpus(cfg.data)  # ValueError on bad data, before the run directory exists
        check_vocab(corpus, cfg.model.vocab_size)
        if resume:
            check_resumable(cfg, run_dir, corpus)
    except BaseException:
        sock.close()
        raise
    return LaunchPlan(cfg, run_dir, workers, resume, sock, host)


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
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", TOKEN_ENV: self.token}
        self.last_event: dict[int, Any] = {}  # the latest event injected into each worker
        self.pauses: dict[int, float] = {}  # paused workers and when to SIGCONT them

    # -- processes ----------------------------------------------------------------------------------
    def _python(self) -> list[str]:
        return [sys.executable, "-m", "unbroken"]

    def start_coordinator(self) -> None:
        logs = self.run_dir / "logs"
        fd = self.sock.fileno()
        cmd = [
            *self._python(),
            "coordinator",
            "--listen-fd",
            str(fd),
            "--run-dir",
            str(self.run_dir),
            "--workers",
            str(len(self.alive_ids())),
            "--parent-pid",
            str(os.getpid()),
            "--address-file",
            str(self.run_dir / "coordinator.json"),
        ]
        if self.resume:
            cmd.append("--resume")
        (self.run_dir / "coordinator.json").unlink(missing_ok=True)  # a previous run's address
        with open(logs / "coordinator.log", "ab") as out:
            self.coordinator = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=(fd,),
                start_new_session=True,
                env=self.env,
            )
        self.sock.close()  # the coordinator holds its own copy of the listening socket
        address_file = self.run_dir / "coordinator.json"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not address_file.exists():
            if self.coordinator.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not start; see {logs / 'coordinator.log'}")
            time.sleep(POLL_S)
        self.address = json.loads(address_file.read_text())["address"]
        self.store = connect_store(self.address, token=self.token)
        for event in self.fired:
            self.store.set(f"fired/{event}", "1")

    def start_worker(self, worker_id: int) -> None:
        log_path = self.run_dir / "logs" / f"worker-{worker_id}.log"
        env = {**self.env, "UNBROKEN_LOCAL_WORKERS": str(self.plan.workers)}
        with open(log_path, "ab") as out:
            self.workers[worker_id] = subprocess.Popen(
                [*self._python(), "worker", "--coordinator", self.address, "--worker-id", str(worker_id)],
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
            key = f"inject/{wid}"
            try:
                if not self.store.check([key]):
                    continue
                info = json.loads(self.store.get(key))
                event = parse_event(info["event"])
                now = time.time()
                if event.kind in FATAL_KINDS and not self._other_members_alive(wid):
                    # A cluster never loses its last copy of the state to a scheduled failure (the paper's
                    # 32 ranks never all fail); random schedules plan in expected time and can overlap.
                    self.store.set(f"fired/{info['event']}", "1")
                    self.store.set(f"skip/{wid}", "1")
                    self.store.delete_key(key)
                    why = "no other member of the group is alive: it would lose the training state"
                    record = {"type": "injection_skipped", "worker": wid, "event": info["event"], "why": why}
                    publish_record(self.store, {**record, "time": now})
                    continue
                self.store.delete_key(key)
                self.store.set(f"injected/{wid}", json.dumps({"event": info["event"], "time": now}))
                self.store.set(f"fired/{info['event']}", "1")
                self.fired.add(info["event"])
                record = {"type": "injected", "worker": wid, "event": info["event"], "kind": str(event.kind)}
                publish_record(self.store, {**record, "time": now})
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
                "event": event,
                "at": time.monotonic(),
                "hung": event.kind is FailureKind.HANG,
                "seen": len(self._records),
            }

    def _other_members_alive(self, wid: int) -> bool:
        """Whether a member of the newest epoch other than ``wid`` is alive (not killed, paused or exited)."""
        assert self.store is not None
        members = json.loads(self.store.get(f"epoch/{int(self.store.get('epoch'))}"))["members"]
        return any(
            w != wid and w not in self.down and w not in self.pauses and self.workers[w].poll() is None for w in members
        )

    def _manage_down(self) -> None:
        """Continue paused workers; kill hung workers once the coordinator excluded them; restart downed
        workers after their MTTR (a worker that left after a pause or a cut is down from its exit on)."""
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
                if event.rejoin_after_s is not None and event.kind in (FailureKind.PAUSE, FailureKind.CUT):
                    self.down[wid] = {"event": event, "at": now, "hung": False, "seen": len(self._records)}
        for wid, info in list(self.down.items()):
            proc = self.workers[wid]
            if info["hung"] and proc.poll() is None:
                later = self._records[info["seen"] :]
                if any(r.get("type") == "failure" and r.get("worker") == wid for r in later):
                    proc.kill()
                    proc.wait()
                    self.reported.add(wid)  # already excluded; its exit is not news
                continue
            rejoin = info["event"].rejoin_after_s
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
                self._store_set(f"dead/{wid}", "killed by SIGKILL" if code == -9 else f"exited with status {code}")

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
        self._store_set("stop", reason)
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
        records = []
        for line in complete.splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # blank, or torn when the coordinator was killed mid-write
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
            ckpt.clean_partial(self.run_dir)  # temporary files of saves that were killed half-way
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
        record = {
            "type": "restart",
            "workers": self.alive_ids(),
            "time": time.time(),
            "stop_and_relaunch_s": time.monotonic() - t0,
        }
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        progress.note(f"restart: relaunched workers {self.alive_ids()} from the last checkpoint")

    def _needs_restart(self) -> bool:
        if self.cfg.recovery.policy != "restart":
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


def _tail(path: Path, lines: int) -> str:
    if not path.exists():
        return ""
    return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
