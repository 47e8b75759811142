"""One reading of the records (``core.runfacts``): the console summary, ``unbroken report`` and ``unbroken status``
of the same run state the same counts and times, and those the records show read on their own.

The oracle is the records themselves, read here without the fold: a step is counted once by its last record, a
failure is a ``failure`` record, a recovery a re-formation that did not only admit workers (``records.is_join``),
a promotion a ``spare`` record of state ``promoted``, a session a coordinator started from disk
(``records.sessions``), the wall time each session's first record to its last, tokens/s the committed tokens over
the steps' summed time. The real run: the recovery fixture's (two kills, a rejoin), resumed with a warm spare
that takes the place of a worker killed in the second session. Synthetic records cover what a run cannot be made
to do on demand (a restart policy's relaunch, a spare's record written after its join).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from runner import ROOT, run_command

from unbroken.control.status.model import RunView
from unbroken.control.status.progress import summary_rows
from unbroken.control.status.terminal import render
from unbroken.control.status.timeline import entry
from unbroken.core.goodput import Goodput, account
from unbroken.core.records import FIELDS, RecordKind, SpareState, is_join, make, read_records, sessions
from unbroken.core.runfacts import RunFacts
from unbroken.lab.report import load_run, render_markdown

pytestmark = pytest.mark.timeout(120)  # a test's own; conftest adds the time of the runs its fixtures build
FIXTURE_RUNS = {"resumed_run": 1}
RESUMED_STEPS = 60  # the recovery fixture's 50, then 10 more in a second session
SPARE_KILL = "kill:worker=1,step=53,phase=backward"  # the second session's kill: the warm spare takes its place
# Worker 0 sleeps 0.15 s after each of its microbatches of the second session (2 a step): the spare's join, which
# the agent starts the moment it sees the death, lands steps before the end. Timing only: exact mode computes the
# same bits.
PACE = "slow:worker=0,seconds=0.15,steps=50-59"
FIGURES = ("steps", "failures", "recoveries", "rejoins", "promotions", "sessions", "wall", "tokens/s", "goodput")


# -- what the records say, read on their own ------------------------------------------------------------------------
def expected(records: list[dict[str, Any]]) -> dict[str, str]:
    """Each figure the three views state, from the records alone (not through ``core.runfacts``), as they print it."""
    last: dict[int, dict[str, Any]] = {}
    for r in records:
        if r["type"] == RecordKind.STEP and not (r.get("republished") and r["step"] in last):
            last[r["step"]] = r
    timed = [r for r in last.values() if r["step_time_s"] > 0]
    recoveries = rejoins = 0
    for session in sessions(records):
        epochs: dict[int, list[int]] = {}
        # The session's promotions, whoever's record came first: a spare's record (the agent's, through the store)
        # may follow the epoch that admitted it.
        promoted = [r["worker"] for r in session if r["type"] == RecordKind.SPARE and r["state"] == SpareState.PROMOTED]
        previous: list[int] | None = None
        for r in session:
            if r["type"] == RecordKind.MEMBERSHIP:
                epochs[r["epoch"]] = r["members"]
                added = set(r["members"]) - set(previous) if previous is not None else set()
                rejoins += bool(added - set(promoted))
                for worker in added & set(promoted):
                    promoted.remove(worker)  # one promotion each
                previous = r["members"]
            if r["type"] == RecordKind.RECOVERY and not is_join(r, epochs):
                recoveries += 1
    wall, end = 0.0, None
    for session in sessions(records):
        times = [r["time"] for r in session]
        wall += max(times) - min(times)
        if end is not None and any(r["type"] == RecordKind.RESTART for r in session):
            wall += min(times) - end  # a restart policy's relaunch: the job was down between the two
        end = max(times)
    g = account(records)
    return {
        "steps": str(len(last)),
        "failures": str(sum(r["type"] == RecordKind.FAILURE for r in records)),
        "recoveries": str(recoveries),
        "rejoins": str(rejoins),
        "promotions": str(sum(r["type"] == RecordKind.SPARE and r["state"] == SpareState.PROMOTED for r in records)),
        "sessions": str(len(sessions(records))),
        "wall": f"{wall:.1f}",
        "tokens/s": f"{sum(r['tokens'] for r in timed) / sum(r['step_time_s'] for r in timed):,.0f}",
        "goodput": _goodput(g),
    }


def _goodput(g: Goodput) -> str:
    return f"{g.tokens_per_s:,.0f} tokens/s, {100 * g.ratio:.1f} %"


# -- what each view states ------------------------------------------------------------------------------------------
def _one(pattern: str, text: str) -> re.Match[str]:
    found = re.search(pattern, text, re.M)
    assert found, f"{pattern!r} not in:\n{text}"
    return found


def stated_by_summary(rows: list[tuple[str, str]]) -> dict[str, str]:
    """The figures of the summary table's rows (name, text), as the console prints them."""
    named = dict(rows)
    speed = _one(r"^([\d,]+) tokens/s \(training\), wall (\d+\.\d) s", named["throughput"])
    goodput = _one(r"^goodput ([\d,]+) tokens/s of an ideal [\d,]+ \((\d+\.\d) %\)", named["goodput"])
    recovery = _one(r"^(\d+) recover", named.get("recovery", "0 recoveries"))
    return {
        "steps": _one(r"^(\d+) of ", named["steps"])[1],
        "failures": str(sum(name == "failure survived" for name, _ in rows)),
        "recoveries": recovery[1],
        "rejoins": str(sum(name == "rejoined" for name, _ in rows)),
        "promotions": str(sum(name == "spare promoted" for name, _ in rows)),
        "sessions": _one(r"^(\d+) ", named["sessions"])[1] if "sessions" in named else "1",
        "wall": speed[2],
        "tokens/s": speed[1],
        "goodput": f"{goodput[1]} tokens/s, {goodput[2]} %",
    }


