"""Helpers shared by the tests that launch real training jobs (``unbroken train`` as a subprocess)."""

from __future__ import annotations

import array
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from unbroken.control.netif import free_port  # noqa: F401 - the tests take it from here
from unbroken.control.zygote import worker_of
from unbroken.core.records import read_records
from unbroken.ft import checkpoint as ckpt

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "tests" / "tiny.toml")  # configs/tiny.toml with a smaller vocabulary (read it)
EXACT = "--recovery.reduction=exact"
# One intra-op thread per worker, however many share the machine: every microbatch gradient is computed by the
# same kernels, so exact runs of different worker counts are bitwise comparable (tests/test_train.py).
ONE_THREAD = "--train.threads=1"
RUN_TIMEOUT_S = 240  # one run of ``train``


def train_cmd(cache: Path, *args: str, workers: int = 4) -> list[str]:
    """``unbroken train ARGS --workers N --quiet`` with the session's data cache (give TINY or --resume)."""
    return [
        sys.executable,
        "-m",
        "unbroken",
        "train",
        *args,
        "--workers",
        str(workers),
        "--quiet",
        f"--data.cache_dir={cache}",
    ]


def train(
    out: Path,
    cache: Path,
    *overrides: str,
    workers: int = 4,
    timeout_s: float = RUN_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``unbroken train tests/tiny.toml`` with ``workers`` worker processes into ``out``."""
    cmd = train_cmd(cache, TINY, "--out", str(out), *overrides, workers=workers)
    return run_command(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)


def reference_run(factory: pytest.TempPathFactory, name: str, cache: Path, *overrides: str, workers: int = 1) -> Path:
    """A failure-free run that a test module's runs are compared with (its module fixture): ``train`` into a new
    folder ``name``/reference of the session's temporary directory; the run must succeed."""
    out = factory.mktemp(name) / "reference"
    result = train(out, cache, *overrides, workers=workers)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def run_command(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, **kwargs)``; an ``unbroken`` command (``python -m unbroken ...``) whose output is
    captured as text is forked by this process's launchpad (tests/launchpad.py) instead of started, unless
    ``UNBROKEN_TEST_LAUNCHPAD=0`` or ``env`` differs from this process's environment in anything but ``COLUMNS``
    and ``UNBROKEN_*`` (read when used, not when torch is imported: ``PYTHONOPTIMIZE`` or ``OMP_NUM_THREADS`` are
    not). The program is the same from its first line on; what a fork skips is the interpreter's start and the
    imports."""
    env = kwargs.get("env")
    changed = {k for k in (env or {}).keys() | os.environ.keys() if (env or os.environ).get(k) != os.environ.get(k)}
    forkable = (
        sys.platform == "linux"
        and (env or os.environ).get(LAUNCHPAD_ENV) != "0"
        and cmd[:3] == [sys.executable, "-m", "unbroken"]
        and kwargs.get("capture_output") is True
        and kwargs.get("text") is True
        and set(kwargs) <= {"capture_output", "text", "timeout", "cwd", "env"}
        and all(k == "COLUMNS" or k.startswith("UNBROKEN_") for k in changed)
    )
    if not forkable:
        return subprocess.run(cmd, **kwargs)
    cwd = kwargs.get("cwd")
    return run_forked(cmd[3:], kwargs.get("timeout"), str(cwd) if cwd is not None else os.getcwd(), env or os.environ)


LAUNCHPAD_ENV = "UNBROKEN_TEST_LAUNCHPAD"
_launchpad: tuple[int, subprocess.Popen[bytes], str] | None = None  # (the pid that started it, it, its socket)
forked_pids: list[int] = []  # of the commands forked for this process, oldest first


def _launchpad_socket() -> str:
    """The socket of this process's launchpad, started on first use (its imports: a few seconds, once)."""
    global _launchpad
    if _launchpad is None or _launchpad[0] != os.getpid() or _launchpad[1].poll() is not None:
        path = os.path.join(tempfile.mkdtemp(prefix="launchpad-"), "socket")
        server = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "launchpad.py"), path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
        )
        assert server.stdout is not None and server.stdout.readline() == b"ready\n", "the launchpad did not start"
        _launchpad = (os.getpid(), server, path)
    return _launchpad[2]


