"""Sealed files: the one way the project writes a file that a reader must see whole or not at all.

Owns writing a file under a temporary name in its target's folder, then flushing it, fsyncing it, renaming it
over the target and fsyncing the folder (``SealedFile``, ``sealed``, ``write_sealed``), and the same for a
folder of files (``seal_folder``). A reader, or a process that looks after the writer was killed (even with
``kill -9``, or by a power cut once the folder is fsynced), sees the old content or the new one, never part
of it. A writer that fails with an exception removes its temporary file; one that is killed leaves it, under
the name its caller chose (``temp``) so that the caller's clean-up recognises it: the checkpoint files, the
shards, the durable coordinator state, the data cache and the interchange formats each keep their own
temporary names. It knows nothing about what the files hold. Pure Python.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

BUFFER_BYTES = 1 << 16  # writes smaller than this are gathered before they reach the file


def fsync_dir(path: Path) -> None:
    """fsync the folder ``path`` (makes the renames and creations in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def default_temp(path: Path) -> Path:
    """The temporary name of ``path`` when its caller names none: hidden, and owned by this process."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


class SealedFile:
    """A file written under ``temp`` and made ``path`` only by ``seal()``; file-like (``write``, ``flush``).

    Small writes are gathered in a buffer of ``BUFFER_BYTES`` (as a buffered file would: a checkpoint streams
    thousands of small records); ``flush`` hands them to the descriptor (``os.write``).

    Args:
        path: the file to write (replaced whole by ``seal``, if it exists).
        temp: the temporary file, in the same folder as ``path`` (default ``default_temp(path)``); it is
            created or truncated now.
    """

    def __init__(self, path: Path, temp: Path | None = None) -> None:
        self.path = Path(path)
        self.temp = default_temp(self.path) if temp is None else Path(temp)
        if self.temp.parent.resolve() != self.path.parent.resolve():
            raise ValueError(f"temporary file {self.temp} is not in the folder of {self.path}: a rename stays in one")
        self._fd: int | None = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        self._buffer = bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append all of ``data``; returns its length in bytes."""
        if self._fd is None:
            raise ValueError(f"{self.temp} is sealed or discarded: nothing more can be written")
        view = memoryview(data).cast("B")
        if len(self._buffer) + len(view) <= BUFFER_BYTES:
            self._buffer += view
        else:
            self.flush()
            self._write_all(view)
        return len(view)

    def flush(self) -> None:
        """Hand what is buffered to the file (it is durable only once sealed)."""
        if self._buffer:
            self._write_all(memoryview(self._buffer))
            self._buffer = bytearray()

    def _write_all(self, view: memoryview) -> None:
        assert self._fd is not None
        done = 0
        while done < len(view):
            done += os.write(self._fd, view[done:])

    def seal(self, sync_dir: bool = True) -> None:
        """fsync the temporary file, rename it to ``path``, then fsync the folder (unless ``sync_dir`` is off: the
        caller fsyncs it once after sealing several files)."""
        if self._fd is None:
            raise ValueError(f"{self.temp} is already sealed or discarded")
        self.flush()
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(self.temp, self.path)
        if sync_dir:
            fsync_dir(self.path.parent)

    def discard(self) -> None:
        """Close and delete the temporary file (once sealed, nothing); ``path`` is left as it was."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        os.close(fd)
        self.temp.unlink(missing_ok=True)


@contextlib.contextmanager
def sealed(path: Path, temp: Path | None = None, sync_dir: bool = True) -> Iterator[SealedFile]:
    """``with sealed(path) as f: f.write(...)``: ``path`` gets what was written when the block ends without an
    exception (``SealedFile.seal(sync_dir)``); with one, the temporary file is deleted and ``path`` keeps its
    content."""
    sink = SealedFile(path, temp)
    try:
        yield sink
    except BaseException:
        sink.discard()
        raise
    sink.seal(sync_dir)


def write_sealed(path: Path, data: bytes, temp: Path | None = None) -> None:
    """Replace ``path`` with ``data`` (see ``sealed``)."""
    with sealed(path, temp) as f:
        f.write(data)


def seal_folder(temp: Path, final: Path) -> None:
    """Make the written folder ``temp`` the folder ``final``: fsync every file in it and the folder itself,
    rename it to ``final`` (which must not exist, or be an empty folder), then fsync the parent."""
    for path in sorted(p for p in temp.iterdir() if p.is_file()):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(temp)
    os.replace(temp, final)
    fsync_dir(final.parent)