def console_rows(stdout: str) -> list[tuple[str, str]]:
    """The summary table's rows in a console's output (a row continued on the next line joined to it)."""
    rows: list[tuple[str, str]] = []
    for line in stdout.splitlines():
        cells = line.split("│")
        if len(cells) != 4:
            continue
        name, text = cells[1].strip(), cells[2].strip()
        if name:
            rows.append((name, text))
        elif rows:
            rows[-1] = (rows[-1][0], f"{rows[-1][1]} {text}")
    return rows


def stated_by_report(markdown: str) -> dict[str, str]:
    counts = _one(r"^(\d+) recovered in-step, (\d+) rejoined(?:, (\d+) promoted from a warm spare)?", markdown)
    goodput = _one(r"^goodput ([\d,]+) tokens/s of an ideal [\d,]+ \((\d+\.\d) %\)", markdown)
    sessions_row = re.search(r"^\| sessions \| (\d+) ", markdown, re.M)
    return {
        "steps": _one(r"^\| steps \| (\d+)", markdown)[1],
        "failures": _one(r"^## Failures survived: (\d+)$", markdown)[1],
        "recoveries": counts[1],
        "rejoins": counts[2],
        "promotions": counts[3] or "0",
        "sessions": sessions_row[1] if sessions_row else "1",
        "wall": _one(r"^\| wall time \| (\d+\.\d) s", markdown)[1],
        "tokens/s": _one(r"^\| throughput \| ([\d,]+) tokens/s over training time", markdown)[1],
        "goodput": f"{goodput[1]} tokens/s, {goodput[2]} %",
    }


def stated_by_status(text: str) -> dict[str, str]:
    """The figures of ``unbroken status``'s panel (printed wide enough that no row wraps)."""
    counts = _one(r"│ failures +(\d+) failed, (\d+) recovered, (\d+) rejoined(?:, (\d+) replaced by a spare)?", text)
    speed = _one(r"│ throughput +([\d,]+) tokens/s \(training\), wall (\d+\.\d) s", text)
    goodput = _one(r"│ goodput +([\d,]+) tokens/s, (\d+\.\d) % of the ideal", text)
    sessions_row = re.search(r"│ sessions +(\d+) ", text)
    return {
        "steps": _one(r"│ steps done +(\d+)", text)[1],
        "failures": counts[1],
        "recoveries": counts[2],
        "rejoins": counts[3],
        "promotions": counts[4] or "0",
        "sessions": sessions_row[1] if sessions_row else "1",
        "wall": speed[2],
        "tokens/s": speed[1],
        "goodput": f"{goodput[1]} tokens/s, {goodput[2]} %",
    }


def stated_by_status_json(snapshot: dict[str, Any]) -> dict[str, str]:
    run, goodput = snapshot["run"], snapshot["goodput"]
    return {
        "steps": str(run["steps_done"]),
        "failures": str(run["failures"]),
        "recoveries": str(run["recoveries"]),
        "rejoins": str(run["rejoins"]),
        "promotions": str(run["promotions"]),
        "sessions": str(run["sessions"]),
        "wall": f"{run['wall_s']:.1f}",
        "tokens/s": f"{run['train_tokens_per_s']:,.0f}",
        "goodput": f"{goodput['tokens_per_s'][-1]:,.0f} tokens/s, {100 * goodput['ratio'][-1]:.1f} %",
    }


