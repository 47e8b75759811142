"""Surviving worker failures without a restart, with real processes and real SIGKILL / SIGSTOP.

The oracle is the failure-free run: with ``reduction = "exact"`` a run that loses workers mid-step (and
gets one back) must be bitwise identical to it at every step, before the kills and after; in fp32 bitwise up to
and including the step of the first kill, the last step that is derivable (the test says why); under ``drop`` it
must diverge.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runner import FP32_STEPS, RECOVERY_SCHEDULE, RECOVERY_STEPS, final_params, recomputed_by_the_recoveries, train

from unbroken.core.failures import FailureKind, FailureSchedule
from unbroken.core.records import read_records, step_losses

pytestmark = pytest.mark.timeout(300)


def test_exact_mode_with_kills_and_rejoin_is_bitwise_the_failure_free_run(recovery_runs: dict[str, Path]) -> None:
    ref, run = recovery_runs["exact_ref"], recovery_runs["exact_failures"]
    failures = read_records(run, "failure")
    assert [f["worker"] for f in failures] == [2, 1]
    memberships = [tuple(m["members"]) for m in read_records(run, "membership")]
    assert memberships == [(0, 1, 2, 3), (0, 1, 3), (0, 3), (0, 2, 3)]  # worker 2 came back
    recoveries = read_records(run, "recovery")
    # Worker 1 dies in step 6's reduction: the survivors recover in step 6, or in 7 when its contribution had
    # already gone out and they committed 6 before noticing.
    steps_recovered = {r["step"] for r in recoveries}
    assert 5 in steps_recovered and steps_recovered & {6, 7}
    ref_losses, losses = step_losses(ref), step_losses(run)
    assert sorted(losses) == sorted(ref_losses) == list(range(RECOVERY_STEPS))  # every step, those after the kills
    assert all(losses[s] == ref_losses[s] for s in ref_losses), "losses differ from the failure-free run"
    ref_params, params = final_params(ref), final_params(run)
    assert all(torch.equal(params[k], ref_params[k]) for k in ref_params)
    final = read_records(run, "final")[0]
    assert final["identical"] and sorted(final["checksums"]) == ["0", "2", "3"]  # the rejoined worker agrees
    # every committed step counted each of its M microbatches exactly once, recomputing what its recoveries found
    # lost (worker 2's microbatches, and worker 1's when its contribution had not gone out)
    steps = read_records(run, "step")
    assert all(r["dropped"] == 0 for r in steps)
    recomputed_by_the_recoveries(run)


def test_fp32_mode_with_failures_commits_every_step_once_and_agrees_up_to_the_failure(
    recovery_runs: dict[str, Path],
) -> None:
    """fp32 sums the survivors' gradients in another order than the failure-free run, so from the first
    failure on the two may differ in the last bits. That difference is bounded for one step's reduced gradient
    (the summation bound, checked in tests/test_protocol.py), but not in the steps after it: Adam divides each
    update by the root of the gradient's second moment, which may be as small as its epsilon, so an update is not
    a Lipschitz function of its gradient with a constant a test can derive, and each step's difference feeds the
    next. What is derivable: up to and including the step of the first kill, the losses are forward passes of
    identical parameters and must be equal, and every step must count each microbatch exactly once."""
    ref_losses, losses = step_losses(recovery_runs["fp32_ref"]), step_losses(recovery_runs["fp32_failures"])
    assert sorted(losses) == sorted(ref_losses) == list(range(FP32_STEPS))
    first_kill = min(e.step for e in FailureSchedule.parse(RECOVERY_SCHEDULE).events if e.kind is FailureKind.KILL)
    assert all(losses[s] == ref_losses[s] for s in range(first_kill + 1))
    steps = read_records(recovery_runs["fp32_failures"], "step")
    assert all(r["dropped"] == 0 for r in steps)
    # A step known only from its republished record (the leader took a new epoch mid-step and received the state
    # of the step the others committed: r116) carries no counts of its own; every other record says each microbatch
    # was counted once.
    assert all(r["counted_once"] for r in steps if not r.get("republished"))
    assert read_records(recovery_runs["fp32_failures"], "final")[0]["identical"]


def test_drop_policy_visibly_diverges(recovery_runs: dict[str, Path]) -> None:
    ref_losses, losses = step_losses(recovery_runs["exact_ref"]), step_losses(recovery_runs["drop_failures"])
    dropped = {r["step"]: r["dropped"] for r in read_records(recovery_runs["drop_failures"], "step") if r["dropped"]}
    assert dropped == {5: 1, 6: 1}
    assert all(losses[s] == ref_losses[s] for s in range(5))  # bitwise identical until the first failure
    divergence = max(abs(losses[s] - ref_losses[s]) for s in range(5, 50))
    assert divergence > 1e-3, divergence
    ref_params, params = final_params(recovery_runs["exact_ref"]), final_params(recovery_runs["drop_failures"])
    assert max(float((params[k] - ref_params[k]).abs().max()) for k in ref_params) > 1e-4


def test_sigstopped_worker_is_excluded_and_a_slow_worker_gets_fewer(tmp_path: Path, data_cache_dir: Path) -> None:
    out = tmp_path / "hang"
    result = train(
        out,
        data_cache_dir,
        "--train.steps=14",
        "--train.microbatches=8",
        "--checkpoint.every=0",
        "--comm.heartbeat_timeout_s=1.0",
        "--recovery.workload=throughput",
        "--failures.schedule=slow:worker=1,seconds=0.2,steps=1-13; hang:worker=2,step=8",
        workers=3,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    failure = read_records(out, "failure")[0]
    assert failure["worker"] == 2 and "no heartbeat" in failure["why"]
    assert sorted(read_records(out, "final")[0]["checksums"]) == ["0", "1"]
    steps = {r["step"]: r for r in read_records(out, "step")}
    assert sorted(steps) == list(range(14))
    # The slowed worker's measured speed steers the plan: over steps 4-7 it is given fewer microbatches than each
    # other worker. Summed over the four steps, not step by step: a survivor held off the CPU by the other pytest
    # process for a microbatch's time measures as slow as the slowed one for that step (r64: {0: 1, 1: 1, 2: 6} at
    # step 6; r69: {0: 6, 1: 1, 2: 1}), where the slowed one is slow at every step.
    totals = {w: sum(steps[s]["quotas"][w] for s in range(4, 8)) for w in ("0", "1", "2")}
    assert totals["1"] < min(totals["0"], totals["2"]), {s: steps[s]["quotas"] for s in range(4, 8)}


def test_last_survivor_finishes_alone(tmp_path: Path, data_cache_dir: Path) -> None:
    out = tmp_path / "alone"
    result = train(
        out,
        data_cache_dir,
        "--train.steps=10",
        "--checkpoint.every=0",
        "--failures.schedule=kill:worker=1,step=2,phase=forward; kill:worker=2,step=4,phase=optimizer",
        workers=3,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(step_losses(out)) == list(range(10))
    assert [tuple(m["members"]) for m in read_records(out, "membership")][-1] == (0,)
    final = read_records(out, "final")[0]
    assert list(final["checksums"]) == ["0"]


def test_a_scheduled_kill_of_the_last_alive_member_is_skipped(tmp_path: Path, data_cache_dir: Path) -> None:
    """Worker 0 is down (back only after the run) when worker 1's kill comes: killing it would lose the
    training state, so the launcher spares it, records why, and the run finishes on worker 1."""
    out = tmp_path / "spared"
    result = train(
        out,
        data_cache_dir,
        "--train.steps=10",
        "--checkpoint.every=0",
        "--failures.schedule=kill:worker=0,step=2,phase=backward,rejoin=600; kill:worker=1,step=5,phase=forward",
        workers=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(step_losses(out)) == list(range(10))
    assert [f["worker"] for f in read_records(out, "failure")] == [0]
    skipped = read_records(out, "injection_skipped")
    assert [(s["worker"], s["event"]) for s in skipped] == [(1, "kill:worker=1,step=5,phase=forward")]
    assert [tuple(m["members"]) for m in read_records(out, "membership")] == [(0, 1), (1,)]


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ("kill:worker=7,step=2", "worker 7 does not exist"),
        ("kill:worker=1,step=100", "step past the end"),
        ("kill:worker=0,step=1; kill:worker=1,step=2", "kills every worker (2) and none rejoins"),
        ("explode:worker=1,step=2", "unknown kind 'explode'"),
        ("kill:worker=1,step=2,phase=lunch", "unknown phase 'lunch'"),
    ],
)
def test_invalid_schedules_are_refused_before_anything_starts(
    tmp_path: Path, data_cache_dir: Path, schedule: str, message: str
) -> None:
    out = tmp_path / "run"
    result = train(out, data_cache_dir, f"--failures.schedule={schedule}", workers=2)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not out.exists()
