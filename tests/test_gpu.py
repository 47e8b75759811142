"""GPU-only tests (skipped without CUDA; ``unbroken bench gpu`` runs them with two GPUs): a bf16 autocast
training step, MeCeFO's efficient backward and its bases on CUDA, NCCL all-reduces through ``unbroken.ft.comm``,
and, with two or more GPUs, a real ``kill -9`` of one of two NCCL ranks in the middle of an all-reduce, after
which the survivor aborts the communicator and forms a new group with a replacement process.

The NCCL workers are this file run as a script (``python tests/test_gpu.py worker ...``), one process per
GPU, meeting on a ``TCPStore`` the test owns; it plays the coordinator (it bumps the epoch after the kill).
Figures (abort and re-formation times) are printed; run with ``pytest -s`` to see them.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from runner import train

from unbroken.core.records import read_records
from unbroken.ft import process

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(300),
]

ROOT = Path(__file__).resolve().parents[1]
BF16_UNIT_ROUNDOFF = 2.0**-8
NUM_BF16_ROUNDINGS = 15  # the longest rounding path of the FFN's efficient backward (tests/test_efficient.py)
# The environment a NCCL worker runs under, as unbroken.ft.process sets it (docs/gpu.md, "NCCL"): the watchdog
# aborts a failed or timed-out communicator without killing the process, the heartbeat monitor (which kills a
# process whose watchdog is stuck, e.g. inside ncclCommAbort) is off, wait() does not block the CPU.
NCCL_ENV = {**process.NCCL_REQUIRED, **process.NCCL_DEFAULTS}
NCCL_TIMEOUT_S = 15.0  # each group's collective timeout; the survivor outlives it after the kill


def tiny_model(device: str) -> torch.nn.Module:
    from unbroken.train.model import FLAVOURS, Transformer

    torch.manual_seed(0)
    return Transformer(FLAVOURS["tiny"]).to(device)


def batch(vocab: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (4, 65), generator=gen).to(device)
    return t[:, :-1], t[:, 1:]


def test_bf16_autocast_steps_reduce_the_loss_on_one_batch() -> None:
    model = tiny_model("cuda")
    x, y = batch(model.tok_embeddings.num_embeddings, "cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(5):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses  # five small steps of descent on one batch


def ffn_grads(model: torch.nn.Module, h: torch.Tensor, g: torch.Tensor, autocast: bool) -> list[torch.Tensor]:
    block = model.layers[0]
    model.zero_grad(set_to_none=True)
    h = h.detach().clone().requires_grad_()
    with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = block.feed_forward(block.ffn_norm(h))
    out.backward(g.to(out.dtype))
    ff = block.feed_forward
    return [h.grad, block.ffn_norm.weight.grad, ff.w1.weight.grad, ff.w3.weight.grad, ff.w2.weight.grad]


def test_efficient_backward_on_cuda_matches_cpu_and_bf16_is_within_rounding() -> None:
    """The same FFN gradients on CUDA as on the CPU (float32, the same bases loaded into both), and under bf16
    autocast within 15 bf16 roundings of float32 (the derivation is in tests/test_efficient.py)."""
    from unbroken.ft.mecefo import EfficientConfig, apply_efficient_backward

    cpu, gpu = tiny_model("cpu"), tiny_model("cuda")
    eb_cpu = apply_efficient_backward(cpu, EfficientConfig(rank=8))
    eb_gpu = apply_efficient_backward(gpu, EfficientConfig(rank=8))
    eb_cpu.refresh(0)
    eb_gpu.load_bases(eb_cpu.bases(), step=0)
    gen = torch.Generator().manual_seed(1)
    h, g = torch.randn(2, 9, 128, generator=gen), torch.randn(2, 9, 128, generator=gen)
    with eb_cpu.enabled(), eb_gpu.enabled():
        want = ffn_grads(cpu, h, g, autocast=False)
        got = ffn_grads(gpu, h.cuda(), g.cuda(), autocast=False)
        got_bf16 = ffn_grads(gpu, h.cuda(), g.cuda(), autocast=True)
    for a, b in zip(got, want, strict=True):
        # float32 on both (TF32 is off by default), summed in another order: relative differences of order
        # K 2^-24 for K <= 352 terms, about 2e-5.
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)
    for a, b in zip(got_bf16, got, strict=True):
        assert a.dtype == torch.float32
        error = float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))
        assert 0 < error <= NUM_BF16_ROUNDINGS * BF16_UNIT_ROUNDOFF, error


def test_bases_on_cuda_are_deterministic_and_read_before_the_optimizer_writes() -> None:
    """``refresh`` computes on a side stream from a background thread; an optimizer step issued right after
    must wait for it: the bases equal those of an untouched copy of the weights, bit for bit."""
    from unbroken.ft.mecefo import EfficientConfig, apply_efficient_backward

    model, copy = tiny_model("cuda"), tiny_model("cuda")
    eb = apply_efficient_backward(model, EfficientConfig(rank=16))
    reference = apply_efficient_backward(copy, EfficientConfig(rank=16))
    optimizer = torch.optim.SGD(model.parameters(), lr=10.0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert eb.refresh(0)
    optimizer.step()  # large in-place writes, queued behind the side stream's reads by the pre-step hook
    reference.refresh(0)
    assert all(torch.equal(a, b) for a, b in zip(eb.bases(), reference.bases(), strict=True))
    assert not torch.equal(model.layers[0].feed_forward.w1.weight, copy.layers[0].feed_forward.w1.weight)


def test_nccl_allreduce_single_rank() -> None:
    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=NCCL_TIMEOUT_S)
    pg = dist.ProcessGroupNCCL(dist.HashStore(), 0, 1, opts)
    t = torch.arange(4.0, device="cuda")
    ar = dist.AllreduceOptions()
    ar.reduceOp = dist.ReduceOp.SUM
    pg.allreduce([t], ar).wait()
    assert torch.equal(t.cpu(), torch.arange(4.0))
    pg.shutdown()


# -- two NCCL processes ---------------------------------------------------------------------------------------


def _spawn(port: int, worker: int, gpu: int, members: str, epochs: str) -> subprocess.Popen[str]:
    env = {**os.environ, **NCCL_ENV, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, __file__, "worker", str(port), str(worker), str(gpu), members, epochs]
    return subprocess.Popen(argv, env=env, text=True)


def _finish(proc: subprocess.Popen[str], timeout_s: float) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


@pytest.fixture
def store() -> dist.TCPStore:
    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (one NCCL rank each)")
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=120))


def test_nccl_allreduce_two_ranks(store: dist.TCPStore) -> None:
    procs = [_spawn(store.port, w, w, "0,1", "1") for w in (0, 1)]
    assert [_finish(p, 180) for p in procs] == [0, 0]
    assert [json.loads(store.get(f"result/{w}")) for w in (0, 1)] == [{"epoch 1": 3.0}] * 2


def test_kill_9_of_one_nccl_rank_and_the_survivor_reforms(store: dist.TCPStore) -> None:
    """Worker 1 is killed (SIGKILL) while worker 0 waits in an all-reduce of epoch 1; worker 0 sees the epoch
    change, aborts the communicator and forms epoch 2's group with worker 2, a fresh process on the freed GPU;
    it then lives past epoch 1's NCCL timeout (the watchdog must not kill it) and all-reduces again."""
    survivor = _spawn(store.port, 0, 0, "0,1", "1,2")
    victim = _spawn(store.port, 1, 1, "0,1", "1,hang")
    store.wait(["in_collective/0"], datetime.timedelta(seconds=180))
    time.sleep(1.0)  # let the all-reduce kernel spin on the missing peer
    os.kill(victim.pid, signal.SIGKILL)
    assert _finish(victim, 30) == -signal.SIGKILL
    killed_at = time.time()
    store.set("killed_at", str(killed_at))
    store.set("epoch", "2")  # what the coordinator does when it declares the death
    replacement = _spawn(store.port, 2, 1, "0,2", "2")
    assert [_finish(p, 240) for p in (survivor, replacement)] == [0, 0]
    survivor_result = json.loads(store.get("result/0"))
    assert survivor_result["epoch 1"] == 3.0 and survivor_result["epoch 2"] == 4.0
    assert survivor_result["epoch 2, after the old timeout"] == 4.0
    print(
        f"\nNCCL kill -9 recovery: interrupted {survivor_result['interrupted_s']:.2f} s after the kill, "
        f"abort {survivor_result['abort_s']:.3f} s, new group + first all-reduce {survivor_result['reform_s']:.2f} s"
    )


