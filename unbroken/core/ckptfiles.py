"""Checkpoint files on disk: atomic writes, the checksum manifest, listing, verifying and cleaning up.

Owns the file layout of ``RUN_DIR/checkpoints/``: ``step_<N>.pt`` (the encoded state: bytes whose meaning is
``ft.checkpoint``'s) and ``step_<N>.json``, its manifest (format, step, file, bytes, sha256, time). Both are
written to a temporary file named after the writing process, fsynced and renamed, the manifest last, so a
checkpoint is either complete and verifiable or ignored. Pure Python: the launcher and the per-host agent
verify checkpoints without torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

MANIFEST_FORMAT = 2


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step_{step:08d}.pt"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, midway: Callable[[], None] | None = None) -> None:
    """Write ``data`` to ``path`` through a temporary file of this process, fsync it, rename it into place.
    ``midway`` (failure injection) is called with half of the data written."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # two writers never share a half-written file
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


def write_checkpoint_files(
    run_dir: Path, step: int, data: bytes, keep: int, midway: Callable[[], None] | None = None
) -> Path:
    """Write the checkpoint of ``step`` (its encoded ``data``, then its manifest), then delete all but the
    ``keep`` newest ones. Returns the data file's path."""
    directory = checkpoint_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    data_path = checkpoint_path(run_dir, step)
    write_atomic(data_path, data, midway)
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "file": data_path.name,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "time": time.time(),
    }
    write_atomic(data_path.with_suffix(".json"), json.dumps(manifest, indent=1).encode())
    _fsync_dir(directory)
    prune(directory, keep)
    return data_path


def prune(directory: Path, keep: int) -> None:
    manifests = sorted(directory.glob("step_*.json"))
    for manifest in manifests[:-keep] if keep > 0 else []:
        manifest.unlink(missing_ok=True)  # manifest first: a half-deleted checkpoint is never "complete"
        manifest.with_suffix(".pt").unlink(missing_ok=True)


def clean_partial(run_dir: Path) -> list[Path]:
    """Remove temporary files left by interrupted saves (another process's) and data files with no manifest.
    Call it only where no other process may be writing a checkpoint of this run: before a run starts, or
    on the one member that writes them."""
    directory = checkpoint_dir(run_dir)
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for path in directory.glob("*.tmp"):
        if path.name.endswith(f".{os.getpid()}.tmp"):
            continue  # a save of this process under way (another of its threads)
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


def read_verified(run_dir: Path, step: int) -> bytes:
    """The data of the checkpoint of ``step`` once its size and sha256 match its manifest; ValueError (one line)
    naming what is wrong otherwise."""
    manifest_path = checkpoint_path(run_dir, step).with_suffix(".json")
    try:
        manifest = json.loads(manifest_path.read_text())
        listed_step, file_name, sha = int(manifest["step"]), manifest["file"], manifest["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"manifest {manifest_path.name} is unreadable ({e})") from None
    if listed_step != step:
        raise ValueError(f"manifest {manifest_path.name} is for step {listed_step}")
    data_path = manifest_path.with_name(file_name)
    try:
        data = data_path.read_bytes()
    except OSError as e:
        raise ValueError(f"{data_path.name} is missing or unreadable ({e.strerror})") from None
    if len(data) != manifest.get("bytes", len(data)):
        raise ValueError(f"{data_path.name} has {len(data)} bytes, the manifest says {manifest['bytes']}")
    if hashlib.sha256(data).hexdigest() != sha:
        raise ValueError(f"{data_path.name} fails its checksum")
    return data


def leftovers(run_dir: Path) -> list[Path]:
    """Files of interrupted saves: temporary files and data files without a manifest (loading ignores them)."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    found = sorted(directory.glob("*.tmp"))
    return found + [p for p in sorted(directory.glob("step_*.pt")) if not p.with_suffix(".json").exists()]
