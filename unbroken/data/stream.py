"""A read-only view of token ids laid out in one or more files, read in place (never loaded).

Owns ``Segment`` (a run of ids at a byte offset of one file) and ``TokenStream`` (consecutive segments seen
as one array, or a sub-range of them). A read (``read``, or ``read_many`` for a microbatch's windows at once)
copies out only the ids asked for; files are opened lazily, on the first read that touches them, so a process
touches only the shards its samples fall in and holds no ids in its own memory; pickling a stream (to hand it
to a spawned worker) sends file names and offsets, not ids. It knows nothing about formats, indexes or
sampling.

Two ways to reach the bytes, the same ids either way:

- ``access="pread"`` (the default): positional reads (``os.preadv``) into the output array, with the
  kernel told the access is random (``POSIX_FADV_RANDOM``: no read-ahead of bytes no sample needs). The
  page cache is shared by every process on the host exactly as with a memory map, and the process's
  resident set does not grow with what it has read.
- ``access="mmap"``: the files are memory-mapped (``MADV_RANDOM``). Every page a mapping touches stays in
  the process's resident set until it is unmapped, and on current kernels a touch maps a whole page-cache
  folio (up to 2 MiB) and the pages around it, so random windows make the resident set grow towards the
  corpus (measured in docs/benchmarks.md, ``bench data``: 4.6 GB after 2000 steps on a 10 GB corpus, against
  223 MiB with positional reads). The mappings are therefore dropped after ``MAP_BUDGET_BYTES`` of reads,
  which bounds that growth but not tightly.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

ACCESS = ("pread", "mmap")
MAP_BUDGET_BYTES = 32 << 20  # mmap access: reads between two drops of every mapping
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class Segment:
    """``length`` ids of type ``dtype`` (little-endian) starting ``offset`` bytes into ``path``."""

    path: str
    dtype: str
    offset: int
    length: int


class TokenStream:
    """The ids of ``segments`` one after another, restricted to ``[start, stop)``.

    Args:
        segments: the files, in order (all of one id type).
        start: first id of the view.
        stop: end of the view (default: the end of the last segment).
        access: ``pread`` or ``mmap`` (see the module docstring).
    """

    def __init__(
        self, segments: Sequence[Segment], start: int = 0, stop: int | None = None, access: str = "pread"
    ) -> None:
        if access not in ACCESS:
            raise ValueError(f"access {access!r} is not allowed; allowed: {', '.join(ACCESS)}")
        self.segments = tuple(segments)
        dtypes = {np.dtype(s.dtype).newbyteorder("<") for s in self.segments}
        assert len(dtypes) <= 1, f"segments of different id types: {dtypes}"
        self.dtype = dtypes.pop() if dtypes else np.dtype("<u2")
        self._starts = np.cumsum([0] + [s.length for s in self.segments], dtype=np.int64)
        total = int(self._starts[-1])
        self.start = start
        self.stop = total if stop is None else stop
        assert 0 <= self.start <= self.stop <= total, (start, stop, total)
        self.access = access
        self._fds: dict[int, int] = {}
        self._maps: dict[int, np.ndarray] = {}
        self._mapped_bytes = 0  # mmap access: bytes read since the mappings were last dropped

    def __len__(self) -> int:
        return self.stop - self.start

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fds"], state["_maps"], state["_mapped_bytes"] = {}, {}, 0  # reopened on the other side
        return state

    def __del__(self) -> None:
        self.close()

    def view(self, start: int, stop: int) -> TokenStream:
        """Ids ``[start, stop)`` of this view, as a view (with its own open files)."""
        assert 0 <= start <= stop <= len(self), (start, stop, len(self))
        return TokenStream(self.segments, self.start + start, self.start + stop, self.access)

    def _fd(self, i: int) -> int:
        fd = self._fds.get(i)
        if fd is None:
            fd = os.open(self.segments[i].path, os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._fds[i] = fd
        return fd

    def _map(self, i: int) -> np.ndarray:
        m = self._maps.get(i)
        if m is None:
            s = self.segments[i]
            start = s.offset - s.offset % mmap.ALLOCATIONGRANULARITY
            length = s.offset - start + s.length * self.dtype.itemsize
            mm = mmap.mmap(self._fd(i), length, access=mmap.ACCESS_READ, offset=start)
            if hasattr(mm, "madvise"):
                mm.madvise(mmap.MADV_RANDOM)
            # The array holds the only reference to the mapping: dropping it unmaps the file.
            m = np.frombuffer(mm, dtype=self.dtype, count=s.length, offset=s.offset - start)
            self._maps[i] = m
        return m

    def _pread(self, i: int, offset: int, out: np.ndarray) -> None:
        s = self.segments[i]
        want = out.nbytes
        got = os.preadv(self._fd(i), [memoryview(out).cast("B")], s.offset + offset * self.dtype.itemsize)
        if got != want:
            raise ValueError(f"{s.path} is shorter than its index says (read {got} of {want} bytes); it is damaged")

    def read(self, start: int, count: int) -> np.ndarray:
        """A copy of ids ``[start, start + count)`` of this view."""
        assert 0 <= start and start + count <= len(self), (start, count, len(self))
        if self.access == "mmap":
            self._count_mapped(count * self.dtype.itemsize + 2 * _PAGE)
        first = self.start + start
        i = int(np.searchsorted(self._starts, first, side="right")) - 1
        out = np.empty(count, dtype=self.dtype)
        done = 0
        while done < count:
            offset = first + done - int(self._starts[i])
            take = min(count - done, self.segments[i].length - offset)
            if take > 0:  # (an empty segment is skipped: an empty file cannot be mapped)
                if self.access == "mmap":
                    out[done : done + take] = self._map(i)[offset : offset + take]
                else:
                    self._pread(i, offset, out[done : done + take])
            done += take
            i += 1
        return out

    def read_many(self, starts: np.ndarray, count: int) -> np.ndarray:
        """Copies of ids ``[s, s + count)`` of this view for each ``s`` of ``starts``: shape (len(starts), count).

        One indexing of the mapping where the view is one memory-mapped file (the text cache), else one ``read``
        per start."""
        starts = np.asarray(starts, dtype=np.int64)
        if not len(starts):
            return np.empty((0, count), dtype=self.dtype)
        if self.access != "mmap" or len(self.segments) != 1:
            return np.stack([self.read(int(s), count) for s in starts])
        assert int(starts.min()) >= 0 and int(starts.max()) + count <= len(self), (starts, count, len(self))
        self._count_mapped(len(starts) * (count * self.dtype.itemsize + 2 * _PAGE))
        return self._map(0)[(self.start + starts)[:, None] + np.arange(count)]

    def _count_mapped(self, nbytes: int) -> None:
        """mmap access: drop every mapping once ``MAP_BUDGET_BYTES`` have been read through them."""
        self._mapped_bytes += nbytes
        if self._mapped_bytes > MAP_BUDGET_BYTES:
            self._maps.clear()
            self._mapped_bytes = 0

    def close(self) -> None:
        """Drop the mappings and close the files (the next read opens them again)."""
        self._maps.clear()
        self._mapped_bytes = 0
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)
        if hasattr(self, "_fds"):
            self._fds.clear()
