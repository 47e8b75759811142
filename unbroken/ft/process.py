"""Process life of a worker: where its job is, how it registers, how the process is set up and how it ends.

Owns ``Job``: reading the environment a launcher, the per-host agent, torchrun or srun gives a worker
(``UNBROKEN_COORDINATOR``, ``UNBROKEN_TOKEN``, ``UNBROKEN_WORKER_ID`` or ``RANK`` / ``SLURM_PROCID``,
``UNBROKEN_LOCAL_WORKERS``), fetching the run's config from the coordinator, setting the process up
(intra-op threads, logging, host memory; its device, one GPU per worker by its index on the host, and the
NCCL environment), registering (which starts the heartbeats), and the end of the process: a worker that
must stop ends with ``os._exit`` so no C++ thread still blocked in a rendezvous can abort it on the way out
(what it says and saves first is ``leaving``'s). Without a coordinator in the environment, ``Job`` runs one
in this process (a job of one worker), which is what a plain ``python my_script.py`` gets.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from unbroken.control.member.client import (
    COORDINATOR_ENV,
    DEVICE_INDEX_ENV,
    LOCAL_WORKERS_ENV,
    RUN_DIR_ENV,
    SPARE_ENV,
    WORKER_ID_ENV,
    CoordinatorClient,
    addresses_of,
)
from unbroken.control.member.news import look, next_news
from unbroken.control.store import keys
from unbroken.control.store.connect import bind_listen_socket, publish_record, reach, report_error
from unbroken.control.store.gateway import TOKEN_ENV, TunnelError, new_token
from unbroken.control.store.netif import use_job_interface
from unbroken.core.config import (
    CoordinatorConfig,
    Reduction,
    RunConfig,
    config_changes,
    config_from_toml_text,
    deterministic_kernels,
    dump_config,
    dump_resumed_config,
    load_config,
    resume_config,
)
from unbroken.core.logs import init_logger
from unbroken.core.records import RecordKind, SpareState, WorkerError, make
from unbroken.ft import determinism
from unbroken.ft.checkpoint import schema as ckpt
from unbroken.ft.hostmem import retain_freed_memory
from unbroken.ft.stops import EXIT_STOPPED

log = logging.getLogger(__name__)


class WorkerLeft(SystemExit):
    """Raised instead of ending the process when ``Job.exit_process`` is off (threads as workers in tests)."""


# How long a worker starting up tries again to reach a coordinator the network does not let it reach (a link down
# or flapping; not one where nothing listens): the default coordinator.hold_s, as the config is not known yet.
REACH_PATIENCE_S = CoordinatorConfig().hold_s
SPARE_WAIT_S = 0.5  # a warm spare's bounded wait for its promotion, between looks at whether the run is over
LOCAL_RANK_ENVS = ("LOCAL_RANK", "SLURM_LOCALID")  # a worker's index on its host, as torchrun and srun give it
# How many workers share the host, as our launcher / agent, torchrun and srun say it.
LOCAL_COUNT_ENVS = (LOCAL_WORKERS_ENV, "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")

# The NCCL watchdog must not end a survivor whose peer died, and waits must be polled (docs/gpu.md, 4.3): set
# before the first NCCL group is made (its constructor reads them), overriding the user's values with a warning.
NCCL_REQUIRED = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # CleanUpOnly: abort the communicators and fail the work, keep the process
    "TORCH_NCCL_BLOCKING_WAIT": "0",  # work.wait() never blocks the training thread (comm.wait_all polls)
    "TORCH_NCCL_ENABLE_MONITORING": "0",  # no heartbeat monitor killing the process; comm bounds abort() itself
}
NCCL_DEFAULTS = {  # the user may choose otherwise (e.g. the flight recorder while debugging)
    "TORCH_NCCL_PROPAGATE_ERROR": "0",  # membership is the coordinator's business
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}


def default_backend(requested: str, device: torch.device, workers_per_gpu: int = 1) -> str:
    """``auto`` -> ``nccl`` for a worker on a CUDA device of its own, else ``gloo`` (NCCL refuses two ranks on
    one GPU: ``train.workers_per_gpu`` > 1 shares one)."""
    if requested == "auto":
        return "nccl" if device.type == "cuda" and workers_per_gpu == 1 else "gloo"
    return requested


def local_index(worker_id: int | None) -> int:
    """This worker's index among the workers of its host: ``LOCAL_RANK`` (torchrun) or ``SLURM_LOCALID``
    (srun), else its worker id modulo ``UNBROKEN_LOCAL_WORKERS`` (the launcher and the agents give a host's
    workers consecutive ids, ``node_rank * K`` to ``node_rank * K + K - 1``); a warm spare's is the one its
    agent gave it (``UNBROKEN_DEVICE_INDEX``).

    Raises:
        ValueError: none of these tells it (a worker whose id the coordinator will choose, several per host).
    """
    for name in (DEVICE_INDEX_ENV, *LOCAL_RANK_ENVS):
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    local = local_workers()
    if worker_id is not None:
        return worker_id % local
    if local == 1:
        return 0
    raise ValueError(
        f"cannot tell which GPU this worker uses ({local} workers on this host, no worker id yet): set LOCAL_RANK "
        f"or {WORKER_ID_ENV}"
    )


def local_workers() -> int:
    """How many workers share this host: ``UNBROKEN_LOCAL_WORKERS`` (our launcher and agents),
    ``LOCAL_WORLD_SIZE`` (torchrun) or ``SLURM_NTASKS_PER_NODE`` (srun; ``4(x2)`` reads as 4); else 1."""
    for name in LOCAL_COUNT_ENVS:
        digits = os.environ.get(name, "").strip().split("(")[0]
        if digits.isdigit() and int(digits) > 0:
            return int(digits)
    return 1


def intra_op_threads(cfg: RunConfig) -> int:
    """The torch intra-op threads of a worker: ``train.threads``; else ``OMP_NUM_THREADS`` when the launcher or
    the user set it (torchrun does); else 1 under exact mode, so that a worker's kernels (a parallel reduction
    splits its sum by the thread count) are the same whatever the number of workers on the host and exact mode's
    "N workers train bit for bit what one trains" holds by default; else the host's cores over its workers."""
    if cfg.train.threads:
        return cfg.train.threads
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    if cfg.recovery.reduction is Reduction.EXACT:
        return 1
    return max(1, (os.cpu_count() or 1) // local_workers())


def check_device(requested: str, backend: str) -> str:
    """The device type (``cpu`` or ``cuda``) a worker on this host gets for ``requested`` (``train.device``);
    ValueError (one line) unless it can run with ``backend`` (``comm.backend``)."""
    cuda = requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"train.device = cuda but this host has no CUDA GPU (torch {torch.__version__} sees none); "
            "use train.device = cpu or auto"
        )
    if backend == "nccl" and not cuda:
        raise ValueError("comm.backend = nccl needs train.device = cuda (NCCL reduces GPU tensors); use gloo or auto")
    return "cuda" if cuda else "cpu"


