"""The step protocol driven by threads of this process on real gloo groups (``ftharness``): seconds, no processes.

The oracles are derived, not observed: exact reduction makes N workers equal one worker bit for bit; in fp32
a failure changes only the order of a sum of the same M microbatch gradients, so the reduced gradient stays
within the summation bound ``2 * gamma(M - 1) * sum_j |g_j|`` of the failure-free one; MeCeFO averages the
attention gradient over the microbatches that produced one, which is a sum worked out here by hand.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from ftharness import Died, ThreadJob
from torch import nn

from unbroken.core.config import RunConfig
from unbroken.core.records import read_records
from unbroken.ft.api import Context
from unbroken.ft.process import Job, WorkerLeft
from unbroken.ft.protocol import EXIT_STOPPED
from unbroken.train.model import FLAVOURS, Transformer

pytestmark = pytest.mark.timeout(120)

U = 2.0**-24  # float32 unit roundoff


def config(**sections: dict) -> RunConfig:
    cfg = RunConfig()
    base = {
        "train": {"steps": 4, "microbatches": 4, "threads": 1},
        "comm": {"heartbeat_timeout_s": 1.0, "heartbeat_interval_s": 0.1, "join_timeout_s": 30.0},
        "checkpoint": {"every": 0},
    }
    for name, values in {**base, **sections}.items():
        cfg = replace(cfg, **{name: replace(getattr(cfg, name), **{**base.get(name, {}), **values})})
    return cfg


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A microbatch's data: a pure function of (step, id)."""
    gen = torch.Generator().manual_seed(1000 * step + microbatch)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)


def loss_of(model: nn.Module, step: int, microbatch: int) -> torch.Tensor:
    x, y = batch(step, microbatch)
    return nn.functional.mse_loss(model(x), y)