def stop_launchpad() -> None:
    """End this process's launchpad and wait for it (its runs' CPU time then counts in this process's children)."""
    global _launchpad
    if _launchpad is not None and _launchpad[0] == os.getpid():
        _launchpad[1].terminate()
        _launchpad[1].wait()
        shutil.rmtree(os.path.dirname(_launchpad[2]), ignore_errors=True)
    _launchpad = None


def run_forked(
    argv: list[str], timeout_s: float | None, cwd: str, env: Mapping[str, str]
) -> subprocess.CompletedProcess[str]:
    """``python -m unbroken ARGV`` in ``cwd`` with ``env``, forked by the launchpad; what ``subprocess.run(...,
    capture_output=True, text=True, timeout=timeout_s, cwd=cwd, env=env)`` returns (or raises)."""
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn,
        open(os.devnull, "rb") as stdin,
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
    ):
        conn.connect(_launchpad_socket())
        request = json.dumps({"argv": argv, "cwd": cwd, "env": dict(env)}).encode() + b"\n"
        fds = [stdin.fileno(), out.fileno(), err.fileno()]
        conn.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        replies = conn.makefile("rb")
        pid = json.loads(replies.readline())["pid"]
        forked_pids.append(pid)
        conn.settimeout(timeout_s)
        try:
            status = json.loads(replies.readline())["status"]
        except (TimeoutError, ValueError) as e:  # ValueError: the reporter died (no status line)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if isinstance(e, TimeoutError):
                raise subprocess.TimeoutExpired([sys.executable, "-m", "unbroken", *argv], timeout_s) from None
            raise
        out.seek(0)
        err.seek(0)
        # As ``text=True`` reads them (universal newlines).
        stdout, stderr = (
            f.read().decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n") for f in (out, err)
        )
    return subprocess.CompletedProcess([sys.executable, "-m", "unbroken", *argv], status, stdout, stderr)


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model parameters of the run's newest good checkpoint."""
    loaded = ckpt.load_latest(run_dir)
    assert loaded is not None
    return loaded.state["model"]


# -- jobs of several processes started by hand (coordinator, agents, launchers) --------------------------------
CONTROL_STEPS = 40
# 8 microbatches of 4 sequences a step: slow enough (a few tenths of a second a step here) that the faults land
# mid-run; the assertions say if one did not.
CONTROL_COMMON = [
    f"--train.steps={CONTROL_STEPS}",
    "--train.microbatches=8",
    "--data.microbatch_size=4",
    EXACT,
    ONE_THREAD,
    "--checkpoint.every=10",
]


# -- the recovery runs (tests/conftest.py makes them; test_recovery and test_report read them) ------------------
RECOVERY_STEPS = 50
# Two kills (backward, reduction) and a rejoin. Worker 1's kill comes the step after worker 2's, while worker 2 is
# still down: it is restarted 6 s after its kill (a fork: it starts at once) and rejoins at a step boundary. Each
# microbatch worker 0 computes over steps 7-19 takes 0.25 s more (4 a step while two workers are down: at least
# 13 s whatever the machine's speed), so that the rejoin lands well before the last step even on an idle, fast
# machine (a factor would shrink with the step: the tests' vocabulary made steps 3x faster, and the rejoin came
# after the end). The delay does not change what exact mode computes.
RECOVERY_SCHEDULE = (
    "kill:worker=2,step=5,phase=backward,rejoin=6.0; kill:worker=1,step=6,phase=reduction; "
    "slow:worker=0,seconds=0.25,steps=7-19"
)
FP32_STEPS = 20  # the fp32 runs: both kills, no need to wait for the rejoin