def _status_text(view: RunView) -> str:
    console = Console(record=True, width=200)
    console.print(render(view.snapshot(), 200))
    return console.export_text()


# -- the real run ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resumed_run(
    recovery_runs: dict[str, Path], data_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    """The recovery fixture's run with its kills and rejoin (copied), resumed on 3 workers and a warm spare for 10
    more steps, in which worker 1 is killed and the spare takes its place: the directory and the second session's
    console (its summary covers both sessions, 250 columns wide so no row wraps)."""
    run = tmp_path_factory.mktemp("one-reading") / "run"
    shutil.copytree(recovery_runs["exact_failures"], run, ignore=shutil.ignore_patterns("report", "*.lock"))
    cmd = [sys.executable, "-m", "unbroken", "train", "--resume", str(run), "--workers", "3", "--spares", "1"]
    cmd += [f"--train.steps={RESUMED_STEPS}", f"--failures.schedule={SPARE_KILL};{PACE}"]
    cmd += [f"--data.cache_dir={data_cache_dir}"]
    result = run_command(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "COLUMNS": "250"})
    assert result.returncode == 0, result.stderr[-3000:]
    return run, result.stdout


def test_the_summary_the_report_and_the_status_of_a_run_state_what_its_records_say(
    resumed_run: tuple[Path, str],
) -> None:
    run, console = resumed_run
    records = read_records(run)
    truth = expected(records)
    # The run holds what the test is about: both sessions, the three kills, the rejoin, the spare's promotion.
    assert (truth["sessions"], truth["failures"], truth["rejoins"], truth["promotions"]) == ("2", "3", "1", "1")
    assert truth["steps"] == str(RESUMED_STEPS)

    stated = {
        "summary": stated_by_summary(console_rows(console)),
        "report": stated_by_report(render_markdown(load_run(run), None)),
        "status": stated_by_status(_command(["status", str(run)], columns=200)),
        "status --json": stated_by_status_json(json.loads(_command(["status", str(run), "--json"], columns=200))),
    }
    for view, figures in stated.items():
        assert figures == truth, (view, figures, truth)

    # The spare is named as what it is in each: a promotion, not a worker that rejoined.
    rows = console_rows(console)
    assert [text for name, text in rows if name == "spare promoted"][0].startswith("spare 0 took worker 1's place")
    assert not any(name == "rejoined" and text.startswith("worker 1 ") for name, text in rows)
    status = _command(["status", str(run)], columns=200)
    assert re.search(r"│ spares +.*1 promoted \(spare 0 in worker 1's place\)", status), status
    assert "| spare 0 | worker 1 |" in render_markdown(load_run(run), None)


