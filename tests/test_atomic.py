"""A sealed file (``core.atomic``) is seen whole or not at all: the old content or the new, never part of it,
whatever moment its writer is killed at (a real ``kill -9`` of a writer process), and what it was given
round-trips."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from unbroken.core.atomic import SealedFile, seal_folder, sealed, write_sealed

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
CHUNK = 1 << 16
CHUNKS = 32  # a version is 2 MiB, written in 64 KiB pieces

# Writes versions 1, 2, ... of TARGET, each CHUNKS pieces of the byte (version % 251), through ``sealed`` (or,
# with "plain", straight into TARGET). With "pause", it stops half-way through version 1 and says so.
WRITER = """
import sys, time
from pathlib import Path
from unbroken.core.atomic import sealed
target, mode, chunk, chunks = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
print("ready", flush=True)
version = 0
while True:
    version += 1
    piece = bytes([version % 251]) * chunk
    with (open(target, "wb") if "plain" in mode else sealed(target)) as f:
        for k in range(chunks):
            f.write(piece)
            f.flush()
            if "pause" in mode and k == chunks // 2:
                print("half", flush=True)
                time.sleep(60)
"""


def _writer(target: Path, mode: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-c", WRITER, str(target), mode, str(CHUNK), str(CHUNKS)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def _kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def _version(data: bytes) -> int | None:
    """The version a file holds when it holds one whole (the initial content is version 0), else None."""
    if data == b"initial":
        return 0
    if len(data) == CHUNK * CHUNKS and data == data[:1] * len(data):
        return data[0]
    return None


def test_write_sealed_round_trips_and_replaces_whole(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    write_sealed(target, b'{"a": 1}\n')
    assert target.read_bytes() == b'{"a": 1}\n'
    write_sealed(target, b"\x00\xff" * 100_000)
    assert target.read_bytes() == b"\x00\xff" * 100_000
    write_sealed(target, b"", temp=tmp_path / "state.json.tmp")
    assert target.read_bytes() == b""
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temporary file is left


def test_an_exception_keeps_the_old_content_and_removes_the_temporary(tmp_path: Path) -> None:
    target = tmp_path / "index.json"
    write_sealed(target, b"old")
    with pytest.raises(RuntimeError, match="disk full"):
        with sealed(target) as f:
            f.write(b"new, but not all of it")
            raise RuntimeError("disk full")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["index.json"]
    sink = SealedFile(tmp_path / "never.bin")
    sink.write(b"abc")
    sink.discard()
    assert [p.name for p in tmp_path.iterdir()] == ["index.json"]


def test_a_temporary_file_outside_the_target_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match="not in the folder of"):
        SealedFile(tmp_path / "a.bin", tmp_path / "sub" / "a.bin.tmp")


def test_a_writer_killed_half_way_leaves_the_old_content_and_a_plain_writer_does_not(tmp_path: Path) -> None:
    """The same kill half-way through a write: through ``sealed`` the target keeps its old content (the
    temporary file holds the half); written in place, the target is left half-written, which ``_version``
    (the check of the random-kill test below) reports."""
    outcomes = {}
    for mode in ("sealed", "plain"):
        target = tmp_path / mode / "file.bin"
        target.parent.mkdir()
        target.write_bytes(b"initial")
        proc = _writer(target, f"{mode}+pause")
        assert proc.stdout is not None and proc.stdout.readline() == "half\n"
        _kill(proc)
        outcomes[mode] = _version(target.read_bytes())
        if mode == "sealed":
            (temp,) = (p for p in target.parent.iterdir() if p != target)
            assert temp.stat().st_size == (CHUNKS // 2 + 1) * CHUNK  # the half, where only the writer looks
    assert outcomes == {"sealed": 0, "plain": None}


def test_writers_killed_at_random_moments_leave_a_whole_version(tmp_path: Path, seed: int) -> None:
    """A writer rewriting a 2 MiB file in a loop, ``kill -9``ed at a random moment (seeded): the file holds
    one whole version, never a mix or a prefix, and the next writer's versions replace it."""
    rng = random.Random(seed)
    target = tmp_path / "file.bin"
    target.write_bytes(b"initial")
    for kill in range(8):
        proc = _writer(target, "sealed")
        delay = rng.uniform(0.0, 0.3)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            pass
        _kill(proc)
        data = target.read_bytes()
        assert _version(data) is not None, f"kill {kill} after {delay:.3f} s left {len(data)} bytes (seed {seed})"


def test_seal_folder_makes_a_written_folder_appear_whole(tmp_path: Path) -> None:
    temp = tmp_path / ".entry.tmp-1"
    temp.mkdir()
    (temp / "a.bin").write_bytes(b"a" * 1000)
    (temp / "meta.json").write_text("{}")
    seal_folder(temp, tmp_path / "entry")
    assert not temp.exists()
    assert sorted(p.name for p in (tmp_path / "entry").iterdir()) == ["a.bin", "meta.json"]
    assert (tmp_path / "entry" / "a.bin").read_bytes() == b"a" * 1000
