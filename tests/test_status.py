"""The live view of a run: the JSON model folded from metrics records, the status server and its access rule,
the page in a real headless browser, the terminal view, and TensorBoard events written while a run goes.

The oracle is the run itself: its failure schedule (who is killed, at which step), the records the run
wrote (what the view must show, not recompute), and the rules of the page (loopback or the job's token).
Nothing here measures time.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console
from runner import run_command, train

from unbroken.control.status.model import MetricsTee, RunView
from unbroken.control.status.progress import print_summary
from unbroken.control.status.server import StatusServer, is_trusted_local
from unbroken.control.status.terminal import base_url, fetch_snapshot, render, run_status, sparkline
from unbroken.core.goodput import Tracker, account
from unbroken.core.records import MetricsFile, RecordKind, make, read_records
from unbroken.core.runfacts import RunFacts
from unbroken.lab.report import load_run, render_markdown

TOKEN = "0123456789abcdef" * 4
KILL = "kill:worker=1,step=3,phase=backward,rejoin=2"
LOSS_RGB = (0x1F, 0x6F, 0xEB)  # COLORS.loss in static/status.js


def _strict_json(text: str | bytes) -> Any:
    """JSON as a browser's JSON.parse reads it: NaN or Infinity is an error."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _get(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def synthetic_run(steps: int = 40, kill_step: int = 3, rejoin_step: int = 24) -> list[dict[str, Any]]:
    """The records of a 3-worker run shaped like a real one (``unbroken train`` with ``KILL`` and a rejoin):
    worker 1 is killed in step ``kill_step``'s backward, the two others re-form and recompute its
    microbatch, it rejoins at ``rejoin_step``. The launcher's ``injected`` record arrives after the failure,
    as it can in a real run; step 5 is re-published by a new leader (no timing: NaN)."""
    t = 1_800_000_000.0
    out: list[dict[str, Any]] = []

    def add(kind: str, **fields: Any) -> None:
        nonlocal t
        t += 0.01
        out.append({"type": kind, "time": t, **fields})

    members = [0, 1, 2]
    add("membership", epoch=1, members=members, reason="start", elapsed_s=3.4)
    for step in range(steps):
        if step == kill_step:
            members = [0, 2]
            add("membership", epoch=2, members=members, reason="died: 1", elapsed_s=3.8)
            add("failure", worker=1, why="process killed by SIGKILL", epoch=2, event=KILL, detection_s=0.02)
            out.append({"type": "injected", "time": t - 0.02, "worker": 1, "event": KILL, "kind": "kill"})
            add("recovery", step=step, from_epoch=1, epoch=2, alive=2, reform_s=0.015, missing=[2], time_reformed=t)
        if step == rejoin_step:
            members = [0, 1, 2]
            add("membership", epoch=3, members=members, reason="joined: 1", elapsed_s=6.7)
            add(
                "recovery",
                step=step,
                from_epoch=2,
                epoch=3,
                alive=3,
                reform_s=0.01,
                missing=[0, 1, 2, 3],
                time_reformed=t,
            )
        quotas = {"0": 2, "1": 1, "2": 1} if len(members) == 3 or step == kill_step else {"0": 2, "2": 2}
        add(
            "step",
            step=step,
            loss=9.0 - 0.06 * step,
            lr=0.003,
            grad_norm=1.5,
            step_time_s=0.13 if step == kill_step else 0.07,
            tokens=512,
            tokens_per_s=512 / 0.07,
            alive=len(members),
            epoch=3 if step >= rejoin_step else 2 if step >= kill_step else 1,
            microbatches=4,
            committed=True,
            recomputed=1 if step == kill_step else 0,
            dropped=0,
            recoveries=1 if step == kill_step else 0,
            efficient=0,
            quotas=quotas,
        )
        if step == 5:
            out.append({**out[-1], "step_time_s": float("nan"), "tokens_per_s": float("nan"), "republished": True})
        if (step + 1) % 4 == 0:
            add("eval", step=step, val_loss=8.0 - 0.05 * step, val_ppl=100.0)
            add("checkpoint", step=step + 1, path=f"/runs/x/checkpoints/step_{step + 1:08d}.pt", seconds=0.1)
    add("final", step=steps, checksums={"0": "ab", "1": "ab", "2": "ab"}, identical=True, checkpoint="x")
    return out