def _command(args: list[str], columns: int) -> str:
    result = run_command(
        [sys.executable, "-m", "unbroken", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": str(columns)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_the_comparison_fires_on_a_view_that_misreads_the_run(resumed_run: tuple[Path, str]) -> None:
    """The check above fails a summary whose wall time is its own session's (what a console summary said after a
    resume), a report that counts the spare's join as a rejoin, and a status whose goodput is the coordinator's
    last periodic record rather than the run's account."""
    run, console = resumed_run
    records = read_records(run)
    truth = expected(records)
    own = sessions(records)[-1]
    session_wall = f"{max(r['time'] for r in own) - min(r['time'] for r in own):.1f}"
    assert session_wall != truth["wall"]
    rows = [
        (name, re.sub(r"wall \d+\.\d s", f"wall {session_wall} s", text) if name == "throughput" else text)
        for name, text in console_rows(console)
    ]
    assert stated_by_summary(rows) != truth
    markdown = render_markdown(load_run(run), None).replace("1 rejoined, 1 promoted from a warm spare", "2 rejoined")
    assert stated_by_report(markdown) != truth
    snapshot = RunView.from_run_dir(run).snapshot()
    for column in snapshot["goodput"].values():
        if isinstance(column, list):
            del column[-1]  # the whole account, appended once the run ended
    assert stated_by_status_json(snapshot)["goodput"] != truth["goodput"]


# -- synthetic records: what a run cannot be made to do on demand ---------------------------------------------------
class Records:
    """A run's records made by hand: one step a second, 0.1 s after the previous commit."""

    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t
        self.records: list[dict[str, Any]] = []
        self.epoch = 0

    def add(self, kind: RecordKind, wait: float = 0.0, **fields: Any) -> dict[str, Any]:
        self.t += wait
        record = make(kind, self.t, **fields)
        self.records.append(record)
        return record

    def session(self, members: list[int], relaunch: bool = False, resume: int | None = None) -> None:
        self.add(RecordKind.COORDINATOR, 1.0, incarnation=str(self.t), restored_epoch=0, address="-", status="-")
        if relaunch:
            self.add(RecordKind.RESTART, 0.1, workers=members, stop_and_relaunch_s=2.0)
        if resume is not None:
            self.add(RecordKind.RESUME, 0.1, step=resume, path="-")
        self.membership(members, "start")

    def membership(self, members: list[int], reason: str) -> None:
        self.epoch += 1
        self.add(RecordKind.MEMBERSHIP, 0.01, epoch=self.epoch, members=members, reason=reason, elapsed_s=0.0)

    def reform(self, step: int, alive: int, missing: list[int]) -> None:
        """The group re-formed from the epoch before the newest onto the newest."""
        times = {"time_reformed": self.t + 0.005, "time_recovered": self.t + 0.01, "state_bytes": 0}
        self.add(RecordKind.RECOVERY, 0.01, step=step, from_epoch=self.epoch - 1, epoch=self.epoch, alive=alive,
                 reform_s=0.005, missing=missing, **times)  # fmt: skip

    def steps(self, first: int, last: int, alive: int) -> None:
        for step in range(first, last + 1):
            self.add(RecordKind.STEP, 1.1, step=step, loss=5.0, lr=1e-3, grad_norm=1.0, step_time_s=1.0, tokens=64,
                     tokens_per_s=64.0, alive=alive, epoch=self.epoch, microbatches=4, committed=True, recomputed=0,
                     dropped=0, recoveries=0, efficient=0)  # fmt: skip


def _views(records: list[dict[str, Any]], tmp_path: Path, total: int) -> dict[str, dict[str, str]]:
    """The figures the summary, the report and the status (its panel and its JSON) state of ``records``."""
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    view = RunView(total_steps=total)
    view.extend(records)
    return {
        "summary": stated_by_summary(summary_rows(RunFacts.of(records), total)),
        "report": stated_by_report(render_markdown(load_run(run), None)),
        "status": stated_by_status(_status_text(view)),
        "status --json": stated_by_status_json(view.snapshot()),
    }


@pytest.mark.timeout(30)
def test_a_relaunch_counts_the_time_the_job_was_down_and_a_resume_does_not(tmp_path: Path) -> None:
    """Three sessions: a launch killed after step 5, a restart policy's relaunch from step 4 (its down time is the
    run's wall time: the job was restarting), a ``--resume`` an hour after that session ended (not the run's)."""
    r = Records()
    r.session([0, 1])
    r.steps(0, 5, alive=2)
    r.add(RecordKind.STOPPED, 0.5, reason="worker 1 died")
    r.t += 3.0  # down, restarting
    r.session([0, 1], relaunch=True, resume=4)
    r.steps(4, 7, alive=2)
    r.add(RecordKind.FINAL, 0.2, step=8, checksums={"0": "a", "1": "a"}, identical=True, checkpoint="-")
    r.t += 3600.0  # the run had ended
    r.session([0, 1], resume=8)
    r.steps(8, 9, alive=2)
    r.add(RecordKind.FINAL, 0.2, step=10, checksums={"0": "a", "1": "a"}, identical=True, checkpoint="-")

    truth = expected(r.records)
    facts = RunFacts.of(r.records)
    spans = [s.wall_s for s in facts.sessions]
    down = facts.sessions[1].begin - facts.sessions[0].end  # type: ignore[operator]
    assert facts.wall_s == pytest.approx(sum(spans) + down) and 3.0 < down < 3600.0
    assert account(facts).wall_s == facts.wall_s  # the goodput's wall is the same
    assert truth["wall"] == f"{facts.wall_s:.1f}" and truth["sessions"] == "3"
    for view, figures in _views(r.records, tmp_path, 10).items():
        assert figures == truth, (view, figures, truth)


@pytest.mark.timeout(30)
def test_a_spare_is_a_promotion_everywhere_even_when_its_record_comes_after_its_join(tmp_path: Path) -> None:
    """Worker 1 dies in step 3; spare 0 is promoted to its place and joins at step 5 (its ``spare`` record, the
    agent's, reaches the file after the join); worker 2 dies in step 7 and rejoins itself at step 9. Every view
    says one spare promoted and one rejoin."""
    r = Records()
    r.session([0, 1, 2])
    r.steps(0, 2, alive=3)
    r.membership([0, 2], "died: 1")
    r.add(RecordKind.FAILURE, 0.01, worker=1, why="process killed by SIGKILL", epoch=r.epoch)
    r.reform(3, alive=2, missing=[1])
    promoted_at = r.t + 0.01
    r.steps(3, 4, alive=2)
    r.membership([0, 1, 2], "joined: 1")
    r.reform(5, alive=3, missing=[0, 1, 2, 3])
    r.records.append(make(RecordKind.SPARE, promoted_at, spare=0, state=SpareState.PROMOTED, worker=1, pid=7))
    r.steps(5, 6, alive=3)
    r.membership([0, 1], "died: 2")
    r.add(RecordKind.FAILURE, 0.01, worker=2, why="process killed by SIGKILL", epoch=r.epoch)
    r.reform(7, alive=2, missing=[2])
    r.steps(7, 8, alive=2)
    r.membership([0, 1, 2], "joined: 2")
    r.reform(9, alive=3, missing=[0, 1, 2, 3])
    r.steps(9, 9, alive=3)
    r.add(RecordKind.FINAL, 0.2, step=10, checksums={"0": "a", "1": "a", "2": "a"}, identical=True, checkpoint="-")

    (promotion,) = RunFacts.of(r.records).promotions
    assert promotion.join is not None and (promotion.join.epoch, promotion.join.step) == (3, 5)
    views = _views(r.records, tmp_path, 10)
    for figures in views.values():
        assert (figures["failures"], figures["recoveries"], figures["rejoins"], figures["promotions"]) == (
            "2", "2", "1", "1"
        ), figures  # fmt: skip
    report = render_markdown(load_run(tmp_path / "run"), None)
    rows = report.splitlines()
    assert [row.split(" | ")[0] for row in rows if re.match(r"\| worker \d", row)] == ["| worker 2"]  # the rejoins
    died = next(x["time"] for x in r.records if x["type"] == RecordKind.FAILURE and x["worker"] == 1)
    joined = next(x["time"] for x in r.records if x["type"] == RecordKind.MEMBERSHIP and x["epoch"] == 3)
    spares = [row for row in rows if re.match(r"\| spare \d", row)]
    assert spares == [f"| spare 0 | worker 1 | {joined - died:.2f} s | 5 |"]


@pytest.mark.timeout(30)
def test_every_event_on_the_timeline_is_a_sentence() -> None:
    """Each kind of record but a user's own (shown as its fields, which is how the check tells one from a
    sentence), an evaluation and a goodput record (curves, not events) is said in words: an ``admitted`` record,
    for one, names the worker, its host and its start."""
    facts = RunFacts()
    values = {"members": [0, 1], "workers": [0, 1], "checksums": {"0": "a"}, "changes": [], "fingerprint": {}}
    values |= {"missing": [1], "suspects": [1], "reported": [0]}
    for kind in RecordKind:
        fields = {name: values.get(name, 1) for name in FIELDS[kind]}
        if kind is RecordKind.ERROR:
            fields |= {"phase": "step", "microbatch": None, "exception": "E", "message": "m", "file": "f.py"}
            fields |= {"function": "g", "traceback": "t"}
        if kind is RecordKind.SPARE:
            fields |= {"state": SpareState.PROMOTED}
        if kind is RecordKind.STEP:
            fields |= {"committed": False}
        record = make(kind, 1_800_000_000.0, **fields)
        facts.add(record)
        said = entry(record, facts)
        if kind in (RecordKind.EVAL, RecordKind.GOODPUT):
            assert said is None, kind
            continue
        assert said is not None and said["text"], kind
        raw = said["text"].startswith("{")
        assert raw == (kind is RecordKind.USER), (kind, said["text"])
    start = {"start_s": 0.5, "start_cpu_s": 0.1, "forked": True}
    admitted = make(RecordKind.ADMITTED, 1.0, worker=3, host="hostB", fingerprint={}, **start)
    assert entry(admitted, facts)["text"] == "worker 3 registered from hostB, started in 0.50 s (forked)"  # type: ignore[index]


# A record's kind compared as a string: ``r["type"] == "step"``, ``r.get("type") != "eval"``.
KINDS = "|".join(RecordKind)
STRING_KIND = re.compile(rf"""(\[["']type["']\]|\.get\(["']type["'][^)]*\))\s*(==|!=)\s*["']({KINDS})["']""")


@pytest.mark.timeout(30)
def test_no_record_is_compared_with_its_kind_as_a_string() -> None:
    """Records are compared by ``RecordKind`` only: no ``== "step"`` on a record's type anywhere in the package
    (the pattern is shown to find such a comparison)."""
    assert STRING_KIND.search('if r["type"] == "step":') and STRING_KIND.search('r.get("type") != "eval"')
    assert not STRING_KIND.search('if r["type"] == RecordKind.STEP:')
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted((ROOT / "unbroken").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if STRING_KIND.search(line)
    ]
    assert found == [], "\n".join(found)
