"""``unbroken train --dry-run`` and ``unbroken launch --dry-run``: every check a launch makes, one line saying what
would run, exit status 0, and nothing started or written; a command a launch would refuse is refused the same way
(one line, exit status 2, nothing written)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from runner import ROOT, TINY, run_command

pytestmark = pytest.mark.timeout(240)

PLAIN = str(ROOT / "examples" / "plain_loop.py")
# README.md's failure example as it was (tests/tiny.toml, like configs/tiny.toml, has 8 steps: 0..7).
PAST_THE_END = "kill:worker=2,step=10,phase=backward,rejoin=5; kill:worker=1,step=20,phase=reduction"


def dry_run(cwd: Path, cache: Path, command: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``unbroken COMMAND --dry-run ARGS`` in ``cwd`` (``train`` with the session's data cache)."""
    cache_dir = [f"--data.cache_dir={cache}"] if command == "train" else []
    cmd = [sys.executable, "-m", "unbroken", command, "--dry-run", *cache_dir, *args]
    return run_command(cmd, cwd=cwd, capture_output=True, text=True, timeout=100)


def files_under(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_a_valid_command_says_what_would_run_and_writes_nothing(tmp_path: Path, data_cache_dir: Path) -> None:
    schedule = "--failures.schedule=kill:worker=1,step=5,phase=backward,rejoin=1; hang:worker=3,step=6"
    result = dry_run(tmp_path, data_cache_dir, "train", TINY, "--workers", "4", schedule)
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    assert line.startswith("dry run: would train model tiny on 4 workers for 8 steps of 4 microbatches")
    assert "into runs/tiny-" in line and "2 failure events scheduled" in line
    assert list(tmp_path.iterdir()) == []  # not even the default run directory's runs/

    out = tmp_path / "run"
    result = dry_run(tmp_path, data_cache_dir, "launch", "--workers", "3", "--out", str(out), PLAIN, "-x")
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    assert line.startswith(f"dry run: would run {PLAIN} on 3 workers for 200 steps") and f"into {out}," in line
    assert list(tmp_path.iterdir()) == []


def test_a_resume_is_checked_against_its_checkpoint_and_nothing_is_written(
    tmp_path: Path, data_cache_dir: Path, tiny_run: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, symlinks=True)
    before = files_under(run)
    # Overrides at --resume are written into the run's config.toml by a real launch: not by a dry run.
    result = dry_run(tmp_path, data_cache_dir, "train", "--resume", str(run), "--workers", "3", "--train.steps=12")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        f"dry run: would train model tiny on 3 workers for 12 steps of 4 microbatches, continuing {run},"
    )
    assert files_under(run) == before

    (run / "checkpoints").rename(tmp_path / "moved")
    before = files_under(run)
    result = dry_run(tmp_path, data_cache_dir, "train", "--resume", str(run))
    assert result.returncode == 2 and "no checkpoint" in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1 and result.stdout == ""
    assert files_under(run) == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("train", TINY, "--workers", "4", f"--failures.schedule={PAST_THE_END}"), "step past the end of the run"),
        (("train", "tiny", "--model.hf_config=no-such-config.json"), "neither a config.json file nor a preset"),
        (("train", TINY, "--workers", "3", "--parallel.shard=2"), "is not a whole number of replicas"),
        (("launch", "--workers", "2", "no_such_script.py"), "script no_such_script.py does not exist"),
        (("train", TINY, "--port", "PORT"), "choose a free --port"),
    ],
    ids=["kill-past-the-end", "hf-config", "part-of-a-replica", "missing-script", "port-in-use"],
)
def test_what_a_launch_refuses_a_dry_run_refuses(
    tmp_path: Path, data_cache_dir: Path, args: tuple[str, ...], message: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = dry_run(tmp_path, data_cache_dir, *(port if a == "PORT" else a for a in args))
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert message in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr[-2000:]
    assert result.stdout == "" and list(tmp_path.iterdir()) == []
