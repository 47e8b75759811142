"""``unbroken train --dry-run`` and ``unbroken launch --dry-run``: every check a launch makes, one line saying what
would run, exit status 0, and nothing started or written; a command a launch would refuse is refused the same way
(one line, exit status 2, nothing written); what a launch would warn of (``core.launchcheck``: settings valid but
unable to act) is warned of the same way, on stderr."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from doccommands import extract
from runner import ROOT, TINY, run_command

from unbroken.cli import parse_command
from unbroken.control.coordinator.failslow import SlowRule
from unbroken.control.launchcheck import launch_warnings
from unbroken.core.config import load_config, preset_path

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


# -- warnings: settings that are valid but cannot act (unbroken.control.launchcheck) ---------------------------------
README_SLOW = "slow:worker=1,factor=3,steps=5-20"  # README.md's slow example: 30 steps, worker 1 slow in 5-20


def warnings_for(*overrides: str, workers: int = 4, spares: int = 0) -> list[str]:
    return launch_warnings(load_config(TINY, list(overrides)), workers, spares)


def test_a_run_whose_settings_all_act_is_not_warned_of() -> None:
    assert warnings_for() == []
    assert warnings_for("--train.steps=3") == []  # the default "report" on a short run: nothing to report, no line
    assert warnings_for(spares=1) == []  # spares under "recover" take a dead worker's place
    assert warnings_for("--train.microbatches=4") == warnings_for("--train.microbatches=5") == []


def test_idle_workers_and_spares_that_a_restart_never_uses_are_warned_of() -> None:
    (idle,) = warnings_for("--train.microbatches=2")
    assert idle.startswith("unbroken: warning: 4 workers for train.microbatches = 2: workers 2, 3 compute nothing")
    (spares,) = warnings_for("--recovery.policy=restart", spares=1)
    assert spares.startswith("unbroken: warning: --spares 1 with recovery.policy = restart") and "never" in spares
    assert len(warnings_for("--recovery.policy=restart", "--train.microbatches=2", spares=2)) == 2


@pytest.mark.parametrize(
    ("policy", "steps", "last"),
    [("exclude", 30, 28), ("rebalance", 12, 10)],
    ids=["exclude-30", "rebalance-12"],
)
def test_a_fail_slow_rule_whose_windows_do_not_fit_in_the_run_is_warned_of_with_a_window_that_fits(
    policy: str, steps: int, last: int
) -> None:
    """With the default windows (10 steps, 3 of them) a worker slow from step 0 is found at step 29 at the earliest,
    and rebalancing or excluding it needs a step after that: a run of 30 steps (or 12) cannot act, one of 31 can.
    The line names the largest window that can, and with it the warning goes."""
    (line,) = warnings_for(f"--recovery.slow={policy}", f"--train.steps={steps}")
    assert line.startswith(f"unbroken: warning: recovery.slow = {policy} cannot act in this run of {steps} steps")
    assert f"does not fill by step {last} (an action needs a step after its verdict)" in line, line
    suggested = re.findall(r"--recovery\.slow_windows?=\d+", line.rsplit(";", 1)[1])
    assert suggested and warnings_for(f"--recovery.slow={policy}", f"--train.steps={steps}", *suggested) == []
    window = int(suggested[0].split("=")[1])
    windows = int(suggested[1].split("=")[1]) if len(suggested) > 1 else 3
    assert SlowRule(window, windows).found_at(0, steps - 1) <= last < SlowRule(window + 1, windows).found_at(0, 10**6)
    # 31 steps: found at step 29 at the earliest, one step left to act on
    assert warnings_for(f"--recovery.slow={policy}", "--train.steps=31") == []


def test_a_scheduled_slow_spell_that_the_windows_cannot_fill_is_warned_of_under_any_policy_but_off() -> None:
    """README's slow example with the default windows: worker 1 slow in steps 5-20 fills more than half of only one
    window of 10 (10-19), never three running, so "report" (the default) reports nothing; windows of 5 (5-9,
    10-14, 15-19) find it by step 19."""
    (line,) = warnings_for("--train.steps=30", f"--failures.schedule={README_SLOW}")
    assert "recovery.slow = report cannot act in this run of 30 steps" in line
    assert f"which {README_SLOW} does not fill by step 29" in line
    assert line.endswith("--recovery.slow_window=5 would act")
    assert SlowRule(5).found_at(5, 20) == 19 and SlowRule(6).found_at(5, 20) is None
    assert warnings_for("--train.steps=30", f"--failures.schedule={README_SLOW}", "--recovery.slow=off") == []


def test_readme_and_docs_examples_of_slow_workers_can_act() -> None:
    """Every ``unbroken train``/``launch`` command of README.md and docs/*.md that injects a slow worker or sets the
    fail-slow rule gets no warning: its windows fit in its run."""
    commands, _ = extract(ROOT)
    launches = [c for c in commands if (c.cli_argv() or [""])[0] in ("train", "launch")]
    slow = [c for c in launches if re.search(r"slow:|recovery\.slow", c.text)]
    assert any(c.path == "README.md" and README_SLOW in c.text for c in slow), [c.source for c in slow]
    for command in slow:
        args, extra = parse_command(command.cli_argv() or [])
        config = None if args.config is None else ROOT / args.config
        if config is not None and not config.is_file():
            config = preset_path(args.config)  # a packaged config's name (``unbroken train tiny``)
        cfg = load_config(None if config is None else str(config), extra)
        assert launch_warnings(cfg, args.workers, args.spares) == [], command.source


def test_a_dry_run_prints_the_warnings_a_launch_would(tmp_path: Path, data_cache_dir: Path) -> None:
    """tests/tiny.toml has 8 steps: under ``exclude`` the default windows cannot act. The dry run says so on stderr
    (the one line a launch prints), its one line on stdout as ever, and exits 0: a warning, not an error."""
    result = dry_run(tmp_path, data_cache_dir, "train", TINY, "--workers", "3", "--recovery.slow=exclude")
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    assert line.startswith("dry run: would train model tiny on 3 workers for 8 steps")
    warnings = [w for w in result.stderr.splitlines() if w.startswith("unbroken: warning: ")]
    assert warnings == warnings_for("--recovery.slow=exclude", workers=3), result.stderr
    assert "recovery.slow = exclude cannot act in this run of 8 steps" in warnings[0]
    assert list(tmp_path.iterdir()) == []