# -- the model ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_a_kill_and_a_rejoin_make_one_incident_with_every_phase() -> None:
    records = synthetic_run()
    view = RunView(total_steps=40)
    for r in records:
        view.write(r)
    s = _strict_json(json.dumps(view.snapshot(), allow_nan=False))

    assert s["seq"] == len(records)
    assert s["run"]["state"] == "finished"
    assert s["run"]["steps_done"] == 40
    assert s["run"]["members"] == [0, 1, 2]
    assert [r["step"] for r in records if r["type"] == "step" and not r.get("republished")] == s["series"]["step"]
    (inc,) = s["incidents"]
    failure = next(r for r in records if r["type"] == "failure")
    injected = next(r for r in records if r["type"] == "injected")
    recovery = next(r for r in records if r["type"] == "recovery")
    rejoin = next(r for r in records if r["type"] == "membership" and r["epoch"] == 3)
    assert inc["worker"] == 1 and inc["event"] == KILL and inc["why"] == failure["why"]
    assert inc["step"] == 3  # the step in progress when it failed: the first one without a record
    assert inc["injected_at"] == injected["time"]  # the launcher's record, though it came last
    assert inc["detection_s"] == failure["detection_s"]
    assert (inc["recovery_step"], inc["reform_s"], inc["missing"]) == (3, recovery["reform_s"], [2])
    assert (inc["recomputed"], inc["dropped"]) == (1, 0)
    assert (inc["rejoined_at"], inc["rejoin_epoch"], inc["rejoin_step"]) == (rejoin["time"], 3, 24)
    assert inc["down_s"] == rejoin["time"] - injected["time"]
    kinds = [e["kind"] for e in s["timeline"]]
    assert kinds.index("injected") < kinds.index("failure")  # shown in time order
    assert [w["state"] for w in s["workers"]] == ["alive", "alive", "alive"]
    assert [w["failures"] for w in s["workers"]] == [0, 1, 0]
    assert [c["step"] for c in s["checkpoints"]] == list(range(4, 41, 4))


