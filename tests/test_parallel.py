"""Replicas of several ranks (issues 19, 30): FSDP2 shards and pipeline stages, alone and together, under the
fault-tolerant reduction (tensor-parallel ranks: test_replica3d.py).

The oracle is the unsharded model: with exact reduction a run's trajectory depends neither on the number of
replicas nor on how each replica splits the model (FSDP shards, pipeline stages, both), nor on failures, so every
run here must end with the parameters of the one-worker failure-free run of the same steps (``reference``, below),
bit for bit, and record the same loss at every step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from runner import (
    EXACT,
    ONE_THREAD,
    TINY,
    committed,
    kill_worker,
    launched,
    popen,
    recomputed_by_the_recoveries,
    reference_run,
    run_command,
    train,
    train_cmd,
    wait_for,
)

from unbroken.control.store.gateway import TOKEN_ENV, new_token
from unbroken.core.records import read_records
from unbroken.ft.checkpoint import schema as ckpt

pytestmark = pytest.mark.timeout(600)
# trainings the module fixtures run (conftest adds their time to each test's bound)
FIXTURE_RUNS = {"reference": 1, "mecefo_whole": 1}

# The runs compared with the reference: 14 steps hold each test's kills and the steps after them, made slow (a
# sleep) for as long as a restarted replica takes to rejoin. recovery_runs' 50-step reference, made once for the
# session, has no checkpoint before its last step, and the learning rate's schedule depends on the number of steps:
# a shorter run is compared with a reference of its own.
STEPS = 14
COMMON = ["--checkpoint.every=0", ONE_THREAD, EXACT, f"--train.steps={STEPS}"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data_cache_dir: Path) -> Path:
    """The oracle: the one-worker failure-free run of ``STEPS`` steps, exact reduction."""
    return reference_run(tmp_path_factory, "parallel", data_cache_dir, *COMMON)


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(run, "step") if not r.get("republished")}


def assert_like_the_unsharded_run(run: Path, reference: Path) -> dict[str, object]:
    """``run`` ended like the one-worker failure-free run: every step's loss and the final parameters, bitwise;
    every replica's ranks ended with the same shards (the final record). Returns the final checkpoint."""
    assert losses(run) == losses(reference)
    final = read_records(run, "final")[-1]
    assert final["identical"], final["checksums"]
    mine, theirs = ckpt.verify(run, STEPS), ckpt.verify(reference, STEPS)
    assert sorted(mine["model"]) == sorted(theirs["model"])
    different = [k for k in theirs["model"] if not torch.equal(mine["model"][k], theirs["model"][k])]
    assert not different, different[:3]
    assert mine["ft"]["scale"] == theirs["ft"]["scale"]
    return mine


def optimizer_tensors(state: dict[str, object]) -> dict[str, torch.Tensor]:
    optimizer = state["optimizer"]
    assert isinstance(optimizer, dict)
    return {k: v for k, v in optimizer.items() if isinstance(v, torch.Tensor)}


