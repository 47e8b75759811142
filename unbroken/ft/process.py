"""Process life of a worker: where its job is, how it registers, how the process is set up and how it ends.

Owns ``Job``: reading the environment a launcher, the per-host agent, torchrun or srun gives a worker
(``UNBROKEN_COORDINATOR``, ``UNBROKEN_TOKEN``, ``UNBROKEN_WORKER_ID`` or ``RANK`` / ``SLURM_PROCID``,
``UNBROKEN_LOCAL_WORKERS``), fetching the run's config from the coordinator, setting the process up
(intra-op threads, logging, host memory), registering (which starts the heartbeats), and leaving: a
process that must stop ends with ``os._exit`` so no C++ thread still blocked in a rendezvous can abort it
on the way out. Without a coordinator in the environment, ``Job`` runs one in this process (a job of one
worker), which is what a plain ``python my_script.py`` gets.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from unbroken.control import keys
from unbroken.control.client import (
    COORDINATOR_ENV,
    LOCAL_WORKERS_ENV,
    RUN_DIR_ENV,
    WORKER_ID_ENV,
    CoordinatorClient,
    addresses_of,
)
from unbroken.control.gateway import TOKEN_ENV, TunnelError, new_token
from unbroken.control.store import bind_listen_socket, connect_store
from unbroken.core.config import RunConfig, config_from_toml_text, dump_config
from unbroken.core.logs import init_logger
from unbroken.ft import checkpoint as ckpt
from unbroken.ft.hostmem import retain_freed_memory
from unbroken.ft.protocol import EXIT_STOPPED

if TYPE_CHECKING:
    from unbroken.ft.protocol import StepProtocol

log = logging.getLogger(__name__)


class WorkerLeft(SystemExit):
    """Raised instead of ending the process when ``Job.exit_process`` is off (threads as workers in tests)."""


def default_backend(requested: str) -> str:
    """``auto`` -> ``nccl`` when CUDA is present, else ``gloo``."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return requested


def _worker_id_from_env() -> int | None:
    for name in (WORKER_ID_ENV, "RANK", "SLURM_PROCID"):
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


def name_logs(prefix: str) -> None:
    """Stamp this process's log lines with ``prefix`` (e.g. ``worker 3``) once its id is known."""
    if threading.current_thread() is threading.main_thread():
        init_logger(prefix)