@pytest.mark.timeout(10)
def test_a_join_is_counted_apart_from_recoveries_everywhere(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One kill and one rejoin are two re-formations (two ``recovery`` records), of which only the first is a
    recovery: the page and ``unbroken status``, the summary and the report all say 1 recovered, 1 rejoined,
    and none claims a re-formation time for the rejoin."""
    records = synthetic_run()
    assert len([r for r in records if r["type"] == "recovery"]) == 2
    view = RunView(total_steps=40)
    view.extend(records)
    s = view.snapshot()
    assert (s["run"]["failures"], s["run"]["recoveries"], s["run"]["joins"]) == (1, 1, 1)
    (join,) = [e for e in s["timeline"] if e["kind"] == "join"]
    assert join["text"] == "worker 1 rejoined at step 24: epoch 2 -> 3, 3 alive"
    console = Console(record=True, width=100)
    console.print(render(s, 100))
    assert "1 failed, 1 recovered, 1 rejoined" in console.export_text()

    facts = RunFacts.of(records)
    assert [r.reform_s for r in facts.recoveries] == [0.015]
    # the group of the failure's epoch, formed after the epoch's publication (the join's is not a recovery's)
    published = next(r["time"] for r in records if r["type"] == "membership" and r["epoch"] == 2)
    reformed = next(r["time_reformed"] for r in records if r["type"] == "recovery")
    assert [r.formed_after_epoch_s for r in facts.recoveries] == [reformed - published]
    assert [(j.rejoined, j.step, j.epoch) for j in facts.rejoins] == [([1], 24, 3)]
    assert {f.worker for f in facts.declared_failures} <= set(facts.members or ())  # every failed worker is back
    print_summary(tmp_path, records, 40)
    text = capsys.readouterr().out
    row = " ".join(line.split("│")[2].strip() for line in text.splitlines() if line.count("│") == 3)
    formed = f"{(reformed - published) * 1000:.0f} ms"
    assert f"1 recovery: group re-formed {formed} after its epoch at most, the survivors waiting 15 ms for it" in row
    older = [{k: v for k, v in r.items() if k != "time_reformed"} for r in records]  # records before the field
    assert [r.formed_after_epoch_s for r in RunFacts.of(older).recoveries] == [None]
    print_summary(tmp_path, older, 40)
    assert "1 recovery: group re-formed in 15 ms at most" in capsys.readouterr().out
    assert "worker 1 at step 24 (epoch 3): members [0, 1, 2]" in text and "not rejoined" not in text

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = render_markdown(load_run(run_dir), None)
    assert "1 recovered in-step, 1 rejoined" in report
    assert "| worker 1 | " in report and "survivors waited" in report.split("| rejoined |")[0]
    rejoined_table = report.split("| rejoined |")[1]
    assert "survivors waited" not in rejoined_table and "formed after epoch" not in rejoined_table


@pytest.mark.timeout(10)
def test_a_promoted_spare_is_shown_on_the_page_and_named_in_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The synthetic run with warm spares: spare 0 ready from the start, promoted to worker 1 right after its
    death (which then rejoins at step 24), and spare 1 started in its stead, killed while it waited and replaced by
    spare 2. The page counts 1 starting and 1 promoted spare and its timeline says who took whose place and which
    spare ended; the summary names the promotion, how long after
    the death the spare was in the group, and the step it computes from, instead of a plain rejoin."""
    records = synthetic_run()
    start = records[0]["time"]
    failure = next(r for r in records if r["type"] == "failure")
    records += [
        {"type": "spare", "time": start, "spare": 0, "state": "started", "worker": -1, "pid": 11},
        {"type": "spare", "time": start + 0.001, "spare": 0, "state": "ready", "worker": -1, "pid": 11},
        {"type": "spare", "time": failure["time"] + 0.05, "spare": 0, "state": "promoted", "worker": 1, "pid": 11},
        {"type": "spare", "time": failure["time"] + 0.06, "spare": 1, "state": "started", "worker": -1, "pid": 12},
        {"type": "spare", "time": failure["time"] + 0.5, "spare": 1, "state": "exited", "worker": -1, "pid": 12}
        | {"why": "killed by SIGKILL"},
        {"type": "spare", "time": failure["time"] + 0.51, "spare": 2, "state": "started", "worker": -1, "pid": 13},
    ]
    view = RunView(total_steps=40)
    view.extend(sorted(records, key=lambda r: r["time"]))
    s = view.snapshot()
    assert s["run"]["spares"] == {"started": 1, "ready": 0, "promoted": 1}  # the one that ended is not waiting
    spares = [(x["spare"], x["state"], x["worker"]) for x in s["spares"]]
    assert spares == [(0, "promoted", 1), (1, "exited", -1), (2, "started", -1)]
    assert [e["text"] for e in s["timeline"] if e["kind"] == "spare"] == [
        "spare 0 takes the place of worker 1",
        "spare 1 ended while it waited (killed by SIGKILL)",
    ]
    (promotion,) = RunFacts.of(records).promotions  # its record last in the list: after the join it made
    assert promotion.spare == 0 and promotion.worker == 1 and promotion.join is not None
    assert (promotion.join.step, promotion.join.epoch) == (24, 3)
    joined = next(r for r in records if r["type"] == "membership" and r["epoch"] == 3)
    assert promotion.after_death_s == pytest.approx(joined["time"] - failure["time"])
    print_summary(tmp_path, records, 40)
    text = capsys.readouterr().out
    # the table wraps its cells: the rows' text, their lines joined
    row = " ".join(line.split("│")[2].strip() for line in text.splitlines() if line.count("│") == 3)
    since = f"{joined['time'] - failure['time']:.2f} s"
    assert (
        f"spare 0 took worker 1's place in the group {since} after its death, computing from step 24 (epoch 3)" in row
    )
    assert "rejoined" not in text


@pytest.mark.timeout(10)
def test_a_spare_that_joins_before_the_survivors_reform_computes_from_the_interrupted_step() -> None:
    """A warm spare can be admitted within the step its worker died in, before the survivors re-form without
    it (seen in `unbroken train configs/default.toml --workers 4 --spares 1`): the one re-formation then goes
    from epoch 1 to epoch 3, whose members are the same, a recovery and a join at once. The summary still
    says the spare computes from that step. The agent promotes the spare as soon as it sees the exit, so its
    record comes before the coordinator's failure record; the time is the death's to the join's."""
    t = 1_800_000_000.0
    records = [
        {"type": "membership", "time": t, "epoch": 1, "members": [0, 1, 2], "reason": "start", "elapsed_s": 1.0},
        {"type": "spare", "time": t + 9.99, "spare": 0, "state": "promoted", "worker": 1, "pid": 7},
        {"type": "membership", "time": t + 10, "epoch": 2, "members": [0, 2], "reason": "died: 1", "elapsed_s": 11.0},
        {"type": "failure", "time": t + 10, "worker": 1, "why": "process killed by SIGKILL", "epoch": 2},
        {"type": "membership", "time": t + 10.05, "epoch": 3, "members": [0, 1, 2], "reason": "joined: 1",
         "elapsed_s": 0},
        {"type": "recovery", "time": t + 11, "step": 20, "from_epoch": 1, "epoch": 3, "alive": 3, "reform_s": 0.3,
         "missing": [4, 5]},
    ]  # fmt: skip
    (promotion,) = RunFacts.of(records).promotions
    assert promotion.join is not None and (promotion.join.step, promotion.join.epoch) == (20, 3)
    assert promotion.after_death_s == pytest.approx(0.05)


@pytest.mark.timeout(10)
def test_the_summary_counts_microbatches_in_mecefos_approximate_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = [{**r, "efficient": 2} if r["type"] == "step" and 4 <= r["step"] <= 6 else r for r in synthetic_run()]
    print_summary(tmp_path, records, 40)
    assert "6 microbatches in efficient mode, in steps 4-6" in capsys.readouterr().out


@pytest.mark.timeout(10)
def test_a_finished_run_says_a_worker_did_not_rejoin_rather_than_not_yet() -> None:
    records = synthetic_run(rejoin_step=100)  # the rejoin would come after the last step
    view = RunView(total_steps=40)
    view.extend(records)
    console = Console(record=True, width=100)
    console.print(render(view.snapshot(), 100))
    text = console.export_text()
    assert "no (run" in text and "not yet" not in text
    view = RunView(total_steps=40)
    view.extend(records[:-1])  # the same run before its end: the worker may still come back
    console = Console(record=True, width=100)
    console.print(render(view.snapshot(), 100))
    assert "not yet" in console.export_text()


@pytest.mark.timeout(10)
def test_a_dead_worker_is_shown_dead_until_it_rejoins() -> None:
    records = synthetic_run()
    rejoin = next(i for i, r in enumerate(records) if r["type"] == "membership" and r["epoch"] == 3)
    view = RunView()
    view.extend(records[:rejoin])
    s = view.snapshot()
    assert s["run"]["state"] == "training"
    assert s["run"]["members"] == [0, 2] and s["run"]["expected_workers"] == 3
    assert [(w["id"], w["state"]) for w in s["workers"]] == [(0, "alive"), (1, "dead"), (2, "alive")]
    assert s["workers"][1]["last_failure"] == "process killed by SIGKILL"
    assert s["workers"][1]["quota"] is None and s["workers"][0]["quota"] == 2
    assert s["incidents"][0]["rejoined_at"] is None


@pytest.mark.timeout(10)
def test_curves_are_thinned_evenly_and_keep_the_newest_step() -> None:
    view = RunView(max_points=100)
    for step in range(1000):
        view.write({"type": "step", "step": step, "loss": float(step), "time": 1.0 + step})
    series = view.snapshot()["series"]
    assert len(series["step"]) <= 101
    assert series["step"][0] == 0 and series["step"][-1] == 999
    gaps = {b - a for a, b in zip(series["step"][:-2], series["step"][1:-1], strict=True)}
    assert gaps == {series["stride"]}
    assert series["loss"] == [float(x) for x in series["step"]]


@pytest.mark.timeout(10)
def test_a_replayed_step_replaces_the_old_ones() -> None:
    """A resumed run repeats the steps after its checkpoint: the later records win."""
    view = RunView()
    for step in range(10):
        view.write({"type": "step", "step": step, "loss": 1.0, "tokens": 1})
    view.write({"type": "resume", "step": 6, "path": "ckpt"})
    for step in range(6, 8):
        view.write({"type": "step", "step": step, "loss": 2.0, "tokens": 1})
    series = view.snapshot()["series"]
    assert series["step"] == list(range(8))
    assert series["loss"] == [1.0] * 6 + [2.0] * 2


@pytest.mark.timeout(10)
def test_stragglers_come_from_the_published_speeds() -> None:
    """Workers publish seconds per microbatch (``speeds``); one 3x slower than the others is a straggler.
    Without speeds nothing is claimed."""
    base = {"type": "step", "step": 0, "loss": 1.0, "quotas": {"0": 2, "1": 1, "2": 1}}
    view = RunView()
    view.write({"type": "membership", "epoch": 1, "members": [0, 1, 2], "reason": "start"})
    view.write(base)
    assert [w["straggler"] for w in view.snapshot()["workers"]] == [None, None, None]
    view.write({**base, "step": 1, "speeds": {"0": 0.1, "1": 0.1, "2": 0.3}})
    workers = view.snapshot()["workers"]
    assert [w["straggler"] for w in workers] == [False, False, True]
    assert workers[2]["compute_s"] == pytest.approx(0.3 * 1)  # its quota times its speed


@pytest.mark.timeout(10)
def test_the_state_says_slow_only_for_a_fail_slow_verdict_not_for_one_slow_step() -> None:
    """A straggler of the last step is a hint (a yellow row); the state "slow" is the fail-slow rule's verdict
    (a ``slow`` record), kept until its ``recovered`` record."""
    base = {"type": "step", "step": 0, "loss": 1.0, "quotas": {"0": 1, "1": 1, "2": 1}}
    view = RunView()
    view.write({"type": "membership", "epoch": 1, "members": [0, 1, 2], "reason": "start"})
    view.write({**base, "speeds": {"0": 0.1, "1": 0.1, "2": 0.3}})

    def states() -> list[str]:
        text = Console(record=True, width=80)
        text.print(render(view.snapshot(), 80))
        return re.findall(r"^ *\d +(alive|slow|dead) ", text.export_text(), re.M)

    assert [w["straggler"] for w in view.snapshot()["workers"]] == [False, False, True]
    assert states() == ["alive", "alive", "alive"]
    slow = {"type": "slow", "worker": 2, "step": 29, "relative": 3.0, "threshold": 1.5, "windows": 3}
    view.write({**slow, "state": "slow", "decision": "report"})
    assert [w["fail_slow"] for w in view.snapshot()["workers"]] == [False, False, True]
    assert states() == ["alive", "alive", "slow"]
    view.write({**slow, "step": 39, "relative": 1.0, "windows": 0, "state": "recovered", "decision": "report"})
    assert states() == ["alive", "alive", "alive"]


@pytest.mark.timeout(10)
def test_the_tee_feeds_the_views_and_survives_a_broken_one(tmp_path: Path) -> None:
    """What the coordinator writes reaches metrics.jsonl and the view; a sink that raises is dropped."""

    class Broken:
        def write(self, record: Any) -> None:
            raise RuntimeError("boom")

    records = synthetic_run()
    view = RunView()
    tee = MetricsTee(MetricsFile(tmp_path), Broken(), view)
    tee.write(records[0])
    tee.write_line(json.dumps(records[1]))
    tee.write_line('{"type": "step", "st')  # torn by a dying writer: the file keeps it, the view skips it
    tee.close()
    assert read_records(tmp_path) == records[:2]
    assert view.seq == 2 and len(tee.sinks) == 1


# -- the server ---------------------------------------------------------------------------------------------
def with_goodput(records: list[dict[str, Any]], every: int = 10) -> list[dict[str, Any]]:
    """``records`` with the coordinator's ``goodput`` records (core.goodput.Tracker) after the steps that make them."""
    tracker, out = Tracker(every), []
    for r in records:
        out.append(r)
        if (fields := tracker.add(r)) is not None:
            out.append(make(RecordKind.GOODPUT, r["time"], **fields))
    return out


@pytest.fixture
def finished_view() -> RunView:
    view = RunView(total_steps=40, run_dir="/runs/x")
    view.extend(with_goodput(synthetic_run()))
    return view


@pytest.mark.timeout(180)
def test_a_real_run_with_a_kill_shows_the_failure_and_the_reformed_group(tmp_path: Path, data_cache_dir: Path) -> None:
    """``unbroken train tests/tiny.toml --workers 3`` with worker 1 killed in step 3's backward, its
    metrics.jsonl served by the status server: the JSON shows that kill and the group without worker 1."""
    out = tmp_path / "run"
    result = train(out, data_cache_dir, f"--failures.schedule={KILL}", "--train.steps=20", workers=3)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_records(out)
    with StatusServer(RunView.from_run_dir(out)) as server:
        code, body = _get(f"{server.url}api/status")
    assert code == 200
    s = _strict_json(body)

    start = next(r for r in records if r["type"] == "membership")
    assert s["run"]["state"] == "finished" and s["run"]["total_steps"] == 20 and s["run"]["steps_done"] == 20
    assert s["run"]["expected_workers"] == len(start["members"]) == 3
    (inc,) = s["incidents"]
    assert inc["worker"] == 1 and inc["event"] == KILL and inc["why"]
    reformed = [e for e in s["timeline"] if e["kind"] == "membership" and e["epoch"] == inc["epoch"]]
    assert reformed and reformed[0]["members"] == [w for w in start["members"] if w != 1]
    assert inc["epoch"] > start["epoch"]
    recovery = next(r for r in records if r["type"] == "recovery")
    step3 = next(r for r in records if r["type"] == "step" and r["step"] == 3)
    assert inc["recovery_step"] == 3 and inc["missing"] == recovery["missing"]
    assert inc["recomputed"] == step3["recomputed"]
    # Under `recover` the killed worker's share is redone: in the same step (recomputed >= 1), or by the whole step
    # computed again by the survivors in the new epoch (recomputed 0 and recoveries 0 in a clean run, r98: the
    # timing of the kill decides which); either way every microbatch is counted once and none is dropped.
    assert step3["counted"] == step3["microbatches"] and step3["counted_once"] and step3["dropped"] == 0
    worker1 = s["workers"][1]
    assert worker1["failures"] == 1
    if inc["rejoined_at"] is None:  # rejoin=2 (seconds) may come after the run's last step
        assert worker1["state"] == "dead" and 1 not in s["run"]["members"]
    else:
        assert worker1["state"] == "alive" and 1 in s["run"]["members"]


@pytest.mark.timeout(30)
def test_a_long_poll_answers_with_the_next_record() -> None:
    view = RunView()
    view.extend(synthetic_run()[:10])
    before = view.seq
    got: dict[str, Any] = {}
    with StatusServer(view) as server:
        poller = threading.Thread(
            target=lambda: got.update(fetch_snapshot(server.address, since=before, wait_s=20)), daemon=True
        )
        poller.start()
        view.write({"type": "user", "note": "hello", "time": 2e9})
        poller.join()
    assert got["seq"] == before + 1
    assert got["timeline"][-1]["kind"] == "user" and "hello" in got["timeline"][-1]["text"]


@pytest.mark.timeout(30)
def test_requests_past_the_limit_are_refused_not_queued() -> None:
    """With the one slot held by a long-poll, the next request is answered 503 at once (it holds no thread).
    The server accepts connections in the order they were made, so the long-poll's comes first."""
    view = RunView()
    view.extend(synthetic_run()[:10])
    with StatusServer(view, max_clients=1) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as held:
            held.sendall(f"GET /api/status?since={view.seq}&wait=20 HTTP/1.0\r\n\r\n".encode())
            assert _get(f"{server.url}api/status")[0] == 503
            view.write({"type": "user", "time": 2e9})
            answer = b""
            while chunk := held.recv(65536):
                answer += chunk
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.0 200") and _strict_json(body)["seq"] == 11


def _non_loopback_ip() -> str | None:
    """An address of this machine that is not loopback (the route a datagram would take; nothing is sent)."""
    for probe in ("192.0.2.1", "10.255.255.255"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                ip = s.getsockname()[0]
        except OSError:
            continue
        if not ip.startswith("127."):
            return ip
    return None


@pytest.mark.timeout(30)
def test_another_host_needs_the_token(finished_view: RunView, caplog: pytest.LogCaptureFixture) -> None:
    ip = _non_loopback_ip()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address (the injected check below still runs)")
    caplog.set_level(logging.DEBUG, logger="unbroken.control.status.server")
    with StatusServer(finished_view, host="0.0.0.0", token=TOKEN) as server:
        remote = f"http://{ip}:{server.port}"
        assert _get(f"{remote}/api/status")[0] == 401
        assert _get(f"{remote}/")[0] == 401
        assert _get(f"{remote}/api/status", {"Authorization": "Bearer " + "x" * 64})[0] == 401
        assert _get(f"{remote}/api/status?token={'x' * 64}")[0] == 401
        assert _get(f"{remote}/api/status?token={TOKEN[:-1]}")[0] == 401
        code, body = _get(f"{remote}/api/status", {"Authorization": f"Bearer {TOKEN}"})
        assert code == 200 and _strict_json(body)["seq"] == finished_view.seq
        assert _get(f"{remote}/api/status?token={TOKEN}")[0] == 200
        assert _get(f"{remote}/?token={TOKEN}")[0] == 200
        assert _get(f"{remote}/static/uPlot.iife.min.js")[0] == 200  # the library, no run data
        assert _get(f"{remote}/static/../status.py")[0] == 404
        assert _get(f"{remote}/api/status", {"Authorization": f"Bearer {TOKEN}"}, method="POST")[0] == 501
        assert _get(f"http://127.0.0.1:{server.port}/api/status")[0] == 200  # loopback: no token needed
    assert TOKEN not in caplog.text


@pytest.mark.timeout(30)
def test_untrusted_clients_are_refused_without_the_token(finished_view: RunView) -> None:
    """The same rule with the loopback check injected: every client is treated as remote."""
    with StatusServer(finished_view, token=TOKEN, trusted=lambda ip, host: False) as server:
        assert _get(f"{server.url}api/status")[0] == 401
        assert _get(f"{server.url}api/status", {"Authorization": f"Bearer {TOKEN}"})[0] == 200
    with StatusServer(finished_view, token=None, trusted=lambda ip, host: False) as server:
        assert _get(f"{server.url}api/status?token={TOKEN}")[0] == 401  # no token configured: nobody remote
    with StatusServer(finished_view) as server:  # a loopback client naming the server by a DNS name
        assert _get(f"{server.url}api/status", {"Host": f"rebound.example:{server.port}"})[0] == 401
    with pytest.raises(ValueError, match="needs the job's token"):
        with StatusServer(finished_view, token=TOKEN, trusted=lambda ip, host: False) as server:
            fetch_snapshot(server.address)


@pytest.mark.timeout(10)
def test_loopback_is_trusted_only_by_address() -> None:
    assert is_trusted_local("127.0.0.1", "127.0.0.1:8000")
    assert is_trusted_local("::1", "[::1]:8000")
    assert is_trusted_local("::ffff:127.0.0.1", "localhost:8000")
    assert is_trusted_local("127.0.0.1", None)
    assert not is_trusted_local("127.0.0.1", "attacker.example:8000")
    assert not is_trusted_local("192.0.2.7", "127.0.0.1:8000")
    assert base_url("host:29500") == "http://host:29500"
    assert base_url("[::1]:29500") == "http://[::1]:29500"
    with pytest.raises(ValueError):
        base_url("host")


# -- the page in a browser ----------------------------------------------------------------------------------
def _browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _chromium(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",  # tests may run as root
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--window-size=1280,1600",
        "--virtual-time-budget=10000",
        *args,
    ]
    return run_command(cmd, capture_output=True, text=True, timeout=60)


def _loss_coloured_pixels(png: Path) -> int:
    """Pixels close to the train-loss stroke colour (anti-aliased edges included)."""
    image = pytest.importorskip("PIL.Image").open(png).convert("RGB")
    pixels = np.frombuffer(image.tobytes(), dtype=np.uint8).reshape(-1, 3).astype(np.int32)
    return int((np.abs(pixels - np.array(LOSS_RGB)).sum(axis=1) < 60).sum())


@pytest.mark.timeout(120)
def test_the_page_renders_in_a_headless_browser(finished_view: RunView, tmp_path: Path) -> None:
    browser = _browser()
    if browser is None:
        pytest.skip("no headless browser installed (apt-get install chromium)")
    empty = RunView(total_steps=40)
    records = synthetic_run()
    empty.extend([records[0], records[-1]])  # started and finished, no step: nothing to draw
    with StatusServer(finished_view) as server, StatusServer(empty) as control:
        dom = _chromium(browser, tmp_path / "profile", "--dump-dom", server.url)
        assert dom.returncode == 0, dom.stderr[-2000:]
        drawn = _chromium(browser, tmp_path / "profile", f"--screenshot={tmp_path / 'run.png'}", server.url)
        blank = _chromium(browser, tmp_path / "profile", f"--screenshot={tmp_path / 'empty.png'}", control.url)
    assert drawn.returncode == 0 and blank.returncode == 0, (drawn.stderr[-2000:], blank.stderr[-2000:])

    html = dom.stdout
    assert f'data-seq="{finished_view.seq}"' in html and 'data-state="finished"' in html  # the script ran
    assert html.count("<canvas") >= 3  # uPlot made the loss, step-time and goodput charts
    assert '<div class="k">goodput (of the ideal)</div>' in html and "tokens/s committed" in html
    assert KILL in html and "process killed by SIGKILL" in html  # the incident table
    assert "epoch 2: members [0, 2] (died: 1)" in html  # the timeline
    # the summary cards: a rejoin is not a recovery; the checkpoint is shown by the last step it holds
    assert '<div class="k">failed / recovered / rejoined</div><div class="v">1 / 1 / 1</div>' in html
    assert '<div class="k">last checkpoint</div><div class="v">after step 39</div>' in html
    # The loss curve is drawn on the canvas: the page of the run has far more pixels of its colour than the
    # same page for a run with no step (where only the legend's swatch has it): 40 steps span the ~1100 px
    # wide plot, so the 2-px line alone covers over 2000 px, and at least a quarter of them keep its colour.
    assert _loss_coloured_pixels(tmp_path / "run.png") > _loss_coloured_pixels(tmp_path / "empty.png") + 500


# -- the terminal -------------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_the_terminal_view_shows_the_same_facts(finished_view: RunView, tmp_path: Path) -> None:
    console = Console(record=True, width=120, force_terminal=False)
    with StatusServer(finished_view) as server:
        assert run_status(server.address, once=True, console=console) == 0
    text = console.export_text()
    assert "finished" in text and "40 of 40" in text
    assert "process killed by SIGKILL" in text and "worker 1 rejoined at step 24" in text and "(epoch 3)" in text
    assert "epoch 3: members [0, 1, 2] (joined: 1)" in text
    # the run has ended: its goodput row is the run's whole account (the summary's and the report's), not the
    # coordinator's last periodic record
    whole = account(with_goodput(synthetic_run()))
    newest = [r for r in with_goodput(synthetic_run()) if r["type"] == "goodput"][-1]
    assert f"{whole.tokens_per_s:,.0f} tokens/s, {100 * whole.ratio:.1f} % of the ideal" in text
    assert f"{100 * whole.ratio:.1f}" != f"{100 * newest['ratio']:.1f}"  # the check tells the two apart

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in synthetic_run()) + '{"type": "st')
    console = Console(record=True, width=120)
    assert run_status(str(run_dir), as_json=True, console=console) == 0
    assert _strict_json(console.export_text())["run"]["steps_done"] == 40  # the torn last line is skipped


