"""``reduction.StepReduction`` alone on a group of one (``protoparts``): the reduced gradient and side vector, the
checks on them, a non-finite gradient found and attributed, a fixed-point overflow grown out of, the data check,
and an interrupted reduction. The oracles: fp32 reduces to the local accumulated gradient bit for bit, and exact
mode gives the same bits whatever the order of the microbatches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from protoparts import Client, M, OneWorker, loss_of, mlp_state, protocol_config

from unbroken.core.config import RecoveryPolicy, Reduction
from unbroken.ft.datacheck import Probe
from unbroken.ft.sidevec import Reduced
from unbroken.ft.stops import Interrupted, InvariantViolation

pytestmark = pytest.mark.timeout(60)


def reference_grads(order: list[int]) -> list[torch.Tensor]:
    state = mlp_state()
    assert state.model is not None
    for j in order:
        (loss_of(state.model, j) / M).backward()
    return [p.grad.clone() for p in state.model.parameters() if p.grad is not None]


def test_fp32_reduces_to_the_local_gradient(tmp_path: Path) -> None:
    worker = OneWorker(tmp_path, protocol_config(microbatches=M))
    worker.compute([0, 1, 2, 3])
    reduced = worker.reduce()
    assert reduced.counted == [1] * M and reduced.members == 1 and reduced.tokens == [16] * M
    assert not worker.reduction.overflowed(reduced) and not worker.reduction.nonfinite_found(reduced)
    worker.reduction.accept(reduced, nonfinite=False)
    assert worker.reduction.reduced == reduced and not worker.reduction.nonfinite
    for got, want in zip(worker.grads(), reference_grads([0, 1, 2, 3]), strict=True):
        assert torch.equal(got, want)


def test_exact_mode_is_independent_of_the_order(tmp_path: Path) -> None:
    cfg = protocol_config(microbatches=M, reduction=Reduction.EXACT)
    grads = []
    for n, order in enumerate(([0, 1, 2, 3], [3, 1, 0, 2])):
        worker = OneWorker(tmp_path / str(n), cfg)
        worker.compute(order)
        reduced = worker.reduce()
        worker.reduction.accept(reduced, worker.reduction.nonfinite_found(reduced))
        grads.append(worker.grads())
    for a, b, fp32 in zip(*grads, reference_grads([0, 1, 2, 3]), strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, fp32)


def reduced_counts(counted: list[int], members: int = 1, epoch_sum: int = 1) -> Reduced:
    zeros = [0] * len(counted)
    return Reduced([0.0] * len(counted), zeros, counted, zeros, zeros, 0, {}, {}, epoch_sum, members, 0)


@pytest.mark.parametrize(
    ("policy", "counted", "members", "words"),
    [
        (RecoveryPolicy.RECOVER, [1, 1, 1, 1], 1, None),
        (RecoveryPolicy.RECOVER, [1, 2, 0, 1], 1, "microbatch ids [1, 2] were counted [2, 0] times"),
        (RecoveryPolicy.DROP, [1, 0, 1, 0], 1, None),
        (RecoveryPolicy.DROP, [0, 0, 0, 0], 1, "under drop each id is counted at most once and one at least"),
        (RecoveryPolicy.DROP, [2, 0, 1, 0], 1, "under drop each id is counted at most once"),
        (RecoveryPolicy.RECOVER, [1, 1, 1, 1], 2, "the members disagree on the epoch"),
    ],
)
def test_the_checks_that_guard_the_state(
    tmp_path: Path, policy: RecoveryPolicy, counted: list[int], members: int, words: str | None
) -> None:
    worker = OneWorker(tmp_path, protocol_config(microbatches=M, policy=policy))
    reduced = reduced_counts(counted, members=members)
    if words is None:
        worker.reduction.check_invariants(reduced)
        return
    with pytest.raises(InvariantViolation, match=words.replace("[", r"\[").replace("]", r"\]")) as violation:
        worker.reduction.check_invariants(reduced)
    assert violation.value.shared


def poison(worker: OneWorker, microbatch: int) -> torch.utils.hooks.RemovableHandle:
    """An infinite gradient of the model's third parameter, for ``microbatch`` only."""
    assert worker.state.model is not None
    weight = list(worker.state.model.parameters())[2]
    return weight.register_hook(lambda g: g * float("inf") if worker.reduction.reducer.current == microbatch else g)


@pytest.mark.parametrize("reduction", [Reduction.FP32, Reduction.EXACT])
def test_a_nonfinite_gradient_is_found_and_attributed(tmp_path: Path, reduction: Reduction) -> None:
    worker = OneWorker(tmp_path, protocol_config(microbatches=M, reduction=reduction))
    poison(worker, 2)
    worker.compute([0, 1, 2, 3])
    reduced = worker.reduce()
    assert not worker.reduction.overflowed(reduced)
    nonfinite = worker.reduction.nonfinite_found(reduced)
    worker.reduction.accept(reduced, nonfinite)
    assert nonfinite and worker.reduction.nonfinite
    found = worker.reduction.culprits()
    assert found is not None and found.bad_param == {0: 2}  # worker 0, the model's parameter 2
    # exact mode checks each microbatch as it folds it; fp32 sees only the sum of this worker's
    want = [0, 0, 1, 0] if reduction is Reduction.EXACT else [1, 1, 1, 1]
    assert found.nonfinite == want
    assert worker.reduction.tensors.names[2] == "2.weight"


def test_a_fixed_point_overflow_grows_the_scale(tmp_path: Path) -> None:
    worker = OneWorker(tmp_path, protocol_config(microbatches=M, reduction=Reduction.EXACT))
    scale = worker.state.scale
    assert scale is not None
    before = scale.exponents()
    worker.compute([0, 1, 2, 3], factors={1: 1e30})
    reduced = worker.reduce()
    assert reduced.overflow == 1 and worker.reduction.overflowed(reduced)
    worker.reduction.grow_scale()
    assert scale.exponents() != before
    worker.compute([0, 1, 2, 3], factors={1: 1e30})  # the step again, at the grown scale
    reduced = worker.reduce()
    assert reduced.overflow == 0 and not worker.reduction.nonfinite_found(reduced)


def test_the_data_check_publishes_a_mismatch(tmp_path: Path) -> None:
    client = Client()
    worker = OneWorker(tmp_path, protocol_config(microbatches=M), client)
    worker.compute([0, 1, 2, 3])
    worker.plan.probe = Probe(microbatch=1, owner=0, prober=5)
    worker.plan.probe_fps = [11.0, 12.0]  # as if the prober's sum had come from another worker
    reduced = worker.reduce()
    worker.reduction.accept(reduced, nonfinite=False)
    (record,) = client.records("impure_data")
    assert record["microbatch"] == 1 and record["workers"] == [0, 5]


def test_an_interrupted_reduction_raises_and_forgets_its_buffers(tmp_path: Path) -> None:
    client = Client()
    worker = OneWorker(tmp_path, protocol_config(microbatches=M), client)
    worker.compute([0, 1, 2, 3])
    client.stopped = "the job was stopped"
    with pytest.raises(Interrupted):
        worker.reduction.reduce()
    assert not worker.reduction.reducer.flat.any()  # disarmed: a later reduction starts from the local gradients
