"""Checkpoints on disk: atomic writes, a checksum manifest, and loading the newest good one.

Owns the on-disk format only (what goes into the state is the trainer's business). A checkpoint is the
pair ``checkpoints/step_<N>.pt`` (``torch.save`` of a dict of tensors and plain values) and
``checkpoints/step_<N>.json`` (its manifest: step, size, sha256). Both are written to a temporary file,
fsynced and renamed, the manifest last, so a checkpoint is either complete and verifiable or ignored.
Loading uses ``weights_only=True``; a corrupt or partial checkpoint is reported and the previous good
one is used.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass(frozen=True)
class LoadedCheckpoint:
    step: int
    path: Path
    state: dict[str, Any]
    skipped: tuple[str, ...]  # one line per newer checkpoint that was rejected, and why


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes, midway: Callable[[], None] | None = None) -> None:
    # One temporary name per process: two writers of the same step never share a half-written file.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        if midway is not None:
            f.write(data[: len(data) // 2])
            f.flush()
            midway()
            f.write(data[len(data) // 2 :])
        else:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    run_dir: Path, step: int, state: dict[str, Any], keep: int, midway: Callable[[], None] | None = None
) -> Path:
    """Write the checkpoint of ``step`` atomically, then delete all but the ``keep`` newest ones.

    ``midway`` (failure injection) is called with half of the data file written."""
    directory = checkpoint_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    name = f"step_{step:08d}"
    data_path = directory / f"{name}.pt"
    _write_atomic(data_path, data, midway)
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "file": data_path.name,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "time": time.time(),
    }
    _write_atomic(directory / f"{name}.json", json.dumps(manifest, indent=1).encode())
    _fsync_dir(directory)
    _prune(directory, keep)
    return data_path


def _prune(directory: Path, keep: int) -> None:
    manifests = sorted(directory.glob("step_*.json"))
    for manifest in manifests[:-keep] if keep > 0 else []:
        manifest.unlink(missing_ok=True)  # manifest first: a half-deleted checkpoint is never "complete"
        manifest.with_suffix(".pt").unlink(missing_ok=True)


def clean_partial(run_dir: Path) -> list[Path]:
    """Remove temporary files left by an interrupted save and data files with no manifest."""
    directory = checkpoint_dir(run_dir)
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for path in directory.glob("*.tmp"):
        path.unlink(missing_ok=True)
        removed.append(path)
    for path in directory.glob("step_*.pt"):
        if not path.with_suffix(".json").exists():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def list_checkpoints(run_dir: Path) -> list[int]:
    """Steps that have a manifest, newest first (not yet verified)."""
    steps = []
    for manifest in checkpoint_dir(run_dir).glob("step_*.json"):
        try:
            steps.append(int(manifest.stem.split("_", 1)[1]))
        except ValueError:
            continue
    return sorted(steps, reverse=True)


def _verify_and_load(manifest_path: Path) -> tuple[int, dict[str, Any]]:
    try:
        manifest = json.loads(manifest_path.read_text())
        step, file_name, sha = int(manifest["step"]), manifest["file"], manifest["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"manifest {manifest_path.name} is unreadable ({e})") from None
    data_path = manifest_path.with_name(file_name)
    try:
        data = data_path.read_bytes()
    except OSError as e:
        raise ValueError(f"{data_path.name} is missing or unreadable ({e.strerror})") from None
    if len(data) != manifest.get("bytes", len(data)):
        raise ValueError(f"{data_path.name} has {len(data)} bytes, the manifest says {manifest['bytes']}")
    if hashlib.sha256(data).hexdigest() != sha:
        raise ValueError(f"{data_path.name} fails its checksum")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means "not a usable checkpoint"
        raise ValueError(f"{data_path.name} cannot be loaded ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{data_path.name} does not hold a state dict")
    return step, state


def load_latest(run_dir: Path, log_rejections: bool = True) -> LoadedCheckpoint | None:
    """The newest checkpoint that verifies; newer ones that fail are skipped (and logged). None if none."""
    skipped: list[str] = []
    for step in list_checkpoints(run_dir):
        manifest_path = checkpoint_dir(run_dir) / f"step_{step:08d}.json"
        try:
            loaded_step, state = _verify_and_load(manifest_path)
        except ValueError as e:
            if log_rejections:
                log.warning("checkpoint of step %d rejected: %s; trying the previous one", step, e)
            skipped.append(f"step {step}: {e}")
            continue
        return LoadedCheckpoint(loaded_step, manifest_path.with_suffix(".pt"), state, tuple(skipped))
    for line in skipped if log_rejections else []:
        log.warning("no usable checkpoint: %s", line)
    return None


def verify_all(run_dir: Path) -> tuple[list[str], list[Path]]:
    """Every checkpoint that has a manifest must verify: (one line per one that does not, leftover files
    of interrupted saves: temporary files and data files without a manifest, which loading ignores)."""
    directory = checkpoint_dir(run_dir)
    problems: list[str] = []
    if not directory.is_dir():
        return problems, []
    for manifest in sorted(directory.glob("step_*.json")):
        try:
            _verify_and_load(manifest)
        except ValueError as e:
            problems.append(f"{manifest.name}: {e}")
    leftovers = sorted(directory.glob("*.tmp"))
    leftovers += [p for p in sorted(directory.glob("step_*.pt")) if not p.with_suffix(".json").exists()]
    return problems, leftovers