@pytest.mark.timeout(10)
def test_a_fail_slow_worker_fits_80_columns_whole() -> None:
    """A fail-slow worker (its state reads "slow") next to a dead one with a long last failure, in 80 columns:
    no line is longer and nothing ends in an ellipsis."""
    view = RunView(total_steps=40)
    view.extend(synthetic_run())
    snapshot = view.snapshot()
    for w in snapshot["workers"]:
        if w["state"] == "alive":
            w.update(fail_slow=True, straggler=True, s_per_microbatch=12.345, compute_s=123.456)
            break
    else:
        raise AssertionError("no alive worker in the synthetic run")
    console = Console(record=True, width=80)
    console.print(render(snapshot, 80))
    text = console.export_text()
    assert re.search(r"^ *\d +slow +\d\d:\d\d:\d\d ", text, re.M), text
    assert max(map(len, text.splitlines())) <= 80 and "…" not in text, text


@pytest.mark.timeout(10)
def test_sparkline_marks_failures_under_their_step() -> None:
    line, first, last = sparkline(list(range(10)), [float(10 - i) for i in range(10)], 10)
    assert (line[0], line[-1], first, last) == ("█", "▁", 0, 9)
    console = Console(record=True, width=60)
    view = RunView()
    view.extend(synthetic_run(steps=30, kill_step=3, rejoin_step=24))
    console.print(render(view.snapshot(), 60))
    text = console.export_text()
    assert "x failed, + rejoined" in text
    # the curve, its labels and its marks each on one line of the width: nothing wraps
    (curve,) = [line for line in text.splitlines() if line.startswith("loss ")]
    assert curve.endswith("(steps 0-29)") and len(curve) <= 60
    marks = text.splitlines()[text.splitlines().index(curve) + 1]
    assert marks.endswith("x failed, + rejoined") and len(marks) <= 60
    spark = curve.split()[2]
    assert marks.index("x") - curve.index(spark) == 3 * len(spark) // 30  # under step 3's cell