def test_sharded_replicas_of_any_count_are_bitwise_equal_and_skip_a_non_finite_step_together(
    tmp_path: Path, data_cache_dir: Path
) -> None:
    """2 replicas x 2 FSDP shards and 1 replica x 2 shards, exact reduction, with a NaN in one microbatch gradient
    of step 3 (computed by one rank of the last replica; each rank sees only its own shard): every rank skips
    step 3, and the two runs end with the same parameters and optimizer state, bit for bit, and record the same
    losses. (That they are the unsharded model's: the tests below.)"""
    common = [ONE_THREAD, EXACT, "--train.steps=6", "--checkpoint.every=0", "--parallel.shard=2"]
    states = []
    for workers, nan_on in ((4, 3), (2, 1)):
        run = tmp_path / f"shard-{workers}"
        schedule = f"--failures.schedule=nan:worker={nan_on},step=3"
        result = train(run, data_cache_dir, *common, schedule, workers=workers)
        assert result.returncode == 0, result.stderr[-3000:]
        assert all(r["alive"] == workers // 2 for r in read_records(run, "step"))  # replicas, not ranks
        skips = read_records(run, "nonfinite_skip")
        assert [s["step"] for s in skips] == [3] and skips[0]["workers"] == [nan_on]  # the rank that saw it
        assert [r["step"] for r in read_records(run, "step") if r["skipped"]] == [3]
        assert read_records(run, "final")[-1]["identical"]
        states.append((losses(run), ckpt.verify(run, 6)))
    (losses_a, a), (losses_b, b) = states
    assert losses_a == losses_b
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    moments = [optimizer_tensors(a), optimizer_tensors(b)]
    assert moments[0].keys() == moments[1].keys() and moments[0]
    assert all(torch.equal(moments[0][k], moments[1][k]) for k in moments[0])


@pytest.mark.timeout(900)
def test_kills_in_sharded_replicas_leave_the_run_bitwise_the_failure_free_one(
    recovery_runs: dict[str, Path], reference: Path, tmp_path: Path, data_cache_dir: Path
) -> None:
    """3 replicas x 2 shards: a shard rank killed mid-backward (replica 0), one mid-reduction (replica 1), a
    whole replica (both ranks of replica 2), then the leading replica's first rank while it writes the final
    checkpoint (after the last evaluation). Each death takes its replica down in one epoch, the survivors
    recompute its microbatches in-step, the first two replicas come back (each rank receives its shard of the
    state from the same rank of a live replica), the last one writes the final checkpoint again, and the run
    ends as the failure-free one, every replica holding the same shards."""
    run = tmp_path / "kills"
    # A restarted replica takes seconds to come back (two processes import torch and build the model): the 3 steps
    # after each kill are made slow (replica 2 computes 28x, then 34x slower, so the others wait for it: 81 and 99
    # times its compute of a step, which grows with the machine's load), so that a replica is back before the next
    # kill needs it alive. Timing only: who computes what changes no bit in exact mode.
    schedule = (
        "kill:worker=1,step=2,phase=backward,rejoin=0.5; slow:worker=4,factor=28,steps=3-5; "
        "kill:worker=2,step=6,phase=reduction,rejoin=0.5; slow:worker=4,factor=34,steps=7-9; "
        "kill:worker=4,step=11,phase=forward; kill:worker=5,step=11,phase=forward; "
        "kill:worker=0,step=12,phase=checkpoint"  # the leading replica killed writing the final checkpoint
    )
    # 6 processes, 6 slow steps and two replica restarts: longer than one run's default bound on a loaded machine
    # (a clean-clone suite once took 240 s here)
    args = ["--parallel.shard=2", f"--failures.schedule={schedule}"]
    result = train(run, data_cache_dir, *COMMON, *args, workers=6, timeout_s=600)
    assert result.returncode == 0, result.stderr[-3000:]
    injected = sorted(r["worker"] for r in read_records(run, "injected"))
    # Both ranks of replica 2 are to die in step 11's forward: the first death takes the replica down, and its mate,
    # waiting at its own injection point, may see that and leave before its agent kills it (r134: only 5 killed).
    assert injected[:3] == [0, 1, 2] and injected[3:] in ([4], [5], [4, 5]), injected
    epochs = [(r["members"], r["reason"]) for r in read_records(run, "membership")]
    removed = [set(before) - set(after) for (before, _), (after, _) in zip(epochs, epochs[1:], strict=False)]
    assert {0, 1} in removed and {2, 3} in removed and {4, 5} in removed  # whole replicas, each in one epoch
    assert any(reason.startswith("joined") and {0, 1} <= set(m) for m, reason in epochs)
    assert any(reason.startswith("joined") and {2, 3} <= set(m) for m, reason in epochs)
    recomputed_by_the_recoveries(run)
    # Each rank of a rejoining replica received its shard of the state, about half of what a rejoining worker of
    # an unsharded run receives (recovery_runs' failure run: worker 2 rejoins), never the whole.
    sharded = [r["state_bytes"] for r in read_records(run, "recovery") if r["state_bytes"]]
    whole = [r["state_bytes"] for r in read_records(recovery_runs["exact_failures"], "recovery") if r["state_bytes"]]
    assert sharded and whole and max(sharded) < 0.6 * min(whole)
    assert_like_the_unsharded_run(run, reference)


@pytest.mark.timeout(900)
def test_whole_spare_replicas_take_the_places_of_killed_replicas_and_the_run_stays_bitwise(
    recovery_runs: dict[str, Path], reference: Path, tmp_path: Path, data_cache_dir: Path
) -> None:
    """2 replicas x 2 shards with ``--spares 2``: one spare replica, whose two ranks form their group, build their
    shards and wait. Rank 1 is killed mid-backward at step 5 (the schedule): replica 0 is removed whole, spares 0
    and 1 take the places of workers 0 and 1 (each the worker of its own rank) and a new spare replica (spares 2
    and 3) is started; once they joined, an outside ``kill -9`` of worker 2: spares 2 and 3 take replica 1's
    place. Each rank of a joining spare replica receives its shard of the state, not the whole; the run ends as
    the failure-free one."""
    run, token = tmp_path / "spares", new_token()
    # Each microbatch of replica 0 takes 0.25 s more until the kill, then each microbatch of either replica 1.5 s
    # more (a step's 4 shared by the ranks alive, whichever they are: at least 1.5 s a step, 13 s after the kill):
    # whatever the machine's speed, the run lasts long enough for both spare replicas to join before its end.
    # Timing only: no bit changes in exact mode.
    after = f"seconds=1.5,steps=5-{STEPS - 1}"
    pace = f"slow:worker=0,seconds=0.25,steps=0-4; slow:worker=0,{after}; slow:worker=2,{after}"
    schedule = f"--failures.schedule=kill:worker=1,step=5,phase=backward; {pace}"
    args = ["--out", str(run), *COMMON, "--parallel.shard=2", "--spares", "2", schedule]

    def joined(workers: set[int]) -> int | None:
        """The epoch that took ``workers`` in, if one did."""
        epochs = read_records(run, "membership")
        return next((m["epoch"] for m in epochs if m["reason"].startswith("joined") and workers <= set(m["members"])),
                    None)  # fmt: skip

    def computed_with_both_replicas() -> bool:  # spares 0 and 1 hold the state: replica 1 may die now
        epoch = joined({0, 1})
        return epoch is not None and any(r["epoch"] >= epoch and r["alive"] == 2 for r in read_records(run, "step"))

    with launched(train_cmd(data_cache_dir, TINY, *args, workers=4), {**os.environ, TOKEN_ENV: token}) as proc:
        wait_for(computed_with_both_replicas, 300, "a step computed by spares 0 and 1 and replica 1")
        killed_after = committed(run)
        kill_worker(token, 2)
        out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    spares = read_records(run, "spare")
    promoted = {r["worker"]: r["spare"] for r in spares if r["state"] == "promoted"}
    assert promoted == {0: 0, 1: 1, 2: 2, 3: 3}, spares
    assert sorted(r["spare"] for r in spares if r["state"] == "started") == [0, 1, 2, 3, 4, 5]
    assert {r["spare"] for r in spares if r["state"] == "ready"} >= {0, 1, 2, 3}  # each built before promoted
    epochs = [(set(r["members"]), r["reason"]) for r in read_records(run, "membership")]
    removed = [before - after for (before, _), (after, _) in zip(epochs, epochs[1:], strict=False)]
    assert {0, 1} in removed and {2, 3} in removed, epochs  # whole replicas, each in one epoch
    assert joined({2, 3}) is not None, f"spares 2 and 3 never joined (worker 2 killed after step {killed_after})"
    assert all(f"spare {k} took worker {k}'s place" in out for k in range(4)), out[-3000:]
    # Each rank of a spare replica received its shard of the state (about half of what a worker of an unsharded
    # run receives: recovery_runs' failure run, where worker 2 rejoins), never the whole.
    sharded = [r["state_bytes"] for r in read_records(run, "recovery") if r["state_bytes"]]
    whole = [r["state_bytes"] for r in read_records(recovery_runs["exact_failures"], "recovery") if r["state_bytes"]]
    assert sharded and whole and max(sharded) < 0.6 * min(whole)
    assert_like_the_unsharded_run(run, reference)


def test_a_kill_in_a_pipelined_replica_leaves_the_run_bitwise_the_failure_free_one(
    reference: Path, tmp_path: Path, data_cache_dir: Path
) -> None:
    """2 replicas x 2 pipeline stages (1F1B; GPipe where a replica runs fewer microbatches than stages): the
    last stage of replica 1 killed mid-backward at an evaluation step (the survivor recomputes 2 microbatches,
    then evaluates 4 alone: a pipelined batch of another size, forward only), then the first stage of the
    leading replica mid-reduction; both come back, and the run ends as the failure-free one."""
    run = tmp_path / "pipeline"
    # The steps after each kill slow (as in the tests above): replica 1 is back before the leading replica's kill
    # needs it alive, and replica 0 before the end.
    schedule = (
        "kill:worker=3,step=3,phase=backward,rejoin=0.5; slow:worker=0,factor=35,steps=4-7; "
        "kill:worker=0,step=9,phase=reduction,rejoin=0.5; slow:worker=2,factor=33,steps=10-12"
    )
    result = train(run, data_cache_dir, *COMMON, "--parallel.pipeline=2", f"--failures.schedule={schedule}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(r["worker"] for r in read_records(run, "injected")) == [0, 3]
    joined = [set(r["members"]) for r in read_records(run, "membership") if r["reason"].startswith("joined")]
    assert joined == [{0, 1, 2, 3}] * 2, joined  # replica 1, then replica 0
    assert_like_the_unsharded_run(run, reference)


@pytest.mark.timeout(900)
def test_kills_in_sharded_pipelined_replicas_leave_the_run_bitwise_the_failure_free_one(
    reference: Path, tmp_path: Path, data_cache_dir: Path
) -> None:
    """2 replicas x (shard 2 x pipeline 2), 1F1B. Torch's pipelining defers FSDP's reduce-scatter to a stage's last
    microbatch (a float sum over the microbatches this replica happens to compute); in exact mode each
    microbatch's backward reduce-scatters and folds instead, so the run is bitwise the unsplit failure-free one,
    through a rank of the last replica killed mid-backward and one of the first mid-reduction."""
    run = tmp_path / "shard-pipeline"
    # The slow steps let a killed replica (4 processes starting) come back before the other one is killed.
    schedule = (
        "kill:worker=6,step=2,phase=backward,rejoin=0.5; slow:worker=0,factor=8,steps=3-6; "
        "kill:worker=1,step=8,phase=reduction,rejoin=0.5; slow:worker=4,factor=8,steps=9-12"
    )
    layout = ["--parallel.shard=2", "--parallel.pipeline=2", f"--failures.schedule={schedule}"]
    result = train(run, data_cache_dir, *COMMON, *layout, workers=8, timeout_s=600)  # 8 processes, 2 restarts
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(r["worker"] for r in read_records(run, "injected")) == [1, 6]
    epochs = [(r["members"], r["reason"]) for r in read_records(run, "membership")]
    removed = [set(before) - set(after) for (before, _), (after, _) in zip(epochs, epochs[1:], strict=False)]
    assert {4, 5, 6, 7} in removed and {0, 1, 2, 3} in removed  # whole replicas, each in one epoch
    assert_like_the_unsharded_run(run, reference)


def test_a_sharded_pipeline_pads_a_round_and_stays_the_unsplit_model(tmp_path: Path, data_cache_dir: Path) -> None:
    """1 replica x (shard 2 x pipeline 2) with 3 microbatches a step: each shard's pipeline runs its lane of the
    rounds ([0, 1], [2, -]), the second lane a padding microbatch that takes part in FSDP's collectives and
    counts for nothing. Bitwise one worker's run of the same steps."""
    common = [ONE_THREAD, EXACT, "--train.steps=4", "--checkpoint.every=0", "--train.microbatches=3"]
    runs = {}
    for name, workers, layout in (("split", 4, ["--parallel.shard=2", "--parallel.pipeline=2"]), ("one", 1, [])):
        runs[name] = tmp_path / name
        result = train(runs[name], data_cache_dir, *common, *layout, workers=workers)
        assert result.returncode == 0, result.stderr[-3000:]
    assert losses(runs["split"]) == losses(runs["one"])
    mine, theirs = ckpt.verify(runs["split"], 4), ckpt.verify(runs["one"], 4)
    assert sorted(mine["model"]) == sorted(theirs["model"])
    assert all(torch.equal(mine["model"][k], theirs["model"][k]) for k in theirs["model"])


MECEFO_COMMON = [ONE_THREAD, EXACT, "--recovery.policy=mecefo", "--mecefo.rank=16", "--train.steps=6"]
# The kill is seen by the launcher (the process exits), not by heartbeats: a long timeout keeps a worker that a
# loaded machine starves for 2 s from being excluded, which would hand its microbatches over at another step.
MECEFO_COMMON += ["--checkpoint.every=0", "--comm.heartbeat_timeout_s=10"]


def mecefo_run(run: Path, cache: Path, workers: int, victim: int, *layout: str) -> dict[int, tuple[float, int]]:
    """A MeCeFO run of 2 replicas whose replica 0 dies at step 3 (``victim``, one of its ranks, killed
    mid-backward) and never comes back; every step's (loss, microbatches computed in efficient mode)."""
    schedule = f"--failures.schedule=kill:worker={victim},step=3,phase=backward"
    result = train(run, cache, *MECEFO_COMMON, *layout, schedule, workers=workers)
    assert result.returncode == 0, result.stderr[-3000:]
    return {r["step"]: (r["loss"], r["efficient"]) for r in read_records(run, "step")}


@pytest.fixture(scope="module")
def mecefo_whole(tmp_path_factory: pytest.TempPathFactory, data_cache_dir: Path) -> tuple[Path, dict]:
    """MeCeFO on 2 replicas of one rank, losing replica 0 at step 3."""
    run = tmp_path_factory.mktemp("mecefo") / "whole"
    return run, mecefo_run(run, data_cache_dir, 2, 0)


@pytest.mark.parametrize("layout", ["--parallel.shard=2", "--parallel.pipeline=2"], ids=["shards", "stages"])
def test_mecefo_on_split_replicas_is_bitwise_mecefo_on_whole_ones(
    tmp_path: Path, data_cache_dir: Path, mecefo_whole: tuple[Path, dict], layout: str
) -> None:
    """MeCeFO with 2 replicas x 2 ranks (FSDP shards, or pipeline stages): replica 0 dies (its rank 1 killed
    mid-backward) and replica 1 takes its microbatches over in efficient mode on its blocks: FSDP-wrapped ones,
    whose projection bases are computed from the FFN weights gathered per block; or a stage's own blocks, each
    microbatch's forward on every stage switched to the mode its plan gives. In exact mode that is bitwise MeCeFO
    on 2 replicas of one rank losing replica 0: the efficient backward on FSDP's unsharded weights, or through
    the stages, is the same arithmetic, and a block's bases are seeded by its name, which a stage keeps."""
    run = tmp_path / "split"
    whole, whole_steps = mecefo_whole
    assert mecefo_run(run, data_cache_dir, 4, 1, layout) == whole_steps
    assert sum(efficient for _, efficient in whole_steps.values()) > 0  # the neighbour ran efficient microbatches
    mine, theirs = ckpt.verify(run, 6), ckpt.verify(whole, 6)
    assert sorted(mine["model"]) == sorted(theirs["model"])
    assert all(torch.equal(mine["model"][k], theirs["model"][k]) for k in theirs["model"])
    # The sharded checkpoint holds every block's bases by weight name (each stage saved its own), the same as
    # the one-file checkpoint's list (block by block: gate w1, up w3, down w2).
    listed = theirs["ft"]["mecefo_bases"]
    names = [f"layers.{i}.feed_forward.{w}.weight" for i in range(len(listed) // 3) for w in ("w1", "w3", "w2")]
    named = mine["ft"]["mecefo_bases"]
    assert sorted(named) == sorted(names) and mine["ft"]["mecefo_bases_step"] == theirs["ft"]["mecefo_bases_step"]
    assert all(torch.equal(named[n], v) for n, v in zip(names, listed, strict=True))
    # Resumed by one whole-model worker, the run keeps them (no efficient microbatch: they are not recomputed),
    # and its one-file checkpoint lists them again.
    resume = train_cmd(data_cache_dir, "--resume", str(run), "--parallel.shard=1", "--parallel.pipeline=1", workers=1)
    result = run_command(
        [*resume, "--train.steps=7", "--failures.schedule="], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = ckpt.verify(run, 7)["ft"]
    assert resumed["mecefo_bases_step"] == theirs["ft"]["mecefo_bases_step"]
    assert all(torch.equal(a, b) for a, b in zip(resumed["mecefo_bases"], listed, strict=True))


def test_a_sharded_checkpoint_resumes_with_other_replicas_and_shards(
    reference: Path, tmp_path: Path, data_cache_dir: Path
) -> None:
    """2 replicas x 2 shards stopped (Ctrl-C) after the sharded checkpoint of step 5, then resumed by 3 replicas
    of one rank each: DCP loads the shards into whole tensors, and the run ends as the failure-free one."""
    run = tmp_path / "resumed"
    common = [*COMMON, "--checkpoint.every=5", "--checkpoint.keep=10"]
    # The steps after the checkpoint take at least 0.5 s more (worker 0 sleeps that long a microbatch it computes):
    # the run is stopped before its end whatever the machine's speed. Timing only: no bit changes in exact mode.
    pace = f"--failures.schedule=slow:worker=0,seconds=0.5,steps=5-{STEPS - 1}"
    cmd = train_cmd(data_cache_dir, TINY, "--out", str(run), *common, "--parallel.shard=2", pace, workers=4)
    proc = popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 200
    while not any(r["step"] >= 5 for r in read_records(run, "checkpoint")):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be stopped"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert not read_records(run, "final"), "stopped too late to test --resume"
    assert ckpt.load_latest(run, read_sharded=False).sharded  # type: ignore[union-attr]
    resume = train_cmd(data_cache_dir, "--resume", str(run), "--parallel.shard=1", "--failures.schedule=", workers=3)
    result = run_command(resume, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = read_records(run, "resume")[-1]
    assert resumed["step"] >= 5 and resumed["path"].endswith(".dcp")
    assert_like_the_unsharded_run(run, reference)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "3", "--parallel.shard=2"], "--workers = 3 is not a whole number of replicas of 2 ranks"),
        (["--workers", "4", "--parallel.tensor=4"], "parallel.tensor = 4 must divide the model's key/value heads (2)"),
        (["--workers", "2", "--parallel.sequence_parallel=true"], "parallel.sequence_parallel = true needs parallel."),
        (
            ["--workers", "4", "--parallel.tensor=2", "--parallel.sequence_parallel=true", "--recovery.policy=mecefo"],
            "recovery.policy = mecefo with parallel.sequence_parallel",
        ),
        (["--workers", "6", "--parallel.tensor=2", "--parallel.shard=2"], "replicas of 4 ranks (parallel.shard = 2"),
        (["--workers", "6", "--parallel.pipeline=3"], "parallel.pipeline = 3 exceeds the model's 2 blocks"),
        (["--workers", "2", "--parallel.shard=0"], "parallel.shard = 0 must be >= 1"),
        (
            ["--workers", "4", "--parallel.shard=2", "--spares", "1"],
            "spares come as whole replicas, use a multiple of 2",
        ),
        (["--spares", "-1"], "--spares = -1 must be >= 0"),
    ],
)
def test_a_layout_that_cannot_run_is_one_line_and_exit_2(
    tmp_path: Path, data_cache_dir: Path, args: list[str], message: str
) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "unbroken", "train", TINY, "--out", str(out), f"--data.cache_dir={data_cache_dir}"]
    result = run_command([*cmd, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not out.exists()


def test_the_configured_schedule_runs_unless_a_replica_has_fewer_microbatches_than_stages() -> None:
    """1F1B needs at least as many microbatches as stages; a step that gives a replica fewer runs GPipe (the
    built-in pipeline and the benchmark's baseline both pick with ``schedule_kind``)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from unbroken.core.config import PipelineSchedule
    from unbroken.ft.parallel.pipeline import schedule_kind

    assert schedule_kind(PipelineSchedule.ONE_F_ONE_B, 4, 2) is Schedule1F1B
    assert schedule_kind(PipelineSchedule.ONE_F_ONE_B, 2, 2) is Schedule1F1B
    assert schedule_kind(PipelineSchedule.ONE_F_ONE_B, 1, 2) is ScheduleGPipe
    assert schedule_kind(PipelineSchedule.GPIPE, 4, 2) is ScheduleGPipe