def check_host_devices(cfg: RunConfig, workers: int, spares: int = 0) -> None:
    """ValueError (one line) unless ``workers`` workers and ``spares`` warm spares of this host can each have a
    device: on CUDA at most ``train.workers_per_gpu`` per GPU (checked at launch, before anything starts)."""
    tc = cfg.train
    if check_device(str(tc.device), str(cfg.comm.backend)) != "cuda":
        return
    count = torch.cuda.device_count()
    if workers + spares > count * tc.workers_per_gpu:
        with_spares = f" and --spares = {spares}" if spares else ""
        raise ValueError(
            f"--workers = {workers}{with_spares} on a host with {count} GPU{'s' if count != 1 else ''} and "
            f"train.workers_per_gpu = {tc.workers_per_gpu}: at most {count * tc.workers_per_gpu} processes here "
            "(a spare holds a device of its own); raise train.workers_per_gpu (gloo) or start fewer"
        )


def worker_device(requested: str, backend: str, worker_id: int | None, workers_per_gpu: int = 1) -> torch.device:
    """The device a worker trains on: the CPU, or for ``cuda`` (``auto`` with a CUDA GPU) the GPU of its index
    on the host (``local_index``): one worker per GPU, or ``workers_per_gpu`` consecutive workers on each.

    Raises:
        ValueError: ``check_device`` fails, or the index has no GPU (more workers than GPUs on the host).
    """
    check_device(requested, backend)
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    index, count = local_index(worker_id), torch.cuda.device_count()
    if index // workers_per_gpu >= count:
        share = f"{workers_per_gpu} workers per GPU" if workers_per_gpu > 1 else "one worker per GPU"
        raise ValueError(
            f"this worker is number {index} on its host, which has {count} GPU{'s' if count != 1 else ''}: run at "
            f"most {count * workers_per_gpu} workers here ({share}; train.workers_per_gpu shares a GPU)"
        )
    return torch.device("cuda", index // workers_per_gpu)


def set_nccl_environment(timeout_s: float) -> None:
    """The NCCL variables of ``NCCL_REQUIRED`` and ``NCCL_DEFAULTS`` (docs/gpu.md, 4.3), and the bound on a
    non-blocking communicator's creation, ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` (default: ``timeout_s``, the
    collectives' bound): call it before the first NCCL group is made."""
    for name, value in NCCL_REQUIRED.items():
        if os.environ.get(name, value) != value:
            log.warning("%s=%s replaced by %s: unbroken handles NCCL errors itself", name, os.environ[name], value)
        os.environ[name] = value
    for name, value in {**NCCL_DEFAULTS, "TORCH_NCCL_NONBLOCKING_TIMEOUT": str(max(1, round(timeout_s)))}.items():
        os.environ.setdefault(name, value)


def _spare_from_env() -> int | None:
    value = os.environ.get(SPARE_ENV, "").strip()
    return int(value) if value.isdigit() else None


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
    spare: int | None = None  # a warm spare's index (``SPARE_ENV``): its worker id comes with its promotion
    _probe: Any = field(default=None, repr=False)
    _device: torch.device | None = field(default=None, repr=False)

    @property
    def device(self) -> torch.device:
        """This worker's device (``train.device``; ``worker_device``)."""
        if self._device is None:
            tc = self.config.train
            self._device = worker_device(
                str(tc.device), str(self.config.comm.backend), self.worker_id, tc.workers_per_gpu
            )
        return self._device

    @property
    def backend(self) -> str:
        return default_backend(str(self.config.comm.backend), self.device, self.config.train.workers_per_gpu)

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
                log.warning(
                    "ft.init(config=..., overrides=...) is ignored: the job's config comes from its coordinator "
                    "(give --section.key=value to the launcher, before SCRIPT.py)"
                )
            spare = _spare_from_env()
            worker_id = None if spare is not None else _worker_id_from_env()
            job = Job(address, token or os.environ[TOKEN_ENV], cfg, directory, worker_id, exit_process, spare=spare)
            job._probe = probe
        else:
            job = Job.standalone(config or RunConfig(), run_dir, exit_process)
        job.setup_process()
        return job

    @staticmethod
    def standalone(config: RunConfig, run_dir: Path | None, exit_process: bool = True) -> Job:
        """A job of one worker with its own coordinator (a child process that ends with this one):
        ``python my_script.py`` runs as ``unbroken launch --workers 1 my_script.py`` would."""
        from unbroken.control.coordinator.loop import spawn_coordinator

        if run_dir is None:
            script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "run"
            run_dir = Path(config.train.out_dir or f"runs/{script}-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.mkdir(parents=True, exist_ok=True)
        resume = (run_dir / "config.toml").is_file() and bool(ckpt.list_checkpoints(run_dir))
        if not resume:
            dump_config(config, run_dir)
        else:  # run again in its run directory: a resume, its config checked as ``unbroken launch --resume`` does
            stored = load_config(run_dir / "config.toml")
            where = f"{run_dir} (a script run again in its run directory resumes it; see unbroken launch --resume)"
            config = resume_config(stored, config, ckpt.list_checkpoints(run_dir)[0], False, where)
            if changes := config_changes(stored, config):
                dump_resumed_config(config, run_dir, changes)
        token = os.environ.get(TOKEN_ENV) or new_token()
        sock = bind_listen_socket("127.0.0.1", 0)
        proc, address = spawn_coordinator(sock, run_dir, 1, resume, {**os.environ, TOKEN_ENV: token})
        sock.close()  # the coordinator holds its own copy
        return Job(address, token, config, run_dir, 0, exit_process, local=proc)

    def setup_process(self) -> None:
        """Threads, logs and host memory of a training process (only from the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return
        init_logger(self._name())
        if self.exit_process:
            # The interpreter's last full collection at exit can run for many seconds in a worker that lived
            # through a coordinator's replacement (seen: > 10 s, past the agent's grace); the OS frees the
            # memory anyway, so the objects alive at exit are frozen out of it.
            atexit.register(gc.freeze)
        tc = self.config.train
        if tc.retain_host_memory:
            retain_freed_memory()
        torch.set_num_threads(intra_op_threads(self.config))
        determinism.apply(deterministic_kernels(self.config))  # before the first CUDA call (cuBLAS reads its env)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL, autocast and unqualified "cuda" tensors use this GPU
        if self.backend == "nccl":
            set_nccl_environment(self.config.comm.op_timeout_s)
        interface = use_job_interface(self.address)  # before the first gloo group: peers on other hosts reach it
        if interface is not None:
            log.info("gloo uses interface %s (the route to the coordinator)", interface)

    def _name(self) -> str:
        if self.worker_id is not None:
            return f"worker {self.worker_id}"
        return f"spare {self.spare}" if self.spare is not None else "worker ?"

    def register(self) -> CoordinatorClient:
        """Register with the coordinator (the heartbeats start): do it once the model is built, so a joiner
        never makes the others wait for it. A warm spare first waits, built, for the worker it replaces."""
        if self.spare is not None and self.worker_id is None:
            self.worker_id = self._await_promotion(self.spare)
            name_logs(self._name())
        comm = self.config.comm
        try:
            return CoordinatorClient(
                self.address,
                self.worker_id,
                comm.heartbeat_interval_s,
                comm.heartbeat_timeout_s,
                token=self.token,
                hold_s=self.config.coordinator.hold_s,
                fingerprint=determinism.local_fingerprint(self.device),
                spare=self.spare,
            )
        except (TunnelError, RuntimeError, OSError) as e:
            # The coordinator went away while this worker came up: the run finished (a restart too late to
            # rejoin), or the job is gone. One line, not a traceback.
            if self._run_done():
                log.info("the run finished before this worker could join; leaving")
                self.leave(0)
            log.error(
                "cannot join the job at %s: %s", self.address, str(e).splitlines()[0] if str(e) else type(e).__name__
            )
            self.leave(EXIT_STOPPED)
            raise AssertionError("leave() returned") from None  # pragma: no cover

    def _await_promotion(self, spare: int) -> int:
        """A warm spare, initialised: say so (a ``spare`` record), then wait outside the group until its agent
        gives it a dead worker's id (``keys.spare``); leave with 0 once the run is over or stopped, and with
        ``EXIT_STOPPED`` if the coordinator is gone."""
        try:
            store = self._store()
            ready = make(RecordKind.SPARE, time.time(), spare=spare, state=SpareState.READY, worker=-1, pid=os.getpid())
            publish_record(store, ready)
            log.info("spare %d ready: waiting for a worker to replace", spare)
            while True:
                try:  # the store answers the moment the key is set
                    store.wait([keys.spare(spare)], datetime.timedelta(seconds=SPARE_WAIT_S))
                except RuntimeError as e:
                    if "timeout" not in str(e).lower():
                        raise
                if store.check([keys.spare(spare)]):
                    worker = int(store.get(keys.spare(spare)))
                    log.info("spare %d takes the place of worker %d", spare, worker)
                    self._await_removal(store, worker)
                    return worker
                self._leave_if_over(store, f"the run is over: spare {spare} was not needed")
        except (TunnelError, RuntimeError, OSError) as e:
            log.error("spare %d lost the job: %s", spare, str(e).splitlines()[0] if str(e) else type(e).__name__)
            self.leave(EXIT_STOPPED)
            raise AssertionError("leave() returned") from None  # pragma: no cover

    def _await_removal(self, store: Any, worker: int) -> None:
        """Return once the newest epoch no longer has ``worker`` among its members. The agent promotes a spare as
        soon as it has reported the worker's death, and the coordinator gives a registration under a member's id
        another id; the wait ends at the ring of the epoch that removes it (``control.member.news.next_news``)."""
        news = look(store)
        while True:
            record = news.record
            if record is None and news.newest > 0:
                record = json.loads(store.get(keys.epoch(news.newest)))
            if record is None or worker not in record["members"]:
                return
            self._leave_if_over(store, f"the run is over before worker {worker}'s place was free")
            news = next_news(store, news, SPARE_WAIT_S)

    def _leave_if_over(self, store: Any, why: str) -> None:
        """Leave with 0 (the process ends) if the run finished or was stopped."""
        if store.check([keys.DONE]) or (store.check([keys.STOP]) and store.get(keys.STOP)):
            log.info("%s", why)
            self.leave(0)

    def _run_done(self) -> bool:
        """Whether the job's coordinator, if it still answers, says the run finished."""
        try:
            return bool(self._store().check([keys.DONE]))
        except (TunnelError, RuntimeError, OSError):
            return False

    def expected_workers(self) -> int:
        return int(self._store().get("expected"))

    def resume(self) -> bool:
        return self._store().get("resume") == b"1"

    def _store(self) -> Any:
        if self._probe is None:
            self._probe = _reach(addresses_of(self.address), self.token)
        return self._probe

    def connect(self) -> Any:
        """A new authenticated store connection to the job's coordinator (for a rendezvous of its own)."""
        return _reach(addresses_of(self.address), self.token)

    def report_error(self, error: WorkerError) -> bool:
        """Before this worker registered: tell the coordinator it dies of ``error``; False if nobody was told."""
        try:
            report_error(self._store(), error)
            return True
        except (TunnelError, RuntimeError, OSError):
            return False

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
    """A store connection to the first of ``addresses`` that answers (the leading coordinator); one the network
    does not reach is tried again for up to the default ``coordinator.hold_s`` (the config is not known yet)."""
    return reach(addresses, token, REACH_PATIENCE_S)[0]  # its tunnel lives as long as the store (GC)
