"""Checkpoint files on disk: atomic writes, the checksum manifest, listing, verifying and cleaning up.

Owns the file layout of ``RUN_DIR/checkpoints/``: ``step_<N>.pt`` (the encoded state: bytes whose meaning is
``ft.checkpoint``'s) and ``step_<N>.json``, its manifest (format, step, file, bytes, sha256, time). Both are
sealed by ``core.atomic`` (written to a temporary file named after the writing process, fsynced, renamed, the
folder fsynced), the manifest last, so a checkpoint is either complete and verifiable or ignored. Pure Python:
the launcher and the per-host agent verify checkpoints without torch.

A replica of several ranks writes a *sharded* checkpoint instead: the directory ``step_<N>.dcp/`` (its files
are ``ft.distcp``'s), written as ``step_<N>.dcp.<tag>.tmp/``, sealed (``core.atomic.seal_folder``: every file
fsynced, the directory renamed into place) and then named by the same manifest, which lists every file's size
and sha256 (``dir``, ``files``) instead of one file's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.core.atomic import SealedFile, seal_folder, sealed

MANIFEST_FORMAT = 2


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step_{step:08d}.pt"


def write_atomic(path: Path, data: bytes, midway: Callable[[], None] | None = None) -> None:
    """Write ``data`` to ``path`` through a temporary file of this process, fsync it, rename it into place, fsync
    the folder. ``midway`` (failure injection) is called with half of the data written."""
    _write_through_temporary(path, lambda sink: sink.write(data), midway, len(data) // 2, sync_dir=True)


def _write_through_temporary(
    path: Path, write: Callable[[_Sink], Any], midway: Callable[[], None] | None, midway_at: int, sync_dir: bool
) -> _Sink:
    """``write(sink)`` into a temporary file of this process, fsync it, rename it to ``path`` (then fsync the folder
    if ``sync_dir``); returns the sink (the size and sha256 of what was written)."""
    # Named after the process: two writers never share a half-written file, and ``clean_partial`` knows its own.
    with sealed(path, path.with_name(f"{path.name}.{os.getpid()}.tmp"), sync_dir) as f:
        sink = _Sink(f, midway, midway_at)
        write(sink)
    return sink


class _Sink:
    """The file a checkpoint is streamed into: counts and hashes what passes (the manifest's size and sha256),
    and calls ``midway`` (failure injection) once, with ``midway_at`` bytes written."""

    def __init__(self, f: SealedFile, midway: Callable[[], None] | None, midway_at: int) -> None:
        self._f = f
        self._midway = midway
        self._midway_at = midway_at
        self.size = 0
        self.digest = hashlib.sha256()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._midway is not None and self.size + len(view) >= self._midway_at:
            first = max(0, self._midway_at - self.size)
            self._pass(view[:first])
            self._f.flush()
            midway, self._midway = self._midway, None
            midway()
            self._pass(view[first:])
        else:
            self._pass(view)
        return len(view)

    def _pass(self, view: memoryview) -> None:
        self._f.write(view)
        self.digest.update(view)
        self.size += len(view)

    def flush(self) -> None:
        self._f.flush()


def write_checkpoint_stream(
    run_dir: Path,
    step: int,
    write: Callable[[Any], None],
    keep: int,
    midway: Callable[[], None] | None = None,
    midway_at: int = 0,
) -> Path:
    """Write the checkpoint of ``step`` by ``write(file)`` (an object with ``write`` and ``flush``: the encoded
    state streams to disk, never held whole in memory), then its manifest; then delete all but the ``keep``
    newest ones. Returns the data file's path. ``midway`` (failure injection) is called once ``midway_at`` bytes
    are written."""
    directory = checkpoint_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    data_path = checkpoint_path(run_dir, step)
    # The folder is fsynced once, by the manifest's write (the same folder: both renames are made durable then).
    sink = _write_through_temporary(data_path, write, midway, midway_at, sync_dir=False)
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "file": data_path.name,
        "bytes": sink.size,
        "sha256": sink.digest.hexdigest(),
        "time": time.time(),
    }
    write_atomic(data_path.with_suffix(".json"), json.dumps(manifest, indent=1).encode())
    prune(directory, keep)
    return data_path


def prune(directory: Path, keep: int) -> None:
    manifests = sorted(directory.glob("step_*.json"))
    for manifest in manifests[:-keep] if keep > 0 else []:
        manifest.unlink(missing_ok=True)  # manifest first: a half-deleted checkpoint is never "complete"
        manifest.with_suffix(".pt").unlink(missing_ok=True)
        shutil.rmtree(manifest.with_suffix(".dcp"), ignore_errors=True)


def sharded_path(run_dir: Path, step: int) -> Path:
    """The directory of the sharded checkpoint of ``step``."""
    return checkpoint_path(run_dir, step).with_suffix(".dcp")


def sharded_temp(run_dir: Path, step: int, tag: str) -> Path:
    """Where the writers named ``tag`` write the sharded checkpoint of ``step`` before it is sealed."""
    return checkpoint_dir(run_dir) / f"{sharded_path(run_dir, step).name}.{tag}.tmp"


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def seal_directory(run_dir: Path, step: int, temp: Path, keep: int) -> Path:
    """Make the written directory ``temp`` the sharded checkpoint of ``step``: fsync its files, rename it into
    place, write the manifest last (every file's size and sha256), then delete all but the ``keep`` newest
    checkpoints. Returns the directory."""
    entries: dict[str, dict[str, int | str]] = {}
    for path in sorted(p for p in temp.iterdir() if p.is_file()):
        entries[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256_of(path)}
    final = sharded_path(run_dir, step)
    if final.exists():  # a writer that died after renaming but before the manifest: never verified, replaced
        shutil.rmtree(final)
    seal_folder(temp, final)
    manifest = {"format": MANIFEST_FORMAT, "step": step, "dir": final.name, "files": entries, "time": time.time()}
    write_atomic(checkpoint_path(run_dir, step).with_suffix(".json"), json.dumps(manifest, indent=1).encode())
    prune(checkpoint_dir(run_dir), keep)
    return final


def _manifest(run_dir: Path, step: int) -> dict[str, object]:
    manifest_path = checkpoint_path(run_dir, step).with_suffix(".json")
    try:
        manifest = json.loads(manifest_path.read_text())
        if int(manifest["step"]) != step:
            raise ValueError(f"it is for step {manifest['step']}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"manifest {manifest_path.name} is unreadable ({e})") from None
    return manifest


def is_sharded(run_dir: Path, step: int) -> bool:
    """Whether the checkpoint of ``step`` is a sharded one (ValueError if its manifest is unreadable)."""
    return "dir" in _manifest(run_dir, step)


def verify_directory(run_dir: Path, step: int) -> Path:
    """The directory of the sharded checkpoint of ``step`` once every file's size and sha256 match its manifest;
    ValueError (one line) naming what is wrong otherwise."""
    manifest = _manifest(run_dir, step)
    try:
        directory = checkpoint_dir(run_dir) / str(manifest["dir"])
        files = dict(manifest["files"])  # type: ignore[call-overload]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"manifest of step {step} is not a sharded checkpoint's ({e})") from None
    on_disk = {p.name for p in directory.iterdir()} if directory.is_dir() else set()
    for name, entry in files.items():
        path = directory / name
        if name not in on_disk:
            raise ValueError(f"{directory.name}/{name} is missing")
        if path.stat().st_size != entry["bytes"]:
            raise ValueError(
                f"{directory.name}/{name} has {path.stat().st_size} bytes, the manifest says {entry['bytes']}"
            )
        if _sha256_of(path) != entry["sha256"]:
            raise ValueError(f"{directory.name}/{name} fails its checksum")
    return directory


def verify_files(run_dir: Path, step: int) -> None:
    """ValueError (one line) unless the checkpoint of ``step``, a file or a sharded directory, verifies."""
    if is_sharded(run_dir, step):
        verify_directory(run_dir, step)
    else:
        read_verified(run_dir, step)


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
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    for path in [*directory.glob("step_*.pt"), *directory.glob("step_*.dcp")]:
        if not path.with_suffix(".json").exists():
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
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


def last_checkpoint_words(run_dir: Path) -> str:
    """The words a stop line ends with: which checkpoint a ``--resume`` would continue from, by the step numbers
    the console shows (from 0): ``step_00000005`` holds the state after step 4, and a resume trains step 5 next."""
    saved = list_checkpoints(run_dir)
    if not saved:
        return "no checkpoint was written yet"
    state = f"the state after step {saved[0] - 1}" if saved[0] > 0 else "the starting state"
    return f"the last good checkpoint is {state} (--resume continues at step {saved[0]})"


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
    data = [*sorted(directory.glob("step_*.pt")), *sorted(directory.glob("step_*.dcp"))]
    return found + [p for p in data if not p.with_suffix(".json").exists()]