# -- unbroken train on GPUs ----------------------------------------------------------------------------------


def test_train_on_a_gpu_in_bf16_compiled_and_checkpointed(tmp_path: Path, data_cache_dir: Path) -> None:
    """``unbroken train --train.device=cuda`` with every ``[train]`` option of issue 21, one worker on GPU 0."""
    out = tmp_path / "gpu"
    options = ["--train.precision=bf16", "--train.compile=true", "--train.activation_checkpointing=block"]
    result = train(out, data_cache_dir, "--train.device=cuda", *options, "--train.steps=6", workers=1)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["loss"] for r in read_records(out, "step")]
    assert len(losses) == 6 and losses[-1] < losses[0], losses


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (one worker each)")
def test_train_on_two_gpus_survives_a_kill_over_nccl(tmp_path: Path, data_cache_dir: Path) -> None:
    """Two workers, one GPU each, NCCL for the gradients: worker 1 is killed in step 2's backward. Worker 0's
    polled wait is interrupted by the new epoch, it aborts the NCCL group, recomputes worker 1's
    microbatches alone (slowed down, so that the restarted worker 1 is back before the end) and takes
    worker 1 in again over a new communicator; both end with the same parameters."""
    out = tmp_path / "nccl"
    schedule = "kill:worker=1,step=2,phase=backward,rejoin=1; slow:worker=0,factor=100,steps=3-12"
    common = ["--train.device=cuda", "--train.precision=bf16", "--train.steps=14", "--checkpoint.every=0"]
    result = train(out, data_cache_dir, *common, f"--failures.schedule={schedule}", workers=2)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = {r["step"]: r for r in read_records(out, "step")}
    assert steps[2]["recoveries"] >= 1 and steps[2]["alive"] == 1
    assert steps[13]["alive"] == 2  # worker 1 rejoined over a new NCCL communicator
    final = read_records(out, "final")[0]
    assert final["identical"] and len(final["checksums"]) == 2