def train_loop(ctx: Context, model: nn.Module, die_at: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """The user's loop: SGD on the MLP; ``die_at = (step, k)`` dies before its k-th microbatch of that step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.register_state(model, opt)
    for step in ctx.steps():
        for k, mb in enumerate(step.microbatches()):
            if die_at == (step.index, k):
                raise Died
            step.backward(loss_of(model, step.index, mb))
        step.commit(opt)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_exact_reduction_makes_three_workers_one(tmp_path: Path) -> None:
    cfg = config(recovery={"reduction": "exact"})
    results = {}
    for n in (1, 3):
        job = ThreadJob(tmp_path / f"w{n}", cfg, n)
        models = [mlp() for _ in range(n)]
        try:
            results[n] = job.run(lambda ctx, w, models=models: train_loop(ctx, models[w]))
        finally:
            job.close()
    ref = results[1][0]
    for params in results[3].values():
        assert all(torch.equal(params[k], ref[k]) for k in ref)


def test_exact_reduction_with_a_death_mid_step_is_the_failure_free_run(tmp_path: Path) -> None:
    cfg = config(recovery={"reduction": "exact"})
    clean = ThreadJob(tmp_path / "clean", cfg, 3)
    failed = ThreadJob(tmp_path / "failed", cfg, 3)
    try:
        models = [mlp() for _ in range(3)]
        ref = clean.run(lambda ctx, w: train_loop(ctx, models[w]))[0]
        models = [mlp() for _ in range(3)]
        results = failed.run(lambda ctx, w: train_loop(ctx, models[w], die_at=(2, 0) if w == 1 else None))
    finally:
        clean.close()
        failed.close()
    assert sorted(results) == [0, 2]  # worker 1 died in step 2, before its first microbatch
    for params in results.values():
        assert all(torch.equal(params[k], ref[k]) for k in ref)


def test_drop_loses_only_the_dead_members_share(tmp_path: Path) -> None:
    """Under ``drop``, worker 1 dies at step 2 before computing its microbatch, while worker 0 meets the death
    before it has started the step (it waits for the new epoch): only worker 1's microbatch is lost; worker
    0 still computes its own."""
    cfg = config(recovery={"reduction": "exact", "policy": "drop"}, train={"microbatches": 3})
    job = ThreadJob(tmp_path / "run", cfg, 3)

    def loop(ctx: Context, worker: int) -> None:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx.register_state(model, opt)
        for step in ctx.steps():
            if worker == 0 and step.index == 2:
                deadline = time.monotonic() + 30
                while job.coordinator.epoch < 2:  # the death is published before worker 0 starts the step
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            for k, mb in enumerate(step.microbatches()):
                if worker == 1 and (step.index, k) == (2, 0):
                    raise Died
                step.backward(loss_of(model, step.index, mb))
            step.commit(opt)

    try:
        job.run(loop)
    finally:
        job.close()
    dropped = {r["step"]: r["dropped"] for r in read_records(tmp_path / "run", "step")}
    assert dropped == {0: 0, 1: 0, 2: 1, 3: 0}


def test_fp32_reduced_gradient_after_a_failure_is_within_the_summation_bound(tmp_path: Path) -> None:
    """Worker 2 dies holding its microbatch of step 0; the survivors recompute it. Both runs sum the same M
    float32 microbatch gradients (each is computed by the same kernels whoever computes it), in different
    orders: each result is within gamma(M - 1) * sum_j |g_j| of the exact sum, so they are within twice that
    of each other, elementwise (gamma(n) = n u / (1 - n u), u the unit roundoff)."""
    M = 4
    cfg = config(train={"steps": 1, "microbatches": M})

    def loop(ctx: Context, w: int, models: list[nn.Module], die: bool) -> list[torch.Tensor]:
        model = models[w]
        ctx.register_state(model)
        grads: list[torch.Tensor] = []
        for step in ctx.steps():
            for mb in step.microbatches():
                if die and w == 2:
                    raise Died
                step.backward(loss_of(model, step.index, mb))
            grads = [p.grad.clone() for p in model.parameters()]
            step.commit()
        return grads

    runs = {}
    for name, die in (("clean", False), ("failed", True)):
        job = ThreadJob(tmp_path / name, cfg, 4)
        models = [mlp() for _ in range(4)]
        try:
            runs[name] = job.run(lambda ctx, w, models=models, die=die: loop(ctx, w, models, die))
        finally:
            job.close()
    assert sorted(runs["failed"]) == [0, 1, 3]
    model = mlp()
    magnitude = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    for j in range(M):
        model.zero_grad()
        (loss_of(model, 0, j) / M).backward()
        for acc, p in zip(magnitude, model.parameters(), strict=True):
            acc += p.grad.double().abs()
    gamma = (M - 1) * U / (1 - (M - 1) * U)
    clean, failed = runs["clean"][0], runs["failed"][0]
    for a, b, s in zip(clean, failed, magnitude, strict=True):
        assert bool(((a.double() - b.double()).abs() <= 2 * gamma * s).all())


def test_mecefo_averages_attention_gradients_over_the_microbatches_that_produced_them(tmp_path: Path) -> None:
    """Two workers, M = 4: worker 0 computes ids 0 and 1 exactly; worker 1 dies before its ids 2 and 3, which
    worker 0 then adopts in efficient mode (attention skipped in backward). The attention parameters' step
    gradient must be the mean over the two exact microbatches, (g0 + g1) / 2, by hand below."""
    M = 4
    cfg = config(recovery={"policy": "mecefo"}, train={"steps": 1, "microbatches": M}, mecefo={"rank": 8})
    args = replace(FLAVOURS["tiny"], vocab_size=64, max_seq_len=16, dim=32, ffn_hidden=64)

    def model() -> Transformer:
        torch.manual_seed(0)
        return Transformer(args)

    def tokens(j: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(j)
        seq = torch.randint(0, args.vocab_size, (2, 17), generator=gen)
        return seq[:, :-1], seq[:, 1:]

    def xent(m: nn.Module, j: int) -> torch.Tensor:
        x, y = tokens(j)
        return nn.functional.cross_entropy(m(x).reshape(-1, args.vocab_size), y.reshape(-1))

    def loop(ctx: Context, w: int, models: list[nn.Module]) -> dict[str, torch.Tensor]:
        m = models[w]
        ctx.register_state(m)
        for step in ctx.steps():
            for mb in step.microbatches():
                if w == 1:
                    raise Died
                step.backward(xent(m, mb))
            grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
            step.commit()
        return grads

    job = ThreadJob(tmp_path / "mecefo", cfg, 2)
    models = [model(), model()]
    try:
        grads = job.run(lambda ctx, w: loop(ctx, w, models))[0]
    finally:
        job.close()
    reference = model()
    exact = [{}, {}]
    for j in (0, 1):
        reference.zero_grad()
        (xent(reference, j) / M).backward()
        exact[j] = {n: p.grad.clone() for n, p in reference.named_parameters()}
    attention = [n for n in exact[0] if ".attention." in n or "attention_norm" in n]
    assert attention
    for name in attention:
        # (g0/M + g1/M) summed as autograd accumulates them, then x M/2 (exact: powers of two)
        expected = (exact[0][name] + exact[1][name]) * (M / 2)
        assert torch.equal(grads[name], expected), name


def test_a_member_that_left_for_a_newer_epoch_is_seen_by_the_others(tmp_path: Path) -> None:
    """The way out of a superseded group: members interrupted while recovering leave for the newest epoch,
    and one that had already finished recovering waits in the old group's collective alone (chaos seed 1002,
    random-time: 60 s, the collective timeout). Each member says which epoch it leaves for before forming
    it; the others read it. Nobody else's announcement, or one for an epoch not newer, means nothing."""
    from unbroken.control.member.client import LEFT_CHECK_S, CoordinatorClient

    job = ThreadJob(tmp_path / "run", config(), 2)
    clients = [CoordinatorClient(job.coordinator.address, w, token=job.token) for w in (0, 1)]
    try:
        assert not clients[0].left_for_newer(1, (0, 1))
        clients[0].announce_forming(2)  # its own announcement is not a member leaving
        time.sleep(2 * LEFT_CHECK_S)
        assert not clients[0].left_for_newer(1, (0, 1))
        clients[1].announce_forming(2)
        time.sleep(2 * LEFT_CHECK_S)
        assert clients[0].left_for_newer(1, (0, 1))
        time.sleep(2 * LEFT_CHECK_S)
        assert not clients[0].left_for_newer(2, (0, 1))  # it left for 2, not for a newer one than 2
        time.sleep(2 * LEFT_CHECK_S)
        assert not clients[0].left_for_newer(1, (0, 2))  # worker 1 is not in that group
    finally:
        for c in clients:
            c.close()
        job.close()