def unbroken(*args: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``python -m unbroken ARGS`` in a session of its own (``os.killpg`` ends it and its children)."""
    out = open(log, "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [sys.executable, "-m", "unbroken", *args], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def two_hosts(
    tmp_path: Path, run: Path, port: int, overrides: list[str], env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], list[subprocess.Popen[bytes]]]:
    """A coordinator of 4 workers on ``port`` and two agents of 2 workers each, as two hosts (logs in ``tmp_path``:
    ``coordinator.log``, ``agent-<r>.log``)."""
    coordinator = unbroken("coordinator", TINY, "--workers", "4", "--port", str(port), "--run-dir", str(run),
                           *overrides, env=env, log=tmp_path / "coordinator.log")  # fmt: skip
    address = f"127.0.0.1:{port}"
    agents = [
        unbroken(
            "agent",
            "--coordinator",
            address,
            "--workers",
            "2",
            "--node-rank",
            str(r),
            env=env,
            log=tmp_path / f"agent-{r}.log",
        )  # fmt: skip
        for r in (0, 1)
    ]
    return coordinator, agents


def agent_worker_pid(agent: subprocess.Popen[bytes], worker: int) -> int:
    """The pid of ``agent``'s child that runs ``worker``."""
    for pid in Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split():
        if worker_of(int(pid)) == worker:
            return int(pid)
    raise AssertionError(f"worker {worker} is not a child of agent {agent.pid}")


@contextlib.contextmanager
def launched(cmd: list[str], env: Mapping[str, str]) -> Iterator[subprocess.Popen[str]]:
    """``cmd`` started with its output captured as text; killed and reaped on the way out if it still runs (a
    test that failed waiting leaves no job behind)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def kill_worker(token: str, worker: int) -> None:
    """An outside ``kill -9`` of worker ``worker`` of the job whose token is ``token``, once its process runs."""
    wait_for(lambda: worker in worker_pids(token), 60, f"worker {worker}")
    os.kill(worker_pids(token)[worker], signal.SIGKILL)


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def committed(run_dir: Path) -> int:
    """The newest step in the run's metrics (-1 before the first)."""
    return max((r["step"] for r in read_records(run_dir, "step")), default=-1)


def same_final(a: Path, b: Path, step: int) -> None:
    """The checkpoints of ``step`` in run directories ``a`` and ``b`` hold bitwise the same parameters."""
    sa, sb = ckpt.verify(a, step), ckpt.verify(b, step)
    assert all(torch.equal(sa["model"][k], sb["model"][k]) for k in sa["model"])


def worker_pids(token: str) -> dict[int, int]:
    """Worker id -> pid of every live worker process of the job whose token is ``token`` (read from
    ``/proc/*/environ``: how an operator finds a job's workers whatever started them)."""
    found: dict[int, int] = {}
    wanted = f"UNBROKEN_TOKEN={token}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted in env and (worker := worker_of(int(entry.name))) is not None:
            found[worker] = int(entry.name)
    return found


@contextlib.contextmanager
def in_process_coordinator(tmp_path: Path, token: str) -> Iterator[Any]:
    """A ``Coordinator`` object in this process (its store, gateway and metrics file; no loop running) for a run
    of ``tests/tiny.toml`` in ``tmp_path / "run"``, closed at the end."""
    from unbroken.control.coordinator import Coordinator
    from unbroken.control.store import bind_listen_socket
    from unbroken.core.config import dump_config, load_config

    run = tmp_path / "run"
    run.mkdir()
    dump_config(load_config(TINY), run)
    coordinator = Coordinator(bind_listen_socket("127.0.0.1", 0), load_config(TINY), run, 1, False, token=token)
    try:
        yield coordinator
    finally:
        coordinator.gateway.close()
        coordinator.metrics.close()
        if coordinator.status is not None:
            coordinator.status.close()