@dataclass
class Job:
    """Where a worker's job is and how this process takes part in it."""

    address: str
    token: str
    config: RunConfig
    run_dir: Path
    worker_id: int | None
    exit_process: bool = True
    local: Any = None  # the in-process coordinator of a job of one worker
    _probe: Any = field(default=None, repr=False)

    @property
    def backend(self) -> str:
        return default_backend(str(self.config.comm.backend))

    @staticmethod
    def from_environment(config: RunConfig | None, run_dir: Path | None, exit_process: bool = True) -> Job:
        address = os.environ.get(COORDINATOR_ENV)
        if address:
            token = os.environ.get(TOKEN_ENV, "")
            try:
                probe = _reach(addresses_of(address), token or None)
                cfg = config_from_toml_text(probe.get(keys.CONFIG).decode())
                directory = Path(os.environ.get(RUN_DIR_ENV) or probe.get(keys.RUN_DIR).decode())
            except (TunnelError, RuntimeError, OSError, ValueError) as e:
                init_logger("worker ?")
                log.error(
                    "cannot join the job at %s: %s", address, str(e).splitlines()[0] if str(e) else type(e).__name__
                )
                raise SystemExit(EXIT_STOPPED) from None
            if config is not None:
                log.warning("ft.init(config=...) is ignored: the job's config comes from its coordinator")
            job = Job(address, token or os.environ[TOKEN_ENV], cfg, directory, _worker_id_from_env(), exit_process)
            job._probe = probe
        else:
            job = Job.standalone(config or RunConfig(), run_dir, exit_process)
        job.setup_process()
        return job

    @staticmethod
    def standalone(config: RunConfig, run_dir: Path | None, exit_process: bool = True) -> Job:
        """A job of one worker with its own coordinator (a child process that ends with this one):
        ``python my_script.py`` runs as ``unbroken launch --workers 1 my_script.py`` would."""
        from unbroken.control.coordinator import spawn_coordinator

        if run_dir is None:
            script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "run"
            run_dir = Path(config.train.out_dir or f"runs/{script}-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.mkdir(parents=True, exist_ok=True)
        resume = (run_dir / "config.toml").is_file() and bool(ckpt.list_checkpoints(run_dir))
        if not resume:
            dump_config(config, run_dir)
        token = os.environ.get(TOKEN_ENV) or new_token()
        sock = bind_listen_socket("127.0.0.1", 0)
        proc, address = spawn_coordinator(sock, run_dir, 1, resume, {**os.environ, TOKEN_ENV: token})
        sock.close()  # the coordinator holds its own copy
        return Job(address, token, config, run_dir, 0, exit_process, local=proc)

    def setup_process(self) -> None:
        """Threads, logs and host memory of a training process (only from the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return
        init_logger(f"worker {self.worker_id if self.worker_id is not None else '?'}")
        tc = self.config.train
        if tc.retain_host_memory:
            retain_freed_memory()
        local = int(os.environ.get(LOCAL_WORKERS_ENV, "1"))
        torch.set_num_threads(tc.threads or max(1, (os.cpu_count() or 1) // max(1, local)))

    def register(self) -> CoordinatorClient:
        """Register with the coordinator (the heartbeats start): do it once the model is built, so a joiner
        never makes the others wait for it."""
        comm = self.config.comm
        return CoordinatorClient(
            self.address,
            self.worker_id,
            comm.heartbeat_interval_s,
            comm.heartbeat_timeout_s,
            token=self.token,
            hold_s=self.config.coordinator.hold_s,
        )

    def expected_workers(self) -> int:
        return int(self._store().get("expected"))

    def resume(self) -> bool:
        return self._store().get("resume") == b"1"

    def _store(self) -> Any:
        if self._probe is None:
            self._probe = _reach(addresses_of(self.address), self.token)
        return self._probe

    def leave(self, code: int) -> None:
        """End this worker with ``code``: the process (flushing logs first), or the thread in tests."""
        if not self.exit_process:
            raise WorkerLeft(code)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def close(self) -> None:
        if self.local is not None:
            proc, self.local = self.local, None
            try:
                proc.wait(timeout=10.0)  # it ends once the run is done (or stopped)
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait()


def _reach(addresses: list[str], token: str | None) -> Any:
    """A store connection to the first of ``addresses`` that answers (the leading coordinator)."""
    last: Exception | None = None
    for address in addresses:
        try:
            return connect_store(address, token=token)
        except (TunnelError, RuntimeError, OSError) as e:
            last = e
    assert last is not None
    raise last


def stop_without_coordinator(proto: StepProtocol | None, run_dir: Path) -> str:
    """The coordinator is gone: no membership can change any more, so the job stops. The leader of this
    worker's group checkpoints the last committed state (every member holds it, bitwise) and writes the
    metrics records the coordinator did not drain. Returns the line to log."""
    hint = f"continue with: unbroken train --resume {run_dir}"
    if proto is None or proto.group is None or not proto.leader or proto.state.step <= 0:
        return f"the coordinator is gone; stopping (the leader checkpoints the last committed step); {hint}"
    step = proto.state.step
    saved = ckpt.list_checkpoints(run_dir)
    if saved and saved[0] >= step:
        path = ckpt.checkpoint_path(run_dir, saved[0])
    else:
        path = ckpt.save_checkpoint(run_dir, step, proto.state.snapshot(), proto.cfg.checkpoint_keep)
    proto.append_undrained({"type": "coordinator_lost", "step": step, "path": str(path), "time": time.time()})
    return f"the coordinator is gone; saved the state of step {step} ({path}); {hint}"