def test_a_worker_that_registers_after_the_run_ended_leaves_with_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted worker reached the coordinator (its probe: the config, the run directory) while the run went
    on, but was still building its model when the run finished and the coordinator went away: registering
    then fails, and the worker leaves with one line, not a traceback."""
    job = ThreadJob(tmp_path / "run", config(), 1)
    late = Job(job.coordinator.address, job.token, job.cfg, job.run_dir, 1, exit_process=False)
    assert not late.resume()  # its probe, while the coordinator is up
    try:
        job.run(lambda ctx, w: train_loop(ctx, mlp()))
    finally:
        job.close()
    assert read_records(job.run_dir, "final")
    with caplog.at_level(logging.INFO, logger="unbroken.ft.process"), pytest.raises(WorkerLeft) as left:
        late.register()
    assert left.value.code == EXIT_STOPPED
    (line,) = [r for r in caplog.records if r.name == "unbroken.ft.process"]
    assert line.getMessage().startswith(f"cannot join the job at {job.coordinator.address}: ")


def look_at_the_reduction_after_a_death(ctx: Context) -> None:
    """The next reduction's wait starts only once a member's death is published: its collectives, launched,
    complete meanwhile, but it then sees the newer epoch and takes the reduction for interrupted."""
    proto = ctx._proto
    assert proto is not None
    reducer, membership = proto.reduction.reducer, proto.membership
    original = reducer.wait

    def late_wait(timeout_s: float, interrupted: Callable[[], bool]) -> Any:
        reducer.wait = original  # type: ignore[method-assign]
        group = membership.group
        assert group is not None
        while not membership.client.removed_since(group.epoch, group.members):
            time.sleep(0.01)
        return original(timeout_s, interrupted)

    reducer.wait = late_wait  # type: ignore[method-assign]


def evaluations_after_a_recovery(run_dir: Path, received_the_state: bool) -> dict[int, list[float | None]]:
    """Three workers. In step 1 worker 1's reduction completes, but it looks at it only once worker 2's death is
    published: it takes the reduction for interrupted and recovers in the step. Worker 2 committed step 1, then died

    - in the evaluation after it (not ``received_the_state``; steps 0..2, an evaluation after each): worker 0, which
      committed step 1, is interrupted in that evaluation and recovers there;
    - before its first microbatch of step 2 (``received_the_state``; steps 0..3, evaluations after steps 2 and 3
      only): worker 0 recovers in step 2's reduction, and worker 1 receives step 2's state from it and computes its
      share of step 2 in its next loop iteration, having met no failure in that iteration: it must still skip the
      evaluation after step 2 as worker 0 does (the group recovered in step 2).

    Returns each survivor's evaluations."""
    job = ThreadJob(run_dir, config(train={"steps": 4 if received_the_state else 3}), 3)

    def loop(ctx: Context, worker: int) -> list[float | None]:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx.register_state(model, opt)
        values = []
        for step in ctx.steps():
            if worker == 1 and step.index == 1:
                look_at_the_reduction_after_a_death(ctx)  # the wait ends microbatches()
            for mb in step.microbatches():
                if received_the_state and worker == 2 and step.index == 2:
                    raise Died
                step.backward(loss_of(model, step.index, mb))
            step.commit(opt)
            if received_the_state and step.index < 2:
                continue

            def val(k: int, s: int = step.index) -> float:
                if worker == 2 and s == 1:
                    raise Died
                return float(k)

            values.append(ctx.evaluate(6, val))
        return values

    try:
        return job.run(loop)
    finally:
        job.close()