# -- the worker (run as a script) ----------------------------------------------------------------------------


def _allreduce(group: Any, t: torch.Tensor) -> bool:
    """An all-reduce through the library's polled wait (``comm.wait_all``): True when it completed."""
    from unbroken.ft import comm

    return comm.wait_all([comm.allreduce_async(group, t)], NCCL_TIMEOUT_S, lambda: False) is comm.WaitStatus.DONE


def _worker(port: int, worker: int, gpu: int, members: tuple[int, ...], epochs: list[str]) -> None:
    from unbroken.ft import comm

    torch.cuda.set_device(gpu)
    device = torch.device("cuda", gpu)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    result: dict[str, float] = {}

    def epoch_now() -> int:
        return int(store.get("epoch")) if store.check(["epoch"]) else 1

    for epoch_name in epochs:
        if epoch_name == "hang":  # the victim: alive, never joins the next all-reduce
            time.sleep(600)
        epoch = int(epoch_name)
        group_members = members if epoch == 1 else tuple(sorted({0, 2}))
        start = time.monotonic()
        group, status = comm.form_group(store, epoch, group_members, worker, "nccl", NCCL_TIMEOUT_S, device)
        assert status and group is not None and group.pg is not None, status
        t = torch.full((4,), float(worker + 1), device=device)
        assert _allreduce(group, t)
        result[f"epoch {epoch}"] = float(t[0])
        if epoch == 2 and worker == 0:
            result["reform_s"] = time.monotonic() - start
            # Outlive epoch 1's NCCL timeout, counted from the abandoned all-reduce, then reduce once more.
            time.sleep(max(0.0, NCCL_TIMEOUT_S + 5.0 - (time.time() - float(store.get("killed_at")))))
            store.set("last_allreduce", "1")
            t = torch.full((4,), float(worker + 1), device=device)
            assert _allreduce(group, t)
            result["epoch 2, after the old timeout"] = float(t[0])
        elif epoch == 2:
            store.wait(["last_allreduce"], datetime.timedelta(seconds=4 * NCCL_TIMEOUT_S))
            t = torch.full((4,), float(worker + 1), device=device)
            assert _allreduce(group, t)
        if epoch == 1 and "2" in epochs and worker == 0:
            # The second all-reduce of epoch 1: the victim never joins; the coordinator (the test) bumps the epoch.
            t = torch.ones(4, device=device)
            pending = comm.allreduce_async(group, t)
            store.set(f"in_collective/{worker}", "1")
            # Either the epoch changes first, or NCCL reports the dead peer and the watchdog aborts the
            # communicator (TORCH_NCCL_ASYNC_ERROR_HANDLING=2): both end the wait without killing this process.
            status_1 = comm.wait_all([pending], 120.0, lambda: epoch_now() > 1)
            assert status_1 in (comm.WaitStatus.INTERRUPTED, comm.WaitStatus.FAILED), status_1
            store.wait(["killed_at"], datetime.timedelta(seconds=60))
            result["interrupted_s"] = time.time() - float(store.get("killed_at"))
            result["ended_by_nccl_error"] = float(status_1 is comm.WaitStatus.FAILED)
            t0 = time.monotonic()
            aborted = comm.abort_group(group)  # ncclCommAbort: the spinning kernel exits, the communicator is gone
            assert aborted is not None and aborted.wait(comm.ABORT_DEADLINE_S)
            result["abort_s"] = time.monotonic() - t0
        elif epoch == 1 and "hang" in epochs:
            store.set(f"in_collective/{worker}", "1")
    store.set(f"result/{worker}", json.dumps(result))


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == "worker":
    _worker(
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        tuple(int(w) for w in sys.argv[5].split(",")),
        sys.argv[6].split(","),
    )
