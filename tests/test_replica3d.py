"""Replicas in three dimensions (issue 30): tensor-parallel ranks, alone and with FSDP shards or pipeline stages.

The oracle is the failure-free run of one replica of 2 tensor ranks (``tp_reference``). With exact reduction a
run's trajectory depends neither on the number of replicas, nor on FSDP sharding (the exact fold quantises
elementwise and sums integers), nor on pipeline stages (each stage's tensors are its own), nor on failures: so
2 replicas x (tensor 2), 1 x (tensor 2 x shard 2), 1 x (tensor 2 x pipeline 2) and every run with kills must end
with the reference's parameters, optimizer state and losses, bit for bit. Tensor parallelism itself changes the
arithmetic (a row-wise projection sums its ranks' partial products in floating point), so these runs are not
the unsplit model's; test_tensor.py checks that they compute it to float64 roundoff.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runner import EXACT, ONE_THREAD, recomputed_by_the_recoveries, reference_run, run_command, train, train_cmd

from unbroken.core.records import read_records
from unbroken.ft.checkpoint import schema as ckpt

pytestmark = pytest.mark.timeout(900)
FIXTURE_RUNS = {"tp_reference": 1}  # trainings the module fixture runs (conftest adds their time to each test's bound)

STEPS = 12  # every run here trains as many as the reference: room for the kills' schedule below
# The kills here are seen from the process exits (the agent reports one at once); the heartbeat bound only
# catches hangs. Up to 8 processes forming a 3-D mesh beside another test on 2 cores have left one's heartbeat
# sender silent for over 2 s in the first step (clean runs 11 and 12): its replica was declared dead before any
# kill. A 10 s bound keeps that from passing for a failure.
LOADED = "--comm.heartbeat_timeout_s=10"
COMMON = ["--checkpoint.every=0", LOADED, ONE_THREAD, EXACT, f"--train.steps={STEPS}"]
TENSOR = "--parallel.tensor=2"


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(run, "step") if not r.get("republished")}


@pytest.fixture(scope="module")
def tp_reference(tmp_path_factory: pytest.TempPathFactory, data_cache_dir: Path) -> Path:
    """One replica of 2 tensor ranks, no failure."""
    return reference_run(tmp_path_factory, "tp", data_cache_dir, *COMMON, TENSOR, workers=2)


def assert_like_the_reference(run: Path, reference: Path, steps: int = STEPS) -> None:
    """``run`` ended as ``reference``: every step's loss, the final parameters and optimizer state, bitwise, and
    every replica's ranks holding the same parts (the final record)."""
    assert losses(run) == losses(reference)
    assert read_records(run, "final")[-1]["identical"]
    mine, theirs = ckpt.verify(run, steps), ckpt.verify(reference, steps)
    assert sorted(mine["model"]) == sorted(theirs["model"])
    different = [k for k in theirs["model"] if not torch.equal(mine["model"][k], theirs["model"][k])]
    assert not different, different[:3]
    moments = [{k: v for k, v in state["optimizer"].items() if isinstance(v, torch.Tensor)} for state in (mine, theirs)]
    assert moments[0].keys() == moments[1].keys() and moments[0]
    assert all(torch.equal(moments[0][k], moments[1][k]) for k in moments[0])
    assert mine["ft"]["scale"] == theirs["ft"]["scale"]


