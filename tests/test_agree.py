"""What a person reads about a run agrees with its records: the console's lines, the summary at the end,
``unbroken status`` (piped, in 80 columns) and ``unbroken report`` name the same step numbers and the same
counts. Steps are numbered from 0 everywhere, as in the failure schedule and the records (README, "Step
numbers"); a re-formation that admitted a worker is a join, not a recovery; a worker whose restart comes too
late is said not to have rejoined, and the launcher stops it at the end rather than wait for it.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from runner import ROOT, TINY, run_command

from unbroken.core.records import committed_steps, read_records
from unbroken.lab.report import load_run, render_markdown

pytestmark = pytest.mark.timeout(300)

STEPS = 8  # tests/tiny.toml: evaluations after steps 3 and 7, checkpoints after 4 and 8 steps
KILL_STEP = 5
# Restarted 600 s after the kill: long after the run's end, so worker 2 never rejoins.
SCHEDULE = f"kill:worker=2,step={KILL_STEP},phase=backward,rejoin=600"
STEP_LINE = re.compile(r"^step (\d+) \| loss (\d+\.\d{4}) \| .* \| (\d+)/(\d+) done$")


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory, data_cache_dir: Path) -> tuple[Path, str]:
    """``unbroken train tests/tiny.toml --workers 3`` with worker 2 killed in step 5: its directory and its
    console (the plain lines a pipe gets, and the summary, 200 columns wide so no row wraps)."""
    out = tmp_path_factory.mktemp("agree") / "run"
    cmd = [sys.executable, "-m", "unbroken", "train", TINY, "--workers", "3", "--out", str(out)]
    cmd += [f"--data.cache_dir={data_cache_dir}", f"--failures.schedule={SCHEDULE}"]
    result = run_command(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result.stdout


def _status(run_dir: Path, *args: str) -> str:
    """``unbroken status RUN_DIR`` into a pipe, in 80 columns."""
    result = run_command(
        [sys.executable, "-m", "unbroken", "status", str(run_dir), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _panel_value(status: str, name: str) -> str:
    """The value of ``name`` in the status panel, its lines joined without their spaces."""
    lines = status.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(f"│ {name} "))
    parts = [lines[first][2:-1].removeprefix(name)]
    for line in lines[first + 1 :]:
        if not line.startswith("│" + " " * 10):
            break
        parts.append(line[2:-1])
    return "".join("".join(parts).split())


def _summary_row(console: str, name: str) -> list[str]:
    """The text of the summary table's rows named ``name`` (one line each at 200 columns)."""
    return [line.split("│")[2].strip() for line in console.splitlines() if line.startswith(f"│ {name} ")]


def test_the_console_names_each_step_as_its_record_does(killed_run: tuple[Path, str]) -> None:
    out, console = killed_run
    steps = committed_steps(read_records(out))
    lines = {int(m[1]): m for m in map(STEP_LINE.match, console.splitlines()) if m}
    assert sorted(lines) == sorted(steps) == list(range(STEPS))
    for step, m in lines.items():
        assert m[2] == f"{steps[step]['loss']:.4f}", step  # the line of step N shows record N's loss
        assert (int(m[3]), int(m[4])) == (step + 1, STEPS)  # and counts the steps done
    evals = [int(s) for s in re.findall(r"^eval after step (\d+): ", console, re.M)]
    assert evals == [r["step"] for r in read_records(out, "eval")] == [3, 7]


def test_the_kill_is_named_by_its_scheduled_step_everywhere(killed_run: tuple[Path, str]) -> None:
    out, console = killed_run
    (recovery,) = read_records(out, "recovery")
    (failure,) = read_records(out, "failure")
    assert recovery["step"] == KILL_STEP and failure["event"] == SCHEDULE
    assert re.search(rf"^step {KILL_STEP} goes on with 2 workers \(epoch {recovery['epoch']}\)", console, re.M)
    (survived,) = _summary_row(console, "failure survived")
    assert survived.startswith(f"worker 2 in step {KILL_STEP}: {SCHEDULE}")
    assert _summary_row(console, "steps") == [f"{STEPS} of {STEPS}"]

    status = _status(out)
    assert f"steps done     {STEPS} of {STEPS}, the last step {STEPS - 1} " in status
    row = next(line for line in status.splitlines() if re.match(r"^ *2 +kill:worker=2,", line))
    assert row.count(f"step {KILL_STEP},") == 2, row  # detected in step 5, re-formed in step 5
    checkpoint = out / "checkpoints" / f"step_{STEPS:08d}.pt"
    assert _panel_value(status, "checkpoint") == f"afterstep{STEPS - 1}({checkpoint})"
    assert "1 failed, 1 recovered, 0 rejoined" in status

    report = render_markdown(load_run(out), None)
    (table_row,) = [line for line in report.splitlines() if line.startswith("| 2 | `kill:")]
    assert table_row.split(" | ")[4] == str(KILL_STEP)  # the report's step column
    assert f"| steps | {STEPS} of {STEPS} (last step {STEPS - 1}) |" in report
    assert "1 recovered in-step, 0 rejoined" in report