@pytest.mark.parametrize(
    ("received_the_state", "expected", "committed"),
    [(False, [2.5, None, 2.5], [0, 1, 2]), (True, [None, 2.5], [0, 1, 2, 3])],
)
def test_every_member_skips_the_evaluation_after_a_step_some_recovered_in(
    tmp_path: Path, received_the_state: bool, expected: list[float | None], committed: list[int]
) -> None:
    """The members recovered at different points (``evaluations_after_a_recovery``: worker 1 in step 1's
    reduction, worker 0 in the evaluation that follows it, or in step 2's reduction while worker 1 receives the
    state): both skip the evaluation after the step the group recovered in, so their next collectives (the next
    step's) match. One evaluating there put its evaluation's allreduce against the other's gradient buckets on the
    new group (gloo aborts the process: a size mismatch on its loop thread), hence a process of its own."""
    import json
    import os
    import subprocess
    import sys

    code = (
        "import json, sys; from pathlib import Path; import test_protocol as t; "
        f"print(json.dumps(t.evaluations_after_a_recovery(Path(sys.argv[1]), {received_the_state})))"
    )
    tests = Path(__file__).parent
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}  # c10d's warnings would bury gloo's one line
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=100, cwd=tests, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    values = {int(w): v for w, v in json.loads(done.stdout.splitlines()[-1]).items()}
    assert values == {0: expected, 1: expected}, values
    steps = [r for r in read_records(tmp_path / "run", "step") if r["committed"] and not r.get("republished")]
    assert sorted(r["step"] for r in steps) == committed
