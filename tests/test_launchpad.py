"""The tests' launchpad (tests/launchpad.py, ``runner.run_command``): a command it forks gives what the same
command started gives (status, output, directory, environment), a timeout raises as ``subprocess.run``'s does and
ends the command, and a command it must not fork is started."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import runner
from runner import LAUNCHPAD_ENV, ROOT, run_command

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(sys.platform != "linux", reason="the launchpad is Linux's")]
UNBROKEN = [sys.executable, "-m", "unbroken"]


def both(
    cmd: list[str], cwd: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """``cmd`` forked by the launchpad (checked), then started (``UNBROKEN_TEST_LAUNCHPAD=0``)."""
    env = env or dict(os.environ)
    before = len(runner.forked_pids)
    forked = run_command(cmd, capture_output=True, text=True, timeout=60, cwd=cwd, env=env)
    assert len(runner.forked_pids) == before + 1
    started = run_command(cmd, capture_output=True, text=True, timeout=60, cwd=cwd, env={**env, LAUNCHPAD_ENV: "0"})
    assert len(runner.forked_pids) == before + 1
    return forked, started


def test_a_forked_command_gives_the_status_and_output_of_a_started_one(tmp_path: Path) -> None:
    """An error (one line, exit 2), an error about a setting of its environment (a job token too short), and a
    success that reads a relative path in its directory."""
    forked, started = both([*UNBROKEN, "status", "no-such-run"], cwd=tmp_path)
    assert forked.returncode == started.returncode == 2
    assert (forked.stdout, forked.stderr) == (started.stdout, started.stderr) and "no-such-run" in forked.stderr
    shutil.copy(ROOT / "tests" / "tiny.toml", tmp_path / "mine.toml")
    coordinator = [*UNBROKEN, "coordinator", "mine.toml", "--workers", "2", "--port", "0", "--run-dir", "run"]
    forked, started = both(coordinator, cwd=tmp_path, env={**os.environ, "UNBROKEN_TOKEN": "abc"})
    assert forked.returncode == started.returncode == 2
    assert forked.stderr == started.stderr and "UNBROKEN_TOKEN has 3 characters" in forked.stderr
    cmd = [*UNBROKEN, "train", "mine.toml", "--workers", "3", "--dry-run", f"--data.cache_dir={tmp_path / 'cache'}"]
    forked, started = both(cmd, cwd=tmp_path)
    assert forked.returncode == started.returncode == 0, forked.stderr + started.stderr
    run_dir = re.compile(r"\d{8}-\d{6}")  # the run directory's name is the time it is named
    assert run_dir.sub("T", forked.stdout) == run_dir.sub("T", started.stdout)
    assert forked.stdout.startswith("dry run: ") and "3 workers" in forked.stdout


def test_a_timeout_raises_and_ends_the_forked_command(tmp_path: Path) -> None:
    """A coordinator waits for workers that never come: the timeout raises ``TimeoutExpired`` and the forked
    process is gone (killed, then reaped by the launchpad's reporter)."""
    cmd = [*UNBROKEN, "coordinator", str(ROOT / "tests" / "tiny.toml"), "--workers", "2", "--port", "0"]
    cmd += ["--run-dir", str(tmp_path / "run")]
    forked = len(runner.forked_pids)
    env = {**os.environ, "UNBROKEN_TOKEN": "0123456789abcdef0123"}
    with pytest.raises(subprocess.TimeoutExpired):
        run_command(cmd, capture_output=True, text=True, timeout=3, env=env)
    (pid,) = runner.forked_pids[forked:]
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists()


def test_a_command_with_an_import_time_setting_is_started_not_forked(tmp_path: Path) -> None:
    """``PYTHONOPTIMIZE`` takes effect when the interpreter starts: a forked command could not honour it, so it is
    started (and another option of ``subprocess.run``, ``input``, is not the launchpad's either)."""
    forked = len(runner.forked_pids)
    cmd = [*UNBROKEN, "status", "no-such-run"]
    optimised = run_command(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONOPTIMIZE": "1"})
    fed = run_command(cmd, capture_output=True, text=True, timeout=60, input="")
    assert optimised.returncode == fed.returncode == 2 and runner.forked_pids[forked:] == []
    run_command(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, "UNBROKEN_ANYTHING": "1"})
    assert len(runner.forked_pids[forked:]) == 1  # a setting read when used does not stop the fork


def test_a_popen_of_a_forked_command_behaves_as_a_started_one(tmp_path: Path) -> None:
    """``runner.popen``: a coordinator forked in a session of its own, its output in a file. Its ``pid`` is the
    command's own process (the leader of its session), ``poll`` says it runs, ``os.killpg`` of its pid ends it,
    and ``wait`` gives the status a started one gives (killed by SIGKILL). Then a command whose output and errors
    are pipes: what ``communicate`` returns is what ``subprocess.run`` gives for it, with its status."""
    cmd = [*UNBROKEN, "coordinator", str(ROOT / "tests" / "tiny.toml"), "--workers", "2", "--port", "0"]
    cmd += ["--run-dir", str(tmp_path / "run")]
    env = {**os.environ, "UNBROKEN_TOKEN": "0123456789abcdef0123"}
    forked = len(runner.forked_pids)
    with open(tmp_path / "coordinator.log", "ab") as log:
        proc = runner.popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    assert runner.forked_pids[forked:] == [proc.pid]
    listening = "coordinator listening on 127.0.0.1:"
    runner.wait_for(lambda: listening in (tmp_path / "coordinator.log").read_text(), 60, "the coordinator's port")
    assert proc.poll() is None and os.getsid(proc.pid) == proc.pid
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    os.killpg(proc.pid, 9)
    assert proc.wait(timeout=30) == -9 and proc.poll() == -9 and proc.returncode == -9
    piped = runner.popen(
        [*UNBROKEN, "status", "no-such-run"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = piped.communicate(timeout=60)
    started = subprocess.run([*UNBROKEN, "status", "no-such-run"], capture_output=True, text=True, timeout=60)
    assert (piped.returncode, out, err) == (started.returncode, started.stdout, started.stderr) == (2, "", err)
    assert "no-such-run" in err and runner.forked_pids[forked:] == [proc.pid, piped.pid]
