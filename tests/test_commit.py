"""``commit.StepCommit`` alone on a group of one (``protoparts``): the optimizer step on the reduced gradient and
the step record; the skip decision for a non-finite gradient (skip, stop, too many skips in a row); the record a
new leader publishes again."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from protoparts import Client, M, OneWorker, protocol_config

from unbroken.core.config import NonfinitePolicy
from unbroken.ft.sidevec import Reduced
from unbroken.ft.state import StepOutcome
from unbroken.ft.stops import EXIT_NONFINITE, ProtocolConfig, StopRun
from unbroken.ft.update import StepCommit

pytestmark = pytest.mark.timeout(60)


class Committing(OneWorker):
    """One worker's reduction and commit."""

    def __init__(self, run_dir: Path, cfg: ProtocolConfig, client: Client) -> None:
        super().__init__(run_dir, cfg, client)
        self.committer = StepCommit(self.ctx, self.membership, self.plan, self.reduction.tensors)

    def step(self, clip_grad_norm: float = 0.0) -> StepOutcome:
        self.plan.adopt(self.plan.make(self.membership.units()), epoch=1)
        self.compute(list(range(M)))
        reduced = self.reduce()
        self.reduction.accept(reduced, self.reduction.nonfinite_found(reduced))
        return self.committer.commit(self.reduction, self.state.optimizer, clip_grad_norm, seconds=2.0)


def test_a_committed_step_and_its_record(tmp_path: Path) -> None:
    client = Client()
    worker = Committing(tmp_path, protocol_config(), client)
    model = worker.state.model
    assert model is not None
    before = [p.detach().clone() for p in model.parameters()]
    outcome = worker.step()
    grads = worker.grads()
    for p, b, g in zip(model.parameters(), before, grads, strict=True):
        assert torch.equal(p.detach(), b.add(g, alpha=-0.1))  # SGD, lr 0.1
    assert worker.state.step == 1 and worker.state.last == outcome and not outcome.skipped
    assert outcome.lr == 0.1
    assert outcome.grad_norm == pytest.approx(float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))))
    losses = worker.plan.loss_values()
    assert outcome.loss == pytest.approx(sum(losses.values()) / M)
    assert worker.committer.switch_epoch == 1  # the leader's newest epoch at the reduction
    (record,) = client.records("step")
    assert record["step"] == 0 and record["committed"] and record["counted"] == M and record["counted_once"]
    assert record["tokens"] == 16 * M and record["tokens_per_s"] == 16 * M / 2.0
    assert record["quotas"] == {"0": M} and record["alive"] == 1 and record["epoch"] == 1
    assert record["workers"] == 1 and record["gpus"] == 0  # the CPU: no per-GPU figures


def test_clipping_returns_the_norm_before_it(tmp_path: Path) -> None:
    worker = Committing(tmp_path, protocol_config(), Client())
    outcome = worker.step(clip_grad_norm=1e-3)
    norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in worker.grads()])))
    assert outcome.grad_norm > 1e-3 and norm == pytest.approx(1e-3, rel=1e-4)  # torch divides by norm + 1e-6


def nonfinite_in(microbatch: int, worker: int, param: int) -> Reduced:
    nonfinite = [1 if j == microbatch else 0 for j in range(M)]
    zeros = [0] * M
    return Reduced([0.0] * M, zeros, [1] * M, zeros, nonfinite, 0, {}, {worker: param}, 1, 1, 0)


def test_a_nonfinite_step_is_skipped_then_stops_after_too_many(tmp_path: Path) -> None:
    client = Client()
    worker = Committing(tmp_path, protocol_config(max_nonfinite_skips=2), client)
    skip = worker.committer.skip
    outcome = skip(5, nonfinite_in(2, 0, 2), loss=1.5, lr=0.1, common={"recomputed": 1})
    assert outcome.skipped and math.isnan(outcome.grad_norm) and outcome.loss == 1.5 and outcome.recomputed == 1
    assert worker.state.nonfinite_streak == 1
    (record,) = client.records("nonfinite_skip")
    assert record["microbatches"] == [2] and record["workers"] == [0] and record["parameter"] == "2.weight"
    with pytest.raises(StopRun) as stop:
        skip(6, nonfinite_in(1, 0, 0), loss=1.5, lr=0.1, common={})
    assert stop.value.code == EXIT_NONFINITE and stop.value.shared and stop.value.fatal
    assert "2 consecutive steps skipped" in str(stop.value) and "parameter 0.weight" in str(stop.value)


def test_a_nonfinite_step_stops_the_run_under_stop(tmp_path: Path) -> None:
    client = Client()
    worker = Committing(tmp_path, protocol_config(nonfinite=NonfinitePolicy.STOP), client)
    with pytest.raises(StopRun) as stop:
        worker.committer.skip(3, nonfinite_in(0, 0, 2), loss=1.0, lr=0.1, common={})
    assert stop.value.code == EXIT_NONFINITE and stop.value.shared
    assert str(stop.value).startswith("step 3: non-finite gradient in microbatch 0 (worker 0), first in parameter")
    assert "(train.nonfinite = stop)" in str(stop.value)
    assert worker.state.nonfinite_streak == 0 and client.records("nonfinite_skip") == []


def test_a_committed_step_ends_a_run_of_skips(tmp_path: Path) -> None:
    worker = Committing(tmp_path, protocol_config(), Client())
    worker.state.nonfinite_streak = 3
    worker.step()
    assert worker.state.nonfinite_streak == 0


def test_the_last_step_published_again(tmp_path: Path) -> None:
    client = Client()
    worker = Committing(tmp_path, protocol_config(), client)
    worker.committer.republish_last_step()  # no step committed yet: nothing to publish again
    assert client.records("step") == []
    worker.step()
    worker.committer.republish_last_step()
    first, again = client.records("step")
    assert again["republished"] and again["step"] == first["step"] == 0 and again["loss"] == first["loss"]
    assert again["tokens"] == 0 and "counted" not in again  # no counts or timing of its own
