"""Faults a real cluster produces beyond a clean kill, each survived correctly or stopped cleanly (real processes).

- a non-finite gradient (NaN, infinity) in one microbatch: the step is skipped on every replica alike, and
  the trajectory is bitwise that of a run that skips the step by construction; or the run stops with one
  line and its last good checkpoint intact; too many skips in a row stop it too;
- a gradient too large for the exact mode's fixed point: the scale grows and the step is redone; the scale is
  replicated state, so a kill and rejoin and a stop and ``--resume`` after it change nothing;
- a member that stalls inside the reduction while its heartbeats go on: re-formed once, then excluded;
- the leader killed while writing the final checkpoint: the new leader writes it, and the run reports success
  only with a final checkpoint that verifies and equals the failure-free run's.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from runner import EXACT, ONE_THREAD, TINY, final_params, popen, reference_run, run_command, train, train_cmd

from unbroken.control.status.progress import summary_rows
from unbroken.core.config import load_config
from unbroken.core.plan import plan_step
from unbroken.core.records import read_records, step_losses
from unbroken.core.runfacts import RunFacts
from unbroken.ft.checkpoint import schema as ckpt

pytestmark = pytest.mark.timeout(300)

# With exact reduction a run's trajectory does not depend on how many workers compute it (tests/test_train.py),
# so the failure-free reference is a one-worker run, and each faulted run uses the fewest workers its claim
# needs: two, three where a majority must be left after excluding one.
WORKERS = 2


@pytest.fixture(scope="module")
def exact_reference(tmp_path_factory: pytest.TempPathFactory, data_cache_dir: Path) -> Path:
    """The failure-free run (exact reduction, ``tests/tiny.toml``'s 8 steps) with a checkpoint after every
    step, that the faulted runs below are compared with (how often it checkpoints cannot change its
    trajectory: resuming from any checkpoint reproduces the run, tests/test_train.py)."""
    return reference_run(tmp_path_factory, "faults", data_cache_dir, EXACT, ONE_THREAD, "--checkpoint.every=1",
                         "--checkpoint.keep=8")  # fmt: skip


def first_of_worker_1(step: int) -> int:
    """The first microbatch id worker 1 computes in ``step`` of a failure-free run of WORKERS workers: the one a
    ``nan:worker=1`` or ``inf:worker=1`` event poisons."""
    return plan_step(step, range(WORKERS), load_config(TINY).train.microbatches).ids[1][0]


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]


def test_a_nan_skips_the_step_like_a_run_that_skips_it_by_construction(
    tmp_path: Path, data_cache_dir: Path, exact_reference: Path
) -> None:
    skipped = tmp_path / "nan"
    result = train(
        skipped, data_cache_dir, EXACT, ONE_THREAD, "--failures.schedule=nan:worker=1,step=3", workers=WORKERS
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_records(skipped, "nonfinite_skip")
    assert [(r["step"], r["workers"]) for r in records] == [(3, [1])]
    assert records[0]["microbatches"] == [first_of_worker_1(3)]
    steps = {r["step"]: r for r in read_records(skipped, "step")}
    assert steps[3]["skipped"] and not steps[3]["committed"] and not steps[4]["skipped"]
    rows = dict(summary_rows(RunFacts.of(read_records(skipped)), 0))
    assert rows["skipped steps"].startswith("[3] (a non-finite gradient")  # the run summary names the step

    # By construction: the state entering step 3 of a clean run, relabelled as the state entering step 4 (no
    # optimizer step, the data of step 3 never used), and trained on from there.
    clean = exact_reference
    constructed = tmp_path / "constructed"
    constructed.mkdir()
    shutil.copy(clean / "config.toml", constructed / "config.toml")
    state = ckpt.verify(clean, 3)
    state = {**state, "step": 4, "ft": {**state["ft"], "nonfinite_streak": 1}}
    ckpt.save_checkpoint(constructed, 4, state, keep=8)
    result = run_command(
        train_cmd(data_cache_dir, "--resume", str(constructed), workers=WORKERS),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_params(final_params(skipped), final_params(constructed))
    losses, built = step_losses(skipped), step_losses(constructed)
    assert all(losses[s] == built[s] for s in range(4, 8))


@pytest.mark.parametrize("reduction", ["exact", "fp32"])
def test_an_infinity_never_crashes_and_is_skipped_everywhere(
    tmp_path: Path, data_cache_dir: Path, reduction: str
) -> None:
    out = tmp_path / "inf"
    result = train(
        out,
        data_cache_dir,
        f"--recovery.reduction={reduction}",
        "--failures.schedule=inf:worker=1,step=2",
        workers=WORKERS,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = read_records(out, "nonfinite_skip")
    assert record["step"] == 2 and record["workers"] == [1]
    assert record["parameter"]  # named: the first parameter whose gradient is not finite
    final = read_records(out, "final")[0]
    assert final["identical"] and len(final["checksums"]) == WORKERS


def test_nonfinite_stop_exits_with_one_line_and_keeps_the_last_checkpoint(tmp_path: Path, data_cache_dir: Path) -> None:
    out = tmp_path / "stop"
    result = train(
        out,
        data_cache_dir,
        EXACT,
        ONE_THREAD,
        "--train.nonfinite=stop",
        "--checkpoint.every=2",
        "--failures.schedule=nan:worker=1,step=5",
        workers=WORKERS,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "step 5" in lines[0] and f"microbatch {first_of_worker_1(5)}" in lines[0], lines[0]
    assert "layers." in lines[0], lines[0]
    assert ckpt.list_checkpoints(out) == [4, 2]  # nothing written after the bad step
    assert ckpt.load_latest(out).step == 4
    assert not read_records(out, "final")


def test_too_many_consecutive_skips_stop_the_run(tmp_path: Path, data_cache_dir: Path) -> None:
    out = tmp_path / "streak"
    poison = "; ".join(f"nan:worker=0,step={s}" for s in range(1, 5))
    result = train(
        out,
        data_cache_dir,
        EXACT,
        ONE_THREAD,
        "--train.max_nonfinite_skips=3",
        f"--failures.schedule={poison}",
        workers=WORKERS,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "3 consecutive steps skipped" in lines[0], lines
    assert [r["step"] for r in read_records(out, "nonfinite_skip")] == [1, 2, 3]


def test_the_fixed_point_scale_is_replicated_state(tmp_path: Path, data_cache_dir: Path) -> None:
    """A huge microbatch gradient at step 2 grows the exact mode's scale (the step is redone); then a worker
    is killed and rejoins, and the run is stopped and resumed: bitwise the uninterrupted run with the same
    huge gradient."""
    scale = "scale:step=2,microbatch=1,factor=1e9"
    common = [EXACT, ONE_THREAD, "--train.steps=12", "--checkpoint.every=2", "--checkpoint.keep=10"]
    reference = tmp_path / "reference"
    result = train(reference, data_cache_dir, *common, f"--failures.schedule={scale}", workers=1)
    assert result.returncode == 0, result.stderr[-3000:]
    redone = {r["step"]: r["overflow_redos"] for r in read_records(reference, "step")}
    assert redone[2] >= 1 and redone[0] == redone[1] == 0

    run = tmp_path / "interrupted"
    # Steps 9 to 11 paced (worker 0 computes each of its microbatches 0.5 s slower): the Ctrl-C after the
    # checkpoint of step 8 then lands before the last step on any machine (r81, idle: the run had finished).
    schedule = f"{scale}; kill:worker=1,step=4,phase=backward,rejoin=0.5; slow:worker=0,seconds=0.5,steps=9-11"
    proc = popen(
        train_cmd(data_cache_dir, TINY, "--out", str(run), *common, f"--failures.schedule={schedule}", workers=WORKERS),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 200
    while not any(r["step"] >= 8 for r in read_records(run, "checkpoint")):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be stopped"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert not read_records(run, "final"), "stopped too late to test --resume"
    result = run_command(
        train_cmd(data_cache_dir, "--resume", str(run), workers=WORKERS), capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [f["worker"] for f in read_records(run, "failure")][:1] == [1]
    assert_same_params(final_params(reference), final_params(run))
    assert step_losses(run) == step_losses(reference)
    assert ckpt.verify(run, 12)["ft"]["scale"] == ckpt.verify(reference, 12)["ft"]["scale"]


def test_a_member_that_stalls_in_the_reduction_is_re_formed_then_excluded(
    tmp_path: Path, data_cache_dir: Path, exact_reference: Path
) -> None:
    """Worker 1 blocks 15 s inside step 3's reduction while its heartbeats go on: the others' collective
    times out (2 s), the coordinator re-forms the same members; worker 1 stalls the re-formed group too, so
    it is declared failed and its microbatches are recomputed by the others in the same step."""
    reference = exact_reference
    out = tmp_path / "stall"
    schedule = "--failures.schedule=stall:worker=1,step=3,seconds=15"
    result = train(out, data_cache_dir, EXACT, ONE_THREAD, "--comm.op_timeout_s=2", schedule, workers=3)
    assert result.returncode == 0, result.stderr[-3000:]
    decisions = [(r["decision"], r["suspects"]) for r in read_records(out, "stall")]
    # A member that is only slow (still computing when the others timed out) may be a suspect of the first
    # round too; only one that stalls both rounds is excluded.
    assert decisions[0][0] == "re-form" and 1 in decisions[0][1], decisions
    assert decisions[-1] == ("exclude", [1]), decisions
    (failure,) = read_records(out, "failure")
    assert failure["worker"] == 1 and "stalled" in failure["why"]
    assert [tuple(m["members"]) for m in read_records(out, "membership")][-1] == (0, 2)
    assert step_losses(out) == step_losses(reference)
    assert_same_params(final_params(reference), final_params(out))


def test_the_leader_killed_while_writing_the_final_checkpoint(
    tmp_path: Path, data_cache_dir: Path, exact_reference: Path
) -> None:
    reference = exact_reference
    out = tmp_path / "final"
    result = train(
        out,
        data_cache_dir,
        EXACT,
        ONE_THREAD,
        "--failures.schedule=kill:worker=0,step=7,phase=checkpoint",
        workers=WORKERS,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [f["worker"] for f in read_records(out, "failure")] == [0]
    final = read_records(out, "final")[-1]
    assert final["step"] == 8 and sorted(final["checksums"]) == ["1"]
    assert_same_params(ckpt.verify(reference, 8)["model"], ckpt.verify(out, 8)["model"])
    problems, leftovers = ckpt.verify_all(out)
    assert not problems and not leftovers  # the dead writer's temporary file is gone
