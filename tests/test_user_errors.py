"""A deterministic error in the user's code is a bug, not a hardware failure: the rule that tells them apart
(``core.bugs``), the place a worker's report names (``ft.crash``), and real launches of a script with a bug in
it (tests/scripts/raising_loop.py, 3 worker processes): an error that repeats on the worker its microbatch is
re-planned to stops the job with one line and keeps the last good state; an error on one worker only is
survived like a kill, bitwise. Exact reduction and one intra-op thread per worker make a run's parameters
independent of the worker count (tests/test_train.py), so the oracle is a one-worker run of the same script."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runner import EXACT, ONE_THREAD, ROOT, free_port, run_command, unbroken

from unbroken.control.coordinator import bugs
from unbroken.control.store.gateway import TOKEN_ENV, new_token
from unbroken.core.records import ErrorPhase, RecordKind, WorkerError, committed_steps, make, read_records
from unbroken.ft import crash
from unbroken.ft.checkpoint import schema as ckpt

SCRIPT = ROOT / "tests" / "scripts" / "raising_loop.py"
STEPS, M = 10, 6
COMMON = [EXACT, ONE_THREAD, f"--train.steps={STEPS}", f"--train.microbatches={M}"]
VERDICT = "the same error on 2 workers: a bug, not a failure"


def _line_of(text: str) -> int:
    """The line of the script that holds ``text`` (its only occurrence)."""
    (number,) = [n for n, line in enumerate(SCRIPT.read_text().splitlines(), 1) if text in line]
    return number


def launch(out: Path, *args: str, workers: int, quiet: bool = True) -> subprocess.CompletedProcess[str]:
    """``unbroken launch --fork``: how a worker starts is not what these tests are about, so each is forked from
    the launcher's zygote instead of importing torch (seconds of CPU). ``quiet``: no progress lines."""
    cmd = [sys.executable, "-m", "unbroken", "launch", "--workers", str(workers), "--out", str(out)]
    cmd += ["--quiet"] if quiet else []
    return run_command([*cmd, "--fork", *COMMON, *args], capture_output=True, text=True, timeout=280)


