"""MeCeFO in real 4-worker runs: a no-op without failures, and a neighbour takeover through a real kill.

The efficient backward itself (gradients, projections, Hugging Face models) is tested in test_efficient.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from runner import EXACT, ONE_THREAD, final_params, train

from unbroken.core.records import committed_steps, read_records, step_losses

pytestmark = pytest.mark.timeout(300)
FIXTURE_RUNS = {"runs": 4}  # trainings the module fixture runs (conftest adds their time to each test's bound)

# Worker 2 is killed in its backward pass at step 4 and restarted 1 s later, so several steps run with a
# neighbour (worker 3) doing worker 2's share in efficient mode before exact training resumes. Worker 0 computes
# 5x slower for 20 steps meanwhile: the restarted worker (a new Python process importing torch, then the state
# transfer) is back well before the last step even on a loaded machine, where its start slows as the steps do.
SCHEDULE = "kill:worker=2,step=4,phase=backward,rejoin=1.0; slow:worker=0,factor=5,steps=5-24"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data_cache_dir: Path) -> dict[str, Path]:
    """Every run in exact reduction with one intra-op thread, so that the trajectory does not depend on the number
    of workers: the failure-free plain one (the reference) by one worker and MeCeFO's by two; the runs with a kill
    by 4 workers, so that a neighbour takes over while others go on."""
    base = tmp_path_factory.mktemp("mecefo")
    common = ["--train.steps=40", "--checkpoint.every=0", "--train.microbatches=8", "--mecefo.rank=8"]
    exact = [EXACT, ONE_THREAD]
    out = {}
    for name, extra, workers in (
        ("recover", exact, 1),
        ("mecefo", [*exact, "--recovery.policy=mecefo"], 2),
        ("mecefo_kill", [*exact, "--recovery.policy=mecefo", f"--failures.schedule={SCHEDULE}"], 4),
        ("spread_kill", [*exact, "--recovery.policy=mecefo-spread", f"--failures.schedule={SCHEDULE}"], 4),
    ):
        result = train(base / name, data_cache_dir, *common, *extra, workers=workers)
        assert result.returncode == 0, (name, result.stderr[-3000:])
        out[name] = base / name
    return out


def test_without_failures_mecefo_is_bitwise_the_plain_run(runs: dict[str, Path]) -> None:
    assert step_losses(runs["mecefo"]) == step_losses(runs["recover"])
    assert all(r["efficient"] == 0 for r in read_records(runs["mecefo"], "step"))
    ref = final_params(runs["recover"])
    for name, tensor in final_params(runs["mecefo"]).items():
        assert torch.equal(tensor, ref[name]), name


@pytest.mark.parametrize("name", ["mecefo_kill", "spread_kill"])
def test_kill_and_rejoin_under_mecefo(runs: dict[str, Path], name: str) -> None:
    run = runs[name]
    assert [f["worker"] for f in read_records(run, "failure")] == [2]
    memberships = [tuple(m["members"]) for m in read_records(run, "membership")]
    assert memberships == [(0, 1, 2, 3), (0, 1, 3), (0, 1, 2, 3)]
    steps = committed_steps(read_records(run))
    assert sorted(steps) == list(range(40))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps.values())
    final = read_records(run, "final")[-1]
    assert final["identical"] and len(final["checksums"]) == 4
    # While worker 2 is down, its 2 microbatches are computed in efficient mode: with the neighbour taking
    # them, the neighbour's own 2 as well (4 per step); spread over the survivors, only the 2 adopted ones.
    per_step = 4 if name == "mecefo_kill" else 2
    down = [s for s, r in steps.items() if r["alive"] == 3 and r["recoveries"] == 0]
    assert down and all(steps[s]["efficient"] == per_step for s in down), {s: steps[s]["efficient"] for s in down}
    # Exact mode resumes once worker 2 is back; the last steps run with all four workers and no approximation.
    assert steps[39]["alive"] == 4 and steps[39]["efficient"] == 0
    # Exact reduction: what a step computes does not depend on who computed which microbatch, only on which ran in
    # efficient mode. Until the first such step (the kill's) the run is the failure-free MeCeFO run, and so are its
    # parameters entering that step: its loss, a forward that efficient mode computes bit for bit as the model does,
    # is the reference's too. Its update is not (low-rank FFN weight gradients, no attention gradients from the
    # efficient microbatches): from the next step on the losses differ.
    first = min(s for s, r in steps.items() if r["efficient"])
    assert first == 4  # the kill's step: worker 2 died in its backward
    ref, losses = step_losses(runs["mecefo"]), step_losses(run)
    assert [losses[s] for s in range(first + 1)] == [ref[s] for s in range(first + 1)]
    assert losses[first + 1] != ref[first + 1]


def test_approximate_steps_are_bitwise_the_same_whoever_takes_the_dead_worker_s_share(runs: dict[str, Path]) -> None:
    """In exact reduction a step's update, approximate or not, depends only on the parameters and on which
    microbatches ran in efficient mode (the bases too: a pure function of the weights and the step), not on who
    computed them. In the kill's step both policies compute the dead worker's 2 in efficient mode (the survivors had
    computed their own before they saw the death), one on the neighbour, the other spread over the survivors: the
    runs stay the same bit for bit through the next step's loss, and for as long as their efficient microbatches
    agree. They part at the first step where they do not (while worker 2 is down the neighbour computes its own 2
    in efficient mode too): the loss after it differs."""
    kill, spread = (committed_steps(read_records(runs[name])) for name in ("mecefo_kill", "spread_kill"))
    assert kill[4]["efficient"] == spread[4]["efficient"] == 2
    parted = next((s for s in sorted(kill) if kill[s]["efficient"] != spread[s]["efficient"]), None)
    assert parted is not None and parted > 4, {s: (kill[s]["efficient"], spread[s]["efficient"]) for s in kill}
    assert [kill[s]["loss"] for s in range(parted + 1)] == [spread[s]["loss"] for s in range(parted + 1)]
    assert kill[parted + 1]["loss"] != spread[parted + 1]["loss"]


def test_a_death_seen_at_a_step_s_start_gives_the_step_of_one_seen_in_its_reduction(
    tmp_path: Path, data_cache_dir: Path
) -> None:
    """When the neighbour sees a death decides nothing: its own microbatches of the step it was starting run
    exactly and only the dead worker's in efficient mode, whether it sees the death before the step starts
    (worker 0, worker 2's neighbour in the ring, is stopped in step 2's commit while worker 2 is killed there,
    so it resumes with the death published) or in the step's reduction (worker 2 is killed in step 3's
    backward). Worker 1 stays running: a kill that would leave no member running is skipped."""
    common = ["--train.steps=6", "--checkpoint.every=0", "--train.microbatches=6", "--mecefo.rank=8"]
    common += ["--recovery.policy=mecefo", EXACT, ONE_THREAD]
    schedules = {
        "at_start": "kill:worker=2,step=2,phase=optimizer; pause:worker=0,step=2,phase=optimizer,seconds=1.0",
        "in_reduction": "kill:worker=2,step=3,phase=backward",
    }
    for name, schedule in schedules.items():
        result = train(tmp_path / name, data_cache_dir, *common, f"--failures.schedule={schedule}", workers=3)
        assert result.returncode == 0, (name, result.stderr[-3000:])
    steps = {name: committed_steps(read_records(tmp_path / name)) for name in schedules}
    # Step 3: worker 0's own 2 exact, worker 2's 2 efficient; then worker 0 runs its own and worker 2's efficient.
    for name in schedules:
        assert [steps[name][s]["efficient"] for s in range(6)] == [0, 0, 0, 2, 4, 4], name
    assert step_losses(tmp_path / "at_start") == step_losses(tmp_path / "in_reduction")
    ref = final_params(tmp_path / "in_reduction")
    for name, tensor in final_params(tmp_path / "at_start").items():
        assert torch.equal(tensor, ref[name]), name
