"""``ckptio``: when a checkpoint is due, and ``Checkpoints`` alone on a group of one (``protoparts``): the leader's
write when due, its repair of a damaged one, and the load on ``--resume``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from protoparts import Client, joined, mlp_state, protocol_config, step_context

from unbroken.core import ckptfiles
from unbroken.ft.checkpoint import schema as ckpt
from unbroken.ft.checkpoint.policy import Checkpoints, checkpoint_due
from unbroken.ft.state import TrainingState
from unbroken.ft.stops import StopRun

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("every", "due"),
    [
        (0, [10]),  # only the final state
        (3, [3, 6, 9, 10]),
        (5, [5, 10]),
    ],
)
def test_due_every_n_steps_and_at_the_end(every: int, due: list[int]) -> None:
    assert [s for s in range(12) if checkpoint_due(s, total=10, every=every)] == due


def checkpoints(run_dir: Path, client: Client, every: int, state: TrainingState | None = None) -> Checkpoints:
    state = state if state is not None else mlp_state()
    ctx = step_context(protocol_config(checkpoint_every=every, checkpoint_keep=2), state, run_dir, client, total=10)
    return Checkpoints(ctx, joined(ctx))


def test_the_leader_saves_when_due(tmp_path: Path) -> None:
    client = Client()
    saving = checkpoints(tmp_path, client, every=2)
    for step in (1, 2, 3):
        saving.state.step = step
        saving.save_if_due()
    assert ckptfiles.list_checkpoints(tmp_path) == [2]
    ckpt.check(tmp_path, 2)
    (record,) = client.records("checkpoint")
    assert record["step"] == 2 and record["path"] == str(ckptfiles.checkpoint_path(tmp_path, 2))


def test_a_damaged_checkpoint_is_written_again(tmp_path: Path) -> None:
    saving = checkpoints(tmp_path, Client(), every=2)
    saving.state.step = 4
    saving.ensure()  # due and missing: written
    path = ckptfiles.checkpoint_path(tmp_path, 4)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])  # its writer died half-way
    with pytest.raises(ValueError):
        ckpt.check(tmp_path, 4)
    saving.ensure()
    assert path.read_bytes() == whole


def test_resume_loads_the_newest_good_checkpoint(tmp_path: Path) -> None:
    saving = checkpoints(tmp_path, Client(), every=2)
    saving.state.step = 2
    saving.write()
    saved = saving.state.checksum()
    client = Client()
    state = mlp_state(seed=1)
    loading = checkpoints(tmp_path, client, every=2, state=state)
    assert state.checksum() != saved
    loading.load()
    assert state.step == 2 and state.checksum() == saved
    (record,) = client.records("resume")
    assert record["step"] == 2


def test_resume_without_a_checkpoint_stops(tmp_path: Path) -> None:
    loading = checkpoints(tmp_path, Client(), every=2)
    with pytest.raises(StopRun, match="--resume: no usable checkpoint in"):
        loading.load()


def test_resume_from_a_checkpoint_of_another_model_stops(tmp_path: Path) -> None:
    saving = checkpoints(tmp_path, Client(), every=2)
    saving.state.step = 2
    saving.write()
    other = TrainingState()
    other.model = torch.nn.Linear(3, 3)
    with pytest.raises(StopRun, match="is for a different model"):
        checkpoints(tmp_path, Client(), every=2, state=other).load()