def same_model(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- the rule -----------------------------------------------------------------------------------------------
def error(worker: int, step: int = 5, microbatch: int | None = 3, **changes: object) -> WorkerError:
    fields: dict[str, object] = {
        "worker": worker,
        "exception": "RuntimeError",
        "message": f"bad value on worker {worker}",
        "file": f"/home/host{worker}/train.py",  # hosts may hold the script under different paths
        "line": 32,
        "function": "loss_fn",
        "phase": ErrorPhase.MICROBATCH if microbatch is not None else ErrorPhase.BETWEEN_STEPS,
        "step": step,
        "microbatch": microbatch,
        "traceback": "Traceback ...",
    }
    return WorkerError(**{**fields, **changes})  # type: ignore[arg-type]


def test_an_error_repeats_only_at_the_same_place_on_another_worker_for_the_same_work() -> None:
    first = error(1)
    assert bugs.repeated([], first) == []  # one error: a flaky host, survived
    assert bugs.repeated([first], error(1)) == []  # the same worker again (restarted on its bad host)
    again = error(2)
    assert bugs.repeated([first], again) == [first, again]  # the re-planned microbatch raised again
    assert bugs.repeated([first], error(2, microbatch=4)) != []  # another microbatch of the same step
    assert bugs.repeated([first], error(2, step=6)) == []  # another step's microbatch: not the same work
    for change in ({"line": 33}, {"exception": "ValueError"}, {"function": "forward"}, {"file": "/a/model.py"}):
        assert bugs.repeated([first], error(2, **change)) == [], change  # not the same place
    # Code outside the microbatches (rank 0's logging after a commit): the next worker to take rank 0 reaches the
    # same line at a later step.
    logged = error(0, step=9, microbatch=None)
    assert bugs.repeated([logged], error(1, step=19, microbatch=None)) != []
    assert bugs.repeated([logged], error(1, step=19)) == []  # one of them in a microbatch of another step
    # Several earlier ones: each worker once, the first it raised, then the new one.
    third = error(3)
    assert bugs.repeated([first, error(1, microbatch=4), again], third) == [first, again, third]


def test_the_stop_line_names_the_exception_the_place_and_the_work() -> None:
    line = bugs.stop_line(bugs.repeated([error(1)], error(2)))
    assert "\n" not in line
    assert line.startswith("RuntimeError (bad value on worker 2) at train.py:32 in loss_fn, step 5, microbatch 3")
    assert "workers 1, 2" in line and line.endswith(VERDICT)


# -- the place a worker's report names ----------------------------------------------------------------------
def test_the_report_names_the_innermost_frame_of_the_users_code() -> None:
    here = Path(__file__).name
    try:
        make(RecordKind.STEP, 0.0, step=1)  # raises inside the library (core/records.py)
    except AssertionError as e:
        report = crash.describe(e, 3, ErrorPhase.BETWEEN_STEPS, 7, None)
    this = test_the_report_names_the_innermost_frame_of_the_users_code.__name__
    assert (Path(report.file).name, report.function) == (here, this)
    assert report.exception == "AssertionError" and report.message.startswith("step record lacks")
    assert report.headline().startswith(f"AssertionError at {here}:") and ", after step 7: " in report.headline()
    assert report.traceback.splitlines()[-1].startswith("AssertionError: step record lacks")
    assert 'File "' in report.traceback and "records.py" in report.traceback  # the last frames, the library's too

    def loss_fn() -> torch.Tensor:
        return torch.nn.functional.cross_entropy(torch.zeros(2, 3), torch.zeros(5, dtype=torch.long))

    try:
        loss_fn()  # raises inside torch's Python code (an installed package)
    except ValueError as e:
        report = crash.describe(e, 0, ErrorPhase.MICROBATCH, 2, 1)
    assert (report.function, report.line) == ("loss_fn", loss_fn.__code__.co_firstlineno + 1)
    assert report.where() == "step 2, microbatch 1"

    class CustomError(Exception):
        pass

    try:
        raise CustomError("x" * 1000)
    except CustomError as e:
        report = crash.describe(e, 0, ErrorPhase.SETUP, -1, None)
    assert report.exception.endswith(".CustomError") and len(report.message) == crash.MESSAGE_CHARS
    assert report.where() == "before the first step"


# -- real launches ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The script without its bug, on one worker, keeping the state of every step."""
    out = tmp_path_factory.mktemp("user_errors") / "reference"
    result = launch(out, "--checkpoint.every=1", f"--checkpoint.keep={STEPS}", str(SCRIPT), workers=1)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.timeout(600)
def test_a_bug_that_raises_again_where_its_microbatch_is_replanned_stops_the_job(
    tmp_path: Path, reference: Path
) -> None:
    """Microbatch 3 of step 5 raises in its backward on whichever worker computes it: the first worker is
    survived like a kill, the one the microbatch is re-planned to raises the same, and the job stops with one
    line, printed once (with the progress lines on), which names the last good checkpoint by the steps the
    console shows (from 0). No periodic checkpoint is due in 10 steps (checkpoint.every = 0): a worker that did
    not raise saves the state of the last committed step, which must be the failure-free run's state there."""
    out = tmp_path / "run"
    result = launch(out, "--checkpoint.every=0", str(SCRIPT), "--raise", "microbatch", workers=3, quiet=False)
    assert result.returncode == 1, result.stderr[-3000:]
    raised = read_records(out, "error")
    assert [(e["exception"], e["step"], e["microbatch"], e["phase"]) for e in raised] == [
        ("RuntimeError", 5, 3, "microbatch")
    ] * 2
    assert len({e["worker"] for e in raised}) == 2
    line_number = _line_of('raise RuntimeError("corrupt microbatch')
    assert {(Path(e["file"]).name, e["line"], e["function"]) for e in raised} == {
        ("raising_loop.py", line_number, "backward")
    }
    # Each traceback on the console, its last frames and the message.
    console = result.stderr
    for e in raised:
        assert f"worker {e['worker']} raised RuntimeError at raising_loop.py:{line_number} in backward" in console
    assert console.count('raise RuntimeError("corrupt microbatch: its gradient cannot be computed")') == 2
    assert console.count("\n  RuntimeError: corrupt microbatch: its gradient cannot be computed\n") == 2
    # One line says what, where and why the job stopped, and which checkpoint is the last good one: once, on
    # stderr (the progress lines on stdout tell the story up to it, and do not say it again).
    assert (result.stdout + console).count(VERDICT) == 1, result.stdout[-3000:]
    (line,) = [x for x in console.splitlines() if VERDICT in x]
    assert line.startswith(f"unbroken: error: RuntimeError (corrupt microbatch: its gradient cannot be computed) at "
                           f"raising_loop.py:{line_number} in backward, step 5, microbatch 3")  # fmt: skip
    found = re.search(r"the last good checkpoint is the state after step (\d+) \(--resume continues at step (\d+)\)$",
                      line)  # fmt: skip
    assert found is not None, line
    last, saved = int(found[1]), int(found[2])
    assert last == max(committed_steps(read_records(out))) == 4 and saved == 5  # steps 0-4 committed, step 5 never
    assert re.search(r"^step 5 goes on with 2 workers \(epoch 2\)", result.stdout, re.M), result.stdout[-3000:]
    assert same_model(ckpt.verify(out, saved)["model"], ckpt.verify(reference, saved)["model"])
    assert read_records(out, "stopped")[-1]["reason"] == line.removeprefix("unbroken: error: ")
    assert not read_records(out, "final")


@pytest.mark.timeout(600)
def test_an_error_on_one_worker_only_is_survived_like_a_kill(tmp_path: Path, reference: Path) -> None:
    """Worker 2 raises in step 5 (a bad host): the error is reported and shown, the others recompute its
    microbatches in the same step, and the run ends bitwise as the failure-free one."""
    out = tmp_path / "run"
    result = launch(out, "--checkpoint.every=0", str(SCRIPT), "--raise", "worker", workers=3)
    assert result.returncode == 0, result.stderr[-3000:]
    line_number = _line_of('raise ValueError(f"bad memory')
    (e,) = read_records(out, "error")
    assert (e["worker"], e["exception"], e["step"], e["phase"]) == (2, "ValueError", 5, "microbatch")
    assert (Path(e["file"]).name, e["line"], e["function"]) == ("raising_loop.py", line_number, "main")
    assert f"worker 2 raised ValueError at raising_loop.py:{line_number} in main, step 5" in result.stderr
    assert "\n  ValueError: bad memory on this host (worker 2)\n" in result.stderr
    assert "a bug, not a failure" not in result.stderr
    (failure,) = read_records(out, "failure")
    assert failure["worker"] == 2 and failure["why"].startswith(f"raised ValueError at raising_loop.py:{line_number}")
    steps = committed_steps(read_records(out))
    assert list(steps) == list(range(STEPS))
    assert all(r["counted"] == M and r["counted_once"] for r in steps.values())  # every microbatch once
    final = read_records(out, "final")[0]
    assert final["identical"] and sorted(final["checksums"]) == ["0", "1"]
    assert same_model(ckpt.verify(out, STEPS)["model"], ckpt.verify(reference, STEPS)["model"])


@pytest.mark.timeout(600)
def test_a_bug_in_code_that_rank_0_runs_stops_the_job_when_the_next_rank_0_reaches_it(
    tmp_path: Path, reference: Path
) -> None:
    """Rank 0's logging after steps 3, 7, ... raises (the issue's first day). Worker 0 raises after step 3 and is
    survived; worker 1, now rank 0, raises after step 7: the same error, the job stops. Nobody who did not
    raise is left, so worker 1, whose error came after its commit, saves the state of step 8."""
    out = tmp_path / "run"
    result = launch(out, "--checkpoint.every=0", str(SCRIPT), "--raise", "rank0", workers=2)
    assert result.returncode == 1, result.stderr[-3000:]
    line_number = _line_of("validation {logged['val_loss']")
    raised = read_records(out, "error")
    assert [(e["worker"], e["step"], e["phase"], e["microbatch"]) for e in raised] == [
        (0, 3, "between_steps", None),
        (1, 7, "between_steps", None),
    ]
    assert {(e["exception"], e["line"], e["function"]) for e in raised} == {("KeyError", line_number, "log_progress")}
    (line,) = [x for x in result.stderr.splitlines() if VERDICT in x]
    assert line == (
        f"unbroken: error: KeyError ('val_loss') at raising_loop.py:{line_number} in log_progress, after step 7, "
        f"on workers 0, 1: {VERDICT}; the last good checkpoint is the state after step 7 (--resume continues at step 8)"
    )
    assert max(committed_steps(read_records(out))) == 7
    assert same_model(ckpt.verify(out, 8)["model"], ckpt.verify(reference, 8)["model"])


@pytest.mark.timeout(600)
def test_a_bug_that_every_rank_of_a_replica_raises_stops_the_job(tmp_path: Path) -> None:
    """A replica of two FSDP ranks whose optimizer step raises on both (a bug in code every rank runs, as the fused
    AdamW did when given DTensors and plain tensors together). An error inside a replica may be a replica-mate's
    death: each rank waits for that news a heartbeat or two, not the replica's collective timeout (4 x
    comm.op_timeout_s: 40 minutes here, past this run's bound, so the old wait fails the test). The job stops with
    one line and the error on the console. Which line depends on whether the second rank's report reaches the
    coordinator before the first one's removes the whole replica: the bug's (the same error on 2 workers) or
    "every worker died"."""
    out = tmp_path / "run"
    result = launch(
        out, "--parallel.shard=2", "--comm.op_timeout_s=600", str(SCRIPT), "--raise", "optimizer", workers=2
    )
    assert result.returncode == 1, result.stderr[-3000:]
    line_number = _line_of('raise RuntimeError("the optimizer')
    raised = read_records(out, "error")
    assert raised and {e["worker"] for e in raised} <= {0, 1}
    assert {(e["exception"], e["step"], e["phase"], e["line"], e["function"]) for e in raised} == {
        ("RuntimeError", 5, "commit", line_number, "step")
    }
    assert f"raised RuntimeError at raising_loop.py:{line_number} in step, step 5, in its commit" in result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("unbroken: error: ")]
    assert VERDICT in line or "every worker died" in line, line
    assert "a replica-mate is gone" not in result.stderr  # the bug was not taken for a death
    assert max(committed_steps(read_records(out))) == 4 and not read_records(out, "final")