def test_a_restart_after_the_end_is_reported_as_not_rejoined(killed_run: tuple[Path, str]) -> None:
    out, console = killed_run
    assert _summary_row(console, "not rejoined") == [
        "worker 2: restart due 600 s after the failure; the run ended before it rejoined"
    ]
    status = _status(out)
    assert "not yet" not in status and "no (run" in status


def test_status_fits_80_columns_with_whole_headers_times_and_speeds(killed_run: tuple[Path, str]) -> None:
    """Piped, in 80 columns: no line is longer, nothing is cut off with an ellipsis, every header and every
    time is whole, and the alive workers' seconds per microbatch (from their step records) are shown."""
    out, _ = killed_run
    status = _status(out)
    assert max(map(len, status.splitlines())) <= 80 and "…" not in status

    def header(title: str) -> str:
        return " ".join(re.split(rf"^{title} *$", status, flags=re.M)[1].split("───", 1)[0].split())

    assert (
        header("workers")
        == "s per micro- micro- compute fail- worker state since batches batch s (est.) ures last failure"
    )
    assert header("failures and recoveries") == "recom- puted/ worker fault detected re-formed dropped rejoined"
    row = re.compile(r"^ *(\d) +(alive|dead) +(\d\d:\d\d:\d\d) +(\S+) +(\S+) +(\S+)", re.M)
    rows = {int(m[1]): m for m in row.finditer(status)}
    assert sorted(rows) == [0, 1, 2] and rows[2][2] == "dead"
    for w in (0, 1):
        quota, speed, compute = rows[w][4], float(rows[w][5]), float(rows[w][6])
        # both shown to 3 decimals: the shown speed and the shown product differ by at most (quota + 1) half-units
        assert speed > 0 and abs(compute - int(quota) * speed) <= (int(quota) + 1) * 5e-4 + 1e-9


def test_the_report_and_the_console_agree_on_the_wall_time(killed_run: tuple[Path, str]) -> None:
    out, console = killed_run
    (throughput,) = _summary_row(console, "throughput")
    wall = re.search(r"wall (\d+\.\d) s \(coordinator start to last record\)", throughput)
    assert wall, throughput
    report = render_markdown(load_run(out), None)
    assert f"| wall time | {wall[1]} s from the coordinator's start to the last record |" in report
    assert "since the coordinator started" in report and "first epoch" not in report


LATE_WORKER = """
import os, sys, threading, time
from pathlib import Path

markers = Path(sys.argv[1])
started, restarted = markers / f"started-{os.environ['UNBROKEN_WORKER_ID']}", markers / "restarted"
if started.exists():  # a restart: still coming up (here, for good) when the run ends
    restarted.touch()
    threading.Event().wait(600)
    sys.exit(3)
started.touch()
sys.path.insert(0, sys.argv[2])
import plain_loop

evaluate = plain_loop.eval_loss


def eval_loss_once_restarted(*args):
    # The last step's evaluation: the run cannot end before the restarted process is running (however fast
    # the steps are); a launcher that never restarts it fails the test at its summary, not with a hang here.
    deadline = time.monotonic() + 60
    while not restarted.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return evaluate(*args)


plain_loop.eval_loss = eval_loss_once_restarted
plain_loop.main()
"""


def test_a_worker_restarted_too_late_is_stopped_at_the_end_with_one_line(tmp_path: Path) -> None:
    """Worker 2 is killed in step 2 and restarted 0.1 s later, but its new process is still starting when the
    run ends (the survivors' last evaluation waits until it runs): the summary says it did not rejoin, and the
    launcher stops it at the end (one line in its log) instead of waiting for it to give up on the coordinator."""
    script, markers, out = tmp_path / "late.py", tmp_path / "markers", tmp_path / "run"
    script.write_text(LATE_WORKER)
    markers.mkdir()
    kill = "kill:worker=2,step=2,phase=backward,rejoin=0.1"
    cmd = [sys.executable, "-m", "unbroken", "launch", "--workers", "3", "--out", str(out), "--train.steps=6"]
    cmd += [f"--failures.schedule={kill}", str(script), str(markers), str(ROOT / "examples")]
    result = run_command(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_records(out, "final") and sorted(read_records(out, "final")[0]["checksums"]) == ["0", "1"]
    assert _summary_row(result.stdout, "not rejoined") == [
        "worker 2: restart due 0.1 s after the failure; the run ended before it rejoined"
    ]
    log = (out / "logs" / "worker-2.log").read_text().splitlines()
    injected = max(i for i, line in enumerate(log) if "injection point reached" in line)
    (after,) = log[injected + 1 :]  # the restarted process said nothing; the agent says why it ended
    assert after.startswith("[agent] ") and "the run finished before worker 2 rejoined" in after
    assert "Traceback" not in "\n".join(log)
