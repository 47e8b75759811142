"""Checkpoints: atomic save with a checksum manifest, fallback past corrupt or partial ones, pruning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unbroken.ft import checkpoint as ckpt

pytestmark = pytest.mark.timeout(30)


def _state(step: int) -> dict:
    return {"step": step, "model": {"w": torch.full((4, 4), float(step))}, "config": "x"}


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
    (directory / "step_00000010.pt.tmp").write_bytes(b"half")  # killed while writing data
    (directory / "step_00000015.pt").write_bytes(b"no manifest")  # killed before the manifest
    assert ckpt.load_latest(tmp_path).step == 5
    removed = ckpt.clean_partial(tmp_path)
    assert {p.name for p in removed} == {"step_00000010.pt.tmp", "step_00000015.pt"}


def test_no_checkpoint(tmp_path: Path) -> None:
    assert ckpt.load_latest(tmp_path) is None


class Arbitrary:
    """Any class that is not a tensor or a plain value: weights_only loading must refuse it."""


def test_weights_only_refuses_arbitrary_objects(tmp_path: Path) -> None:
    ckpt.save_checkpoint(tmp_path, 1, {"step": 1, "obj": Arbitrary()}, keep=2)
    assert ckpt.load_latest(tmp_path) is None