@pytest.mark.timeout(600)
def test_under_per_host_agents_the_coordinator_judges_and_records_the_errors(tmp_path: Path, reference: Path) -> None:
    """Two hosts' agents of one worker each and a coordinator of its own (``unbroken coordinator``): the workers
    report to the coordinator, not to their agents, so it records both errors, shows them on its console,
    stops the job and names the checkpoint the worker that raised last saved (nobody else is left)."""
    env = {**os.environ, TOKEN_ENV: new_token()}
    port, run = free_port(), tmp_path / "run"
    coordinator = unbroken("coordinator", "--workers", "2", "--port", str(port), "--run-dir", str(run), *COMMON,
                           "--checkpoint.every=0", env=env, log=tmp_path / "coordinator.log")  # fmt: skip
    agent_args = ["agent", "--coordinator", f"127.0.0.1:{port}", "--workers", "1", "--fork"]
    command = [str(SCRIPT), "--raise", "microbatch"]
    agents = [
        unbroken(*agent_args, "--node-rank", str(r), *command, env=env, log=tmp_path / f"agent-{r}.log") for r in (0, 1)
    ]
    try:
        assert coordinator.wait(timeout=400) == 1, (tmp_path / "coordinator.log").read_text()[-3000:]
        assert all(agent.wait(timeout=60) != 0 for agent in agents)
    finally:
        for p in (coordinator, *agents):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    raised = read_records(run, "error")
    assert sorted(e["worker"] for e in raised) == [0, 1] and {e["microbatch"] for e in raised} == {3}
    reason = read_records(run, "stopped")[-1]["reason"]
    saved = "the last good checkpoint is the state after step 4 (--resume continues at step 5)"
    assert VERDICT in reason and reason.endswith(f"; {saved}")
    console = (tmp_path / "coordinator.log").read_text()
    assert console.count("\n  RuntimeError: corrupt microbatch: its gradient cannot be computed\n") == 2
    assert f"stopped: {reason}" in console
    assert same_model(ckpt.verify(run, 5)["model"], ckpt.verify(reference, 5)["model"])
