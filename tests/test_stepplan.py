"""``stepplan.StepPlan`` alone: the step's assignment as this worker keeps it (owners, quotas, efficient ids, the
data check's probe once per epoch) and its local accounting of the microbatches it computed. No group, no
collective: the members are given."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from protoparts import mlp_state, protocol_config, step_context

from unbroken.core.config import RecoveryPolicy
from unbroken.core.layout import ReplicaLayout
from unbroken.ft.stepplan import StepPlan
from unbroken.ft.stops import ProtocolConfig

pytestmark = pytest.mark.timeout(60)


def step_plan(cfg: ProtocolConfig, ring: tuple[int, ...], whole: bool) -> StepPlan:
    """The plan of a worker of MeCeFO's ``ring``; ``whole``: a replica of one rank (else a rank of a replica of two
    FSDP ranks, which counts its ids by rounds and probes no data)."""
    layout = ReplicaLayout() if whole else ReplicaLayout(shard=2)
    return StepPlan(step_context(cfg, mlp_state(), Path("unused"), ring=ring, layout=layout))


def test_every_id_planned_once_and_adopted() -> None:
    plan = step_plan(protocol_config(microbatches=6), ring=(0, 1, 2), whole=True)
    assignment = plan.make((0, 1, 2))
    assert sorted(j for w in (0, 1, 2) for j in assignment.ids_for(w)) == list(range(6))
    plan.adopt(assignment, epoch=1)
    assert plan.step_owners == assignment.owner_of()
    assert plan.quotas == {0: 2, 1: 2, 2: 2}
    probe = plan.probe
    assert probe is not None and probe.owner != probe.prober
    assert probe.microbatch in assignment.ids_for(probe.owner)
    plan.adopt(assignment, epoch=1)  # one probe per membership epoch
    assert plan.probe is None and plan.probe_fps == [0.0, 0.0]
    plan.adopt(assignment, epoch=2)
    assert plan.probe == probe


def test_a_replan_covers_only_the_ids_given() -> None:
    plan = step_plan(protocol_config(microbatches=8), ring=(0, 1, 2), whole=True)
    assignment = plan.make((0, 2), todo=[1, 5, 6])
    assert sorted(assignment.ids_for(0) + assignment.ids_for(2)) == [1, 5, 6]


def test_a_rank_of_a_replica_probes_nothing() -> None:
    plan = step_plan(protocol_config(), ring=(0, 1), whole=False)
    plan.adopt(plan.make((0, 1)), epoch=1)
    assert plan.probe is None


def test_mecefo_gives_a_dead_workers_ids_in_efficient_mode() -> None:
    cfg = protocol_config(microbatches=8, policy=RecoveryPolicy.MECEFO)
    plan = step_plan(cfg, ring=(0, 1, 2, 3), whole=True)
    assert plan.make((0, 1, 2, 3)).efficient == frozenset()
    assignment = plan.make((0, 1, 3))  # worker 2 is down: its ids go to its ring neighbour
    assert assignment.efficient and plan.efficient_ids == assignment.efficient
    assert all(plan.is_efficient(j) for j in assignment.efficient)
    assert not any(plan.is_efficient(j) for j in range(8) if j not in assignment.efficient)


def test_accounting_of_the_microbatches_computed() -> None:
    cfg = protocol_config(microbatches=4, policy=RecoveryPolicy.MECEFO)
    plan = step_plan(cfg, ring=(0, 1, 2), whole=True)
    assignment = plan.make((0, 1))  # worker 2 down: its neighbour computes in efficient mode
    efficient = min(assignment.efficient)
    exact = min(j for j in range(4) if j not in assignment.efficient)
    plan.after_backward(efficient, torch.tensor(0.5), tokens=16, seconds=2.0)
    plan.after_backward(exact, 1.5, tokens=8, seconds=None)
    assert plan.done == [efficient, exact]
    assert plan.done_efficient == [efficient]
    assert plan.loss_values() == {efficient: 0.5, exact: 1.5}  # the tensor read back as a number
    assert sum(plan.local_tokens.values()) == 24
    assert plan.my_speed == 2.0
    plan.note_speed(4.0)
    assert plan.my_speed == 3.0  # a moving average
    plan.begin()
    assert (plan.done, plan.done_efficient, plan.local_losses, plan.local_tokens) == ([], [], {}, {})
    assert plan.my_speed == 3.0  # kept across steps


def test_a_rank_of_a_replica_counts_by_rounds() -> None:
    plan = step_plan(protocol_config(), ring=(0,), whole=False)
    plan.after_backward(0, 1.0, tokens=4, seconds=None)
    assert plan.done == []  # its replica's ids are counted when a round is in every rank's accumulator
    plan.round_done([0, 1], seconds=0.5)
    plan.pipelined({1: 2.0}, {1: 4})
    assert plan.done == [0, 1] and plan.loss_values() == {0: 1.0, 1: 2.0} and plan.my_speed == 0.5


def test_counts_reset_at_each_step() -> None:
    plan = step_plan(protocol_config(), ring=(0,), whole=True)
    plan.recoveries, plan.recomputed, plan.redos = 2, 3, 1
    plan.reset_counts()
    assert (plan.recoveries, plan.recomputed, plan.redos) == (0, 0, 0)
