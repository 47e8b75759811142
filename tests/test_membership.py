"""``membership.Membership`` alone: forming the next epoch's group, what interrupts a wait, the state transfer of
a group of one, and the records it publishes (``protoparts``: a group of one, a stand-in coordinator client)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from protoparts import Client, member, mlp_state, protocol_config

from unbroken.control.member.client import Epoch
from unbroken.core.records import RecordKind, read_records
from unbroken.ft.comm import allreduce_async
from unbroken.ft.stops import Interrupted, StopRun

pytestmark = pytest.mark.timeout(60)


def test_forms_the_next_epochs_group(tmp_path: Path) -> None:
    client = Client(worker_id=3, epochs=(Epoch(1, (3,), "start"), Epoch(2, (3,), "re-formed")))
    members = member(protocol_config(), mlp_state(), tmp_path, client, formed=False)
    assert members.group is None and not members.publisher
    members.form_next_group()
    assert members.group is not None and members.group.epoch == 1
    members.form_next_group()  # an epoch newer than the current group's
    assert members.group.epoch == 2 and members.group.members == (3,)
    assert members.leader and members.publisher and members.units() == (3,) and members.unit == 3
    assert client.forming == [1, 2]


@pytest.mark.parametrize(
    ("refused", "reason", "current", "words", "fatal"),
    [
        ("another fingerprint", None, 0, "another fingerprint", False),
        (None, None, 2, "excluded from the membership", False),
        (None, "the job was stopped", 2, "the job was stopped", True),
        (None, None, 1, "no new membership epoch was published in time", True),
    ],
)
def test_without_a_next_epoch_the_worker_stops(
    tmp_path: Path, refused: str | None, reason: str | None, current: int, words: str, fatal: bool
) -> None:
    client = Client()
    members = member(protocol_config(), mlp_state(), tmp_path, client)
    client.refused, client.reason, client.current = refused, reason, current
    with pytest.raises(StopRun) as stop:
        members.form_next_group()  # no epoch after 1
    assert words in str(stop.value) and stop.value.fatal is fatal


def test_what_interrupts_a_wait(tmp_path: Path) -> None:
    client = Client()
    members = member(protocol_config(), mlp_state(), tmp_path, client)
    assert not members.interrupted()
    client.latest_epoch = 2  # a newer epoch: a join does not interrupt the group's collectives
    assert not members.interrupted()
    members.recovering = True  # while recovering, any newer epoch does
    assert members.interrupted()
    members.recovering = False
    client.left = True  # a member left the group for the newer epoch
    assert members.interrupted()
    client.left, client.latest_epoch = False, 1
    client.removed = {0}
    assert members.interrupted()
    client.removed, client.stopped = set(), "stopped by the user"
    assert members.interrupted()
    with pytest.raises(Interrupted):
        assert members.group is not None
        members.wait([allreduce_async(members.group, torch.zeros(1))])


def test_a_group_of_one_is_never_behind(tmp_path: Path) -> None:
    state = mlp_state()
    state.step = 5
    members = member(protocol_config(), state, tmp_path)
    assert members.sync_state() is False
    assert members.state_bytes == 0 and state.step == 5


def test_joiners_left_alone_stop_the_job_rather_than_train_from_nothing(tmp_path: Path) -> None:
    state = mlp_state()
    state.step = -1  # a joiner: it was to receive the state, and whoever held it has died
    members = member(protocol_config(), state, tmp_path)
    with pytest.raises(StopRun) as stop:
        members.sync_state()
    assert "holds the training state" in str(stop.value) and stop.value.fatal and stop.value.shared


def test_publishes_as_the_leader_and_writes_what_the_coordinator_left(tmp_path: Path) -> None:
    client = Client()
    members = member(protocol_config(), mlp_state(), tmp_path, client, formed=False)
    members.publish(RecordKind.EVAL, step=0, val_loss=1.0, val_ppl=2.7)  # no group yet: nobody publishes
    assert client.published == []
    members.form_next_group()
    members.publish(RecordKind.EVAL, step=1, val_loss=1.0, val_ppl=2.7)
    assert [r["step"] for r in client.records("eval")] == [1]
    members.append_undrained({"type": "coordinator_lost", "step": 2, "path": "-", "time": 0.0})
    assert [r["type"] for r in read_records(tmp_path)] == ["eval", "coordinator_lost"]
