"""Checkpoints: atomic save with a checksum manifest, fallback past corrupt or partial ones, pruning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unbroken.ft.checkpoint import schema as ckpt

pytestmark = pytest.mark.timeout(30)


def _state(step: int) -> dict:
    return ckpt.build_state(step, {"w": torch.full((4, 4), float(step))}, None, {}, {}, {"config": "x"})


def test_save_load_and_prune(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        ckpt.save_checkpoint(tmp_path, step, _state(step), keep=2)
    assert ckpt.list_checkpoints(tmp_path) == [15, 10]
    loaded = ckpt.load_latest(tmp_path)
    assert loaded is not None and loaded.step == 15 and not loaded.skipped
    assert torch.equal(loaded.state["model"]["w"], torch.full((4, 4), 15.0))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete_data", "garbage_manifest"])
def test_corrupt_newest_falls_back_to_previous(tmp_path: Path, damage: str) -> None:
    for step in (5, 10):
        ckpt.save_checkpoint(tmp_path, step, _state(step), keep=3)
    newest = ckpt.checkpoint_dir(tmp_path) / "step_00000010.pt"
    if damage == "flip":
        data = bytearray(newest.read_bytes())
        data[len(data) // 2] ^= 0xFF
        newest.write_bytes(bytes(data))
    elif damage == "truncate":
        newest.write_bytes(newest.read_bytes()[:100])
    elif damage == "delete_data":
        newest.unlink()
    else:
        newest.with_suffix(".json").write_text("{not json")
    loaded = ckpt.load_latest(tmp_path)
    assert loaded is not None and loaded.step == 5
    assert len(loaded.skipped) == 1 and "step 10" in loaded.skipped[0]


def test_partial_save_is_ignored_and_cleaned(tmp_path: Path) -> None:
    ckpt.save_checkpoint(tmp_path, 5, _state(5), keep=3)
    directory = ckpt.checkpoint_dir(tmp_path)
    (directory / "step_00000010.pt.123.tmp").write_bytes(b"half")  # killed while writing data
    (directory / "step_00000015.pt").write_bytes(b"no manifest")  # killed before the manifest
    assert ckpt.load_latest(tmp_path).step == 5
    removed = ckpt.clean_partial(tmp_path)
    assert {p.name for p in removed} == {"step_00000010.pt.123.tmp", "step_00000015.pt"}


def test_no_checkpoint(tmp_path: Path) -> None:
    assert ckpt.load_latest(tmp_path) is None


class Arbitrary:
    """Any class that is not a tensor or a plain value: weights_only loading must refuse it."""


def test_weights_only_refuses_arbitrary_objects(tmp_path: Path) -> None:
    state = ckpt.build_state(1, {"w": torch.zeros(1)}, None, {"obj": Arbitrary()}, {}, {})
    ckpt.save_checkpoint(tmp_path, 1, state, keep=2)
    assert ckpt.load_latest(tmp_path) is None


def test_the_state_schema_round_trips_and_refuses_what_is_not_it() -> None:
    state = ckpt.build_state(
        7,
        {"w": torch.arange(6.0).view(2, 3)},
        {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        {"counter": {"n": 4}},
        {"scale": {"bound_exp": [1, -2], "num_microbatches": 8}},
        {"config": "[train]", "vocab_size": 10},
    )
    again = ckpt.decode(ckpt.encode(state))
    assert again.keys() == state.keys() and again["step"] == 7 and again["metadata"] == state["metadata"]
    assert torch.equal(again["model"]["w"], state["model"]["w"]) and again["extra"] == {"counter": {"n": 4}}
    assert again["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    for broken, message in [
        ({**state, "format": 1}, "format 1"),
        ({k: v for k, v in state.items() if k != "ft"}, "lacks ft"),
        ({**state, "step": -1}, "step -1"),
        ({**state, "model": []}, "model of type list"),
    ]:
        with pytest.raises(ValueError, match=message):
            ckpt.decode(ckpt.encode(broken))


def _sharded(run: Path, step: int, keep: int = 3) -> Path:
    """A sealed sharded checkpoint of ``step`` as its writers leave it: DCP's files (stand-ins: their content does
    not matter to sealing and verifying) and ``ft.pt``, the replicated rest of the state."""
    from unbroken.core import ckptfiles

    temp = ckptfiles.sharded_temp(run, step, "0-abc")
    temp.mkdir(parents=True)
    for name, data in ((".metadata", b"meta"), ("__0_0.distcp", b"rank 0" * 100), ("__1_0.distcp", b"rank 1" * 100)):
        (temp / name).write_bytes(data)
    rest = ckpt.build_state(step, {}, None, {}, {"scale": None}, {"config": "x"})
    (temp / ckpt.REST_FILE).write_bytes(ckpt.encode(rest))
    return ckptfiles.seal_directory(run, step, temp, keep)


def test_a_sharded_checkpoint_is_sealed_verified_pruned_and_its_leftovers_cleaned(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        sealed = _sharded(tmp_path, step, keep=2)
        assert sealed == ckpt.sharded_path(tmp_path, step) and sealed.is_dir()
    assert ckpt.list_checkpoints(tmp_path) == [15, 10]
    assert not ckpt.sharded_path(tmp_path, 5).exists()  # pruned with its manifest
    loaded = ckpt.load_latest(tmp_path, read_sharded=False)
    assert loaded is not None and loaded.sharded and loaded.step == 15 and loaded.path.name == "step_00000015.dcp"
    ckpt.check(tmp_path, 15)
    # A flipped byte, a missing file: the newest is rejected and the previous one used.
    shard = ckpt.sharded_path(tmp_path, 15) / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0xFF
    shard.write_bytes(bytes(data))
    loaded = ckpt.load_latest(tmp_path, read_sharded=False)
    assert loaded is not None and loaded.step == 10 and "fails its checksum" in loaded.skipped[0]
    (ckpt.sharded_path(tmp_path, 10) / "__0_0.distcp").unlink()
    assert ckpt.load_latest(tmp_path, read_sharded=False) is None
    # A writer killed before the seal, or after the rename but before the manifest: ignored, then removed.
    from unbroken.core import ckptfiles

    ckptfiles.sharded_temp(tmp_path, 20, "1-def").mkdir()
    ckpt.sharded_path(tmp_path, 25).mkdir()
    assert ckpt.list_checkpoints(tmp_path) == [15, 10]
    removed = {p.name for p in ckpt.clean_partial(tmp_path)}
    assert removed == {"step_00000020.dcp.1-def.tmp", "step_00000025.dcp"}


def test_a_streamed_save_writes_the_encoded_state_and_a_half_written_one_is_ignored(tmp_path: Path) -> None:
    """The state streams to disk (no whole copy in memory): the file is ``encode``'s bytes and the manifest
    names their size and sha256. Failure injection's ``midway`` runs once, with half the tensors' bytes or more
    in the temporary file and the checkpoint not yet visible: a kill there leaves the previous one loaded."""
    import hashlib
    import json

    state = ckpt.build_state(7, {"w": torch.arange(50_000, dtype=torch.float32)}, None, {}, {}, {"config": "x"})
    ckpt.save_checkpoint(tmp_path, 5, _state(5), keep=3)
    directory = ckpt.checkpoint_dir(tmp_path)
    seen: list[int] = []

    def midway() -> None:
        (tmp,) = directory.glob("step_00000007.pt.*.tmp")
        seen.append(tmp.stat().st_size)
        assert ckpt.load_latest(tmp_path).step == 5

    path = ckpt.save_checkpoint(tmp_path, 7, state, keep=3, midway=midway)
    data = path.read_bytes()
    assert data == ckpt.encode(state)
    manifest = json.loads(path.with_suffix(".json").read_text())
    assert manifest["bytes"] == len(data) and manifest["sha256"] == hashlib.sha256(data).hexdigest()
    assert len(seen) == 1 and 50_000 * 4 // 2 <= seen[0] < len(data)
    assert ckpt.load_latest(tmp_path).step == 7