# -- TensorBoard --------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_live_tensorboard_can_be_read_while_the_run_goes(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from unbroken.control.status.tensorboard import LiveTensorBoard

    records = synthetic_run()
    kill = next(i for i, r in enumerate(records) if r["type"] == "failure")
    tb = LiveTensorBoard(tmp_path, flush_s=0)
    try:
        for r in records[:kill]:
            tb.write(r)
        events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
        events.Reload()
        before = [r for r in records[:kill] if r["type"] == "step"]
        loss = events.Scalars("train/loss")
        assert [e.step for e in loss] == [r["step"] for r in before]
        assert [e.value for e in loss] == pytest.approx([r["loss"] for r in before], rel=1e-6)
        assert [e.wall_time for e in loss] == pytest.approx([r["time"] for r in before])
        assert "recovery/detection_s" not in events.Tags()["scalars"]

        for r in records[kill:]:
            tb.write(r)
        events.Reload()  # the same reader, the writer still open: the rest is there
        assert {e.step for e in events.Scalars("train/loss")} == {r["step"] for r in records if r["type"] == "step"}
        assert [e.value for e in events.Scalars("recovery/detection_s")] == pytest.approx([0.02])
        assert [e.step for e in events.Scalars("val/loss")] == [r["step"] for r in records if r["type"] == "eval"]
        assert [e.value for e in events.Scalars("membership/members")] == [3, 2, 3]
        goodput = [r for r in with_goodput(records) if r["type"] == "goodput"]
        for r in goodput:
            tb.write(r)
        events.Reload()
        assert [e.step for e in events.Scalars("goodput/ratio")] == [r["step"] for r in goodput]
        assert [e.value for e in events.Scalars("badput_s/start")] == pytest.approx(
            [r["buckets"]["start"] for r in goodput], rel=1e-6
        )
    finally:
        tb.close()