@pytest.mark.parametrize(
    ("workers", "layout"),
    [(4, []), (4, ["--parallel.shard=2"]), (4, ["--parallel.pipeline=2"])],
    ids=["2-replicas", "tensor-x-shard", "tensor-x-pipeline"],
)
def test_a_tensor_parallel_layout_is_bitwise_one_replica_of_two_tensor_ranks(
    tp_reference: Path, tmp_path: Path, data_cache_dir: Path, workers: int, layout: list[str]
) -> None:
    run = tmp_path / "run"
    result = train(run, data_cache_dir, *COMMON, TENSOR, *layout, workers=workers)
    assert result.returncode == 0, result.stderr[-3000:]
    size = 2 * (2 if layout else 1)
    assert all(r["alive"] == workers // size for r in read_records(run, "step"))  # replicas, not ranks
    assert_like_the_reference(run, tp_reference)


# Kills, sent from outside by the launcher (SIGKILL): a rank of the last replica mid-backward, then a rank of the
# first mid-reduction. A restarted replica takes seconds to come back (its ranks are forked, split the model,
# form their mesh), joins at a step boundary and takes the state at the next step: the 3 steps after each kill are
# slow (a rank of the surviving replica computes 8x slower, so the whole step waits; a factor, so the steps slow
# down with the load that slows the restart), so that replica 1 is back, whole, before the second kill takes
# replica 0 down, and replica 0 before the last step. In this file's runs beside others on 2 cores a slow step
# took 3-6 s and each join came under 2.5 s after its kill, within the first slow step. The slow steps sleep: they
# cost wall time, not CPU. Timing only: who computes what changes no bit in exact mode.
KILLS = (
    "kill:worker={a},step=2,phase=backward,rejoin=0.5; slow:worker=0,factor=8,steps=3-5; "
    "kill:worker={b},step=7,phase=reduction,rejoin=0.5; slow:worker={c},factor=8,steps=8-10"
)
KILL_RUN_TIMEOUT_S = 600  # 8 processes on a loaded 2-core machine, two replicas of 4 restarted, 6 slow steps


@pytest.mark.parametrize("second", ["--parallel.shard=2", "--parallel.pipeline=2"], ids=["shard", "pipeline"])
def test_kills_in_three_dimensional_replicas_leave_the_run_bitwise_the_failure_free_one(
    tp_reference: Path, tmp_path: Path, data_cache_dir: Path, second: str
) -> None:
    """2 replicas x (tensor 2 x shard 2) and 2 x (tensor 2 x pipeline 2): each death takes its replica down in
    one epoch (all 4 ranks), the survivor recomputes its microbatches in-step, the replica restarts whole and each
    of its ranks receives its own slice of the state from the rank at the same coordinate of the live replica,
    never a gathered model. The run ends as the failure-free one."""
    run = tmp_path / "kills"
    schedule = KILLS.format(a=5, b=2, c=4)
    schedule_arg = f"--failures.schedule={schedule}"
    result = train(run, data_cache_dir, *COMMON, TENSOR, second, schedule_arg, workers=8, timeout_s=KILL_RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(r["worker"] for r in read_records(run, "injected")) == [2, 5]
    epochs = [(r["members"], r["reason"]) for r in read_records(run, "membership")]
    removed = [set(before) - set(after) for (before, _), (after, _) in zip(epochs, epochs[1:], strict=False)]
    assert {4, 5, 6, 7} in removed and {0, 1, 2, 3} in removed  # whole replicas, each in one epoch
    recomputed_by_the_recoveries(run)
    assert [reason for _, reason in epochs].count("joined: 0, 1, 2, 3") == 1
    assert [reason for _, reason in epochs].count("joined: 4, 5, 6, 7") == 1
    # A rejoining rank received its slice of the state: a part of each tensor (FSDP's shard, a tensor rank's
    # columns or rows) or a stage's tensors, under half of a whole copy of the state (the embedding and the
    # output layer, most of this model, are left whole by tensor parallelism; FSDP halves them, and pipelining
    # puts them on different stages), never a gathered model.
    whole = ckpt_bytes(ckpt.verify(tp_reference, STEPS))
    received = [r["state_bytes"] for r in read_records(run, "recovery") if r["state_bytes"]]
    assert received and all(0 < b < 0.5 * whole for b in received), (whole, received)
    assert_like_the_reference(run, tp_reference)


def ckpt_bytes(state: dict[str, object]) -> int:
    """The bytes of a checkpoint's model parameters and optimizer tensors (what a whole copy of the state holds)."""
    tensors = [v for part in ("model", "optimizer") for v in state[part].values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def test_a_checkpoint_of_tensor_x_shard_replicas_resumes_in_another_layout(
    tmp_path: Path, data_cache_dir: Path
) -> None:
    """A sharded checkpoint written by 1 replica x (tensor 2 x shard 2) at step 6, resumed for 4 more steps by
    2 replicas x (shard 2) and by one worker: DCP reshards it into FSDP shards and into whole tensors. Both go
    on with the unsplit model's arithmetic from the same state, so they end bitwise alike (a tensor lost or
    misplaced in either resharding would part them)."""
    saved = tmp_path / "saved"
    result = train(
        saved,
        data_cache_dir,
        *COMMON[1:-1],
        "--train.steps=6",
        "--checkpoint.every=3",
        TENSOR,
        "--parallel.shard=2",
        workers=4,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert ckpt.load_latest(saved, read_sharded=False).sharded  # type: ignore[union-attr]
    runs = {}
    for name, workers, layout in (("fsdp", 4, "--parallel.shard=2"), ("whole", 1, "--parallel.shard=1")):
        runs[name] = tmp_path / name
        run_command(["cp", "-a", str(saved), str(runs[name])], check=True)
        resume = train_cmd(
            data_cache_dir,
            "--resume",
            str(runs[name]),
            "--train.steps=10",
            "--parallel.tensor=1",
            layout,
            workers=workers,
        )
        result = run_command(resume, capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stderr[-3000:]
        resumed = read_records(runs[name], "resume")[-1]
        assert resumed["step"] == 6 and resumed["path"].endswith(".dcp")
    assert losses(runs["fsdp"]) == losses(runs["whole"])
    a, b = ckpt.verify(runs["fsdp"], 10), ckpt.verify(runs["whole"], 10)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])


def test_tensor_ranks_train_hugging_face_s_llama(tmp_path: Path, data_cache_dir: Path) -> None:
    """``--parallel.tensor=2 --model.hf_config=llama-tiny``: Hugging Face's ``LlamaForCausalLM`` split over 2 tensor
    ranks, 2 replicas, trains (its loss falls) and every replica's ranks end with the same parts."""
    pytest.importorskip("transformers", reason="Hugging Face's model needs transformers (pip install '.[hf]')")
    run = tmp_path / "hf"
    args = [ONE_THREAD, EXACT, "--train.steps=4", "--checkpoint.every=0", TENSOR, "--model.hf_config=llama-tiny"]
    result = train(run, data_cache_dir, *args, workers=4)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = losses(run)
    assert sorted(steps) == list(range(4)) and steps[3] < steps[0]
    assert read_records(run, "final")[-1]["identical"]


def test_mecefo_on_tensor_ranks_takes_a_dead_replica_s_microbatches_over(tmp_path: Path, data_cache_dir: Path) -> None:
    """MeCeFO with 2 replicas x (tensor 2): rank 1 of replica 0 is killed mid-backward at step 3, and replica 1
    computes the dead replica's microbatches in efficient mode on its tensor-split blocks (the arithmetic is
    test_tensor.py's) until replica 0 is back. No microbatch is lost (every step counts all of them), some run
    efficiently, and the job ends with every coordinate's parameters the same on both replicas."""
    run = tmp_path / "mecefo"
    schedule = "--failures.schedule=kill:worker=1,step=3,phase=backward"
    args = [ONE_THREAD, EXACT, "--recovery.policy=mecefo", "--mecefo.rank=16", "--train.steps=10", TENSOR]
    result = train(run, data_cache_dir, *args, "--checkpoint.every=0", schedule, workers=4)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in read_records(run, "step") if not r.get("republished")]
    assert sorted(r["step"] for r in steps) == list(range(10))
    assert all(r["counted"] == r["microbatches"] for r in steps)
    assert sum(r["efficient"] for r in steps) > 0
    assert read_records(run, "failure") and read_records(run, "final")[-1]["identical"]
