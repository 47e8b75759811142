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
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from unbroken.control.host.zygote import worker_of
from unbroken.control.store.netif import free_port  # noqa: F401 - the tests take it from here
from unbroken.core.records import read_records
from unbroken.ft.checkpoint import schema as ckpt

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
    forkable = (
        forks(cmd, env)
        and kwargs.get("capture_output") is True
        and kwargs.get("text") is True
        and set(kwargs) <= {"capture_output", "text", "timeout", "cwd", "env"}
    )
    if not forkable:
        return subprocess.run(cmd, **kwargs)
    cwd = kwargs.get("cwd")
    return run_forked(cmd[3:], kwargs.get("timeout"), str(cwd) if cwd is not None else os.getcwd(), env or os.environ)


def forks(cmd: list[str], env: Mapping[str, str] | None) -> bool:
    """Whether the launchpad may run ``cmd``: ``python -m unbroken ...`` in an environment that differs from this
    process's only in what is read when used (``COLUMNS``, ``UNBROKEN_*``), and ``UNBROKEN_TEST_LAUNCHPAD`` is not 0."""
    changed = {k for k in (env or {}).keys() | os.environ.keys() if (env or os.environ).get(k) != os.environ.get(k)}
    return (
        sys.platform == "linux"
        and (env or os.environ).get(LAUNCHPAD_ENV) != "0"
        and cmd[:3] == [sys.executable, "-m", "unbroken"]
        and all(k == "COLUMNS" or k.startswith("UNBROKEN_") for k in changed)
    )


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
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        cmd = [sys.executable, "-m", "unbroken", *argv]
        proc = ForkedPopen(cmd, cwd, env, [subprocess.DEVNULL, out, err], text=False, new_session=False)
        try:
            status = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        out.seek(0)
        err.seek(0)
        # As ``text=True`` reads them (universal newlines).
        stdout, stderr = (
            f.read().decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n") for f in (out, err)
        )
    return subprocess.CompletedProcess(cmd, status, stdout, stderr)


def _request(
    conn: socket.socket, argv: list[str], cwd: str, env: Mapping[str, str], fds: list[int], new_session: bool = False
) -> None:
    """Ask the launchpad to fork ``python -m unbroken ARGV`` with ``fds`` as its standard input, output and error."""
    conn.connect(_launchpad_socket())
    request = {"argv": argv, "cwd": cwd, "env": dict(env), "new_session": new_session}
    conn.sendmsg(
        [json.dumps(request).encode() + b"\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
    )


class ForkedPopen:
    """What ``subprocess.Popen`` gives for a command the launchpad forked (``popen``), as far as the tests use it:
    ``pid`` (the command's own process, a session leader with ``start_new_session``), ``returncode``, ``poll``,
    ``wait``, ``communicate``, ``send_signal``, ``kill``, and ``stdout`` / ``stderr`` when they are pipes."""

    def __init__(
        self, cmd: list[str], cwd: str, env: Mapping[str, str], streams: list[Any], text: bool, new_session: bool
    ) -> None:
        self.args, self.returncode = cmd, None
        opened, fds, pipes = [], [], {}
        for number, stream in enumerate(streams):
            if stream is None:
                fds.append(number)  # this process's own
            elif stream == subprocess.DEVNULL:
                opened.append(os.open(os.devnull, os.O_RDWR))
                fds.append(opened[-1])
            elif stream == subprocess.STDOUT:
                fds.append(fds[1])
            elif stream == subprocess.PIPE:
                read_end, write_end = os.pipe()
                opened.append(write_end)
                fds.append(write_end)
                pipes[number] = os.fdopen(read_end, "r" if text else "rb")
            else:
                fds.append(stream if isinstance(stream, int) else stream.fileno())
        self.stdout, self.stderr = pipes.get(1), pipes.get(2)
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _request(self._conn, cmd[3:], cwd, env, fds, new_session)
        finally:
            for fd in opened:
                os.close(fd)  # the command has its own copies
        self._received = b""
        self.pid = int(json.loads(self._line(None))["pid"])
        forked_pids.append(self.pid)
        self._readers: list[tuple[Any, list[Any]]] | None = None

    def _line(self, timeout_s: float | None) -> bytes:
        """The launchpad's next line; TimeoutError if none comes within ``timeout_s``; b"" if it hung up."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._received:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._conn.settimeout(left)
            try:
                more = self._conn.recv(4096)
            except (TimeoutError, BlockingIOError):  # BlockingIOError: a timeout of 0 (``poll``)
                raise TimeoutError from None
            if not more:
                return b""
            self._received += more
        line, _, self._received = self._received.partition(b"\n")
        return line

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                line = self._line(timeout)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._conn.close()
            if not line:  # the launchpad's reporter ended without the command's status
                self.kill()
                raise RuntimeError(f"the launchpad lost the command {self.args[3:]} (its reporter ended)")
            self.returncode = int(json.loads(line)["status"])
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Read the pipes to their ends and wait, as ``Popen.communicate`` (may be called again after a timeout)."""
        if self._readers is None:
            self._readers = []
            for pipe in (self.stdout, self.stderr):
                got: list[Any] = []
                if pipe is not None:
                    reader = threading.Thread(target=lambda p=pipe, g=got: g.append(p.read()), daemon=True)
                    reader.start()
                    self._readers.append((reader, got))
                else:
                    self._readers.append((None, got))
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader, _ in self._readers:
            if reader is not None:
                reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if reader.is_alive():
                    raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        (_, out), (_, err) = self._readers
        return (out[0] if out else None), (err[0] if err else None)


def popen(
    cmd: list[str],
    *,
    env: Mapping[str, str] | None = None,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
    start_new_session: bool = False,
) -> Any:
    """``subprocess.Popen(cmd, ...)``; an ``unbroken`` command the launchpad may run (``forks``) is forked by it
    instead of started (a ``ForkedPopen``): the program is the same from its first line on, without the
    interpreter's start and the imports (2 to 4 s of CPU here, for a coordinator or an agent)."""
    if not forks(cmd, env):
        return subprocess.Popen(
            cmd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, text=text, start_new_session=start_new_session
        )
    return ForkedPopen(cmd, os.getcwd(), env or os.environ, [stdin, stdout, stderr], text, start_new_session)


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model parameters of the run's newest good checkpoint."""
    loaded = ckpt.load_latest(run_dir)
    assert loaded is not None
    return loaded.state["model"]


def recomputed_by_the_recoveries(run_dir: Path) -> int:
    """Check each step record's ``recomputed`` against the run's recovery records (a run under the ``recover``
    policy), and return the run's total.

    A recovery after a death (a member of its ``from_epoch`` missing from its ``epoch``) that finds some of the
    step's ids held by the survivors recomputes the ``missing`` ones in-step; one that finds none held plans the
    step afresh and recomputes nothing (``ft.protocol``), as does a recovery after joins alone. Whether a kill
    lands before or after the survivors hold a microbatch is the machine's timing, so a run's total may be 0; the
    accounting must agree either way. A step known only from its republished record carries no counts."""
    members = {r["epoch"]: set(r["members"]) for r in read_records(run_dir, "membership")}
    steps = {r["step"]: r for r in read_records(run_dir, "step") if not r.get("republished")}
    expected = dict.fromkeys(steps, 0)
    seen: set[tuple[int, int, int]] = set()
    for r in read_records(run_dir, "recovery"):
        key = (r["step"], r["from_epoch"], r["epoch"])
        if key in seen or r["step"] not in steps:
            continue
        seen.add(key)
        died = not members[r["from_epoch"]] <= members[r["epoch"]]
        if died and len(r["missing"]) < steps[r["step"]]["microbatches"]:
            expected[r["step"]] += len(r["missing"])
    recomputed = {s: r["recomputed"] for s, r in steps.items()}
    assert recomputed == expected, {s: (recomputed[s], expected[s]) for s in steps if recomputed[s] != expected[s]}
    return sum(recomputed.values())


# -- jobs of several processes started by hand (coordinator, agents, launchers) --------------------------------
CONTROL_STEPS = 40
# 8 microbatches of one sequence a step. What the control plane must do holds for any batch; a run that several
# processes share must last long enough that its faults land mid-run and a restarted worker rejoins before the end,
# and a sleep (``control_pace``), not compute, makes it last (the assertions say if a fault did not land). The
# fail-slow rule is off: the pace makes worker 0 slow on purpose.
CONTROL_COMMON = [
    f"--train.steps={CONTROL_STEPS}",
    "--train.microbatches=8",
    "--data.microbatch_size=1",
    EXACT,
    ONE_THREAD,
    "--checkpoint.every=10",
    "--recovery.slow=off",
]


def control_pace(workers: int, step_s: float = 0.2) -> str:
    """The ``slow`` event that makes every step of a ``CONTROL_COMMON`` run of ``workers`` workers last at least
    ``step_s`` seconds, whatever the machine's speed: worker 0, which no control test kills, sleeps after each of
    its microbatches (8 / ``workers`` a step, more while workers are missing). Timing only: exact mode computes
    the same bits."""
    return f"slow:worker=0,seconds={step_s * workers / 8:g},steps=0-{CONTROL_STEPS - 1}"


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
    """``python -m unbroken ARGS`` in a session of its own (``os.killpg`` ends it and its children), forked by the
    launchpad where it can be (``popen``)."""
    with open(log, "ab") as out:
        cmd = [sys.executable, "-m", "unbroken", *args]
        return popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


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
    test that failed waiting leaves no job behind). Started, not forked (``popen``): its workers then carry the
    job's token in ``/proc/PID/environ`` (``worker_pids``), which a fork's environment, set after its start, does
    not show."""
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
    from unbroken.control.coordinator.loop import Coordinator
    from unbroken.control.store.connect import bind_listen_socket
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
