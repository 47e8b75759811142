"""The coordinator's durable state: what must outlive the coordinator process, and where it is kept.

Owns the ``State`` record (its JSON encoding is spelled here and nowhere else), the ``StateStore`` interface
the coordinator talks to, and its default backend, ``JournalStore``: an fsync'd snapshot in the run directory
that one host's restarted coordinator recovers from. The etcd backend for several hosts is
``control.store.etcd.EtcdStateStore``; ``control.store.backend.open_state_store`` picks one from
``--coordinator.state``.

Only hard state is kept: the membership epoch and its members, the admitted workers and the next worker id
(so neither an epoch nor a worker id is ever handed out twice), the last committed step, the assignment
in flight and the data cursor. Heartbeats, live membership, registrations and the metrics queue are
rebuilt from the workers re-registering with the new coordinator. The store does not know the store keys
(``control.store.keys``), the coordinator's loop, or torch.

Contract (both backends): a process calls ``campaign()`` and may ``save()`` only while it leads; a store
refuses a ``save()`` from a process that no longer leads, and one whose epoch is older than the stored
one, with ``StaleWriteError``. A new leader publishes ``load().epoch + 1`` before anything else, and
``save()``s every epoch *before* publishing it (write-ahead), so an epoch number is never reused.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from unbroken.core.atomic import write_sealed
from unbroken.core.plan import Assignment

FORMAT = 1  # the version of State's JSON encoding; decode refuses others
JOURNAL_FILE = "coordinator-state.json"
LOCK_FILE = "coordinator.lock"
CAMPAIGN_TIMEOUT = timedelta(seconds=30)  # how long a candidate waits to lead before campaign() gives up


class StateUnavailableError(RuntimeError):
    """The state store cannot be reached now (etcd without a majority, or electing its leader): whether the
    last write was applied is unknown; writing the same state again is harmless."""


class StaleWriteError(RuntimeError):
    """A ``save()`` refused: the writer no longer leads, or its epoch is older than the stored one."""


@dataclass(frozen=True)
class Worker:
    """An admitted worker as it registered (its id is the key of ``State.admitted``)."""

    host: str
    pid: int


@dataclass(frozen=True)
class State:
    """The coordinator's hard state. Immutable: build the next one with ``dataclasses.replace``."""

    epoch: int = 0  # the newest membership epoch saved (published or about to be); 0 before the first
    members: tuple[int, ...] = ()  # that epoch's members, sorted
    committed_step: int = -1  # the last step committed, from the workers' step records; -1 before the first
    assignment: Assignment | None = None  # the plan of the step in flight (committed_step + 1), if known
    data_cursor: int = 0  # the next position of the data stream (the built-in sampler: the next step)
    admitted: Mapping[int, Worker] = field(default_factory=dict)  # every worker admitted so far, by id
    next_worker_id: int = 0  # ids below it were handed out once and are never given to a new worker

    def __post_init__(self) -> None:
        assert self.epoch >= 0 and self.next_worker_id >= 0, self
        assert list(self.members) == sorted(set(self.members)), self.members
        assert all(w < self.next_worker_id for w in self.admitted), (self.admitted, self.next_worker_id)

    def to_json(self) -> str:
        """The canonical encoding (sorted keys, no spaces): equal states encode to equal strings."""
        a = self.assignment
        doc: dict[str, Any] = {
            "format": FORMAT,
            "epoch": self.epoch,
            "members": list(self.members),
            "committed_step": self.committed_step,
            "assignment": None
            if a is None
            else {
                "step": a.step,
                "num_microbatches": a.num_microbatches,
                "members": list(a.members),
                "ids": {str(w): list(ids) for w, ids in a.ids.items()},
                "efficient": sorted(a.efficient),
            },
            "data_cursor": self.data_cursor,
            "admitted": {str(w): {"host": v.host, "pid": v.pid} for w, v in self.admitted.items()},
            "next_worker_id": self.next_worker_id,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> State:
        """Decode ``to_json``'s output; ValueError if it is not that (another format, missing fields)."""
        try:
            doc = json.loads(text)
            if doc.get("format") != FORMAT:
                raise ValueError(f"state format {doc.get('format')!r}, expected {FORMAT}")
            a = doc["assignment"]
            return cls(
                epoch=int(doc["epoch"]),
                members=tuple(int(w) for w in doc["members"]),
                committed_step=int(doc["committed_step"]),
                assignment=None
                if a is None
                else Assignment(
                    step=int(a["step"]),
                    num_microbatches=int(a["num_microbatches"]),
                    members=tuple(int(w) for w in a["members"]),
                    ids={int(w): tuple(int(j) for j in ids) for w, ids in a["ids"].items()},
                    efficient=frozenset(int(j) for j in a["efficient"]),
                ),
                data_cursor=int(doc["data_cursor"]),
                admitted={int(w): Worker(str(v["host"]), int(v["pid"])) for w, v in doc["admitted"].items()},
                next_worker_id=int(doc["next_worker_id"]),
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError, AssertionError) as e:
            raise ValueError(f"not a coordinator state: {e!r}") from None


class StateStore(ABC):
    """Where the coordinator's ``State`` outlives the coordinator, and who may write it.

    Call order: ``campaign()`` (blocks while another process leads), then ``load()`` once, then ``save()``
    before every epoch is published and whenever the committed step moves; ``resign()`` at the end.
    ``is_leader()`` is cheap (no I/O) and conservative: once it is False this process must stop acting
    as the coordinator; ``save()`` is the authority (it refuses a deposed writer, whatever it believes).
    """

    def __init__(self) -> None:
        self._stored_epoch = 0  # the newest epoch this process has seen stored (load or save)

    @abstractmethod
    def campaign(self, timeout: timedelta = CAMPAIGN_TIMEOUT) -> bool:
        """Become the one process that may write; False if ``timeout`` passed first. Idempotent."""

    @abstractmethod
    def is_leader(self) -> bool:
        """Whether this process still leads (its last ``campaign()`` won and nothing has deposed it since)."""

    @abstractmethod
    def load(self) -> State | None:
        """The last saved state, or None if none was ever saved. Raises ValueError if it is damaged."""

    @abstractmethod
    def save(self, state: State) -> None:
        """Store ``state`` durably (it survives a crash of this process once this returns).

        Raises:
            StaleWriteError: this process does not lead, or ``state.epoch`` is older than the stored epoch.
        """

    @abstractmethod
    def resign(self) -> None:
        """Stop leading (a standby may take over at once); harmless if this process does not lead."""

    def _check_epoch(self, state: State) -> None:
        if state.epoch < self._stored_epoch:
            raise StaleWriteError(f"epoch {state.epoch} is older than the stored epoch {self._stored_epoch}")

    def _seen(self, state: State | None) -> State | None:
        if state is not None:
            self._stored_epoch = max(self._stored_epoch, state.epoch)
        return state


class JournalStore(StateStore):
    """The state as one snapshot file in the run directory; leadership is an ``flock`` on a lock file.

    ``save()`` seals the file (``core.atomic``: a temporary file, fsynced, renamed over
    ``coordinator-state.json``, the directory fsynced), so a crash at any moment leaves either the old snapshot
    or the new one, whole. The snapshot is two lines: the state's JSON and its SHA-256, so damage is reported,
    never loaded. The lock dies with its holder (even ``kill -9``), so a restarted coordinator leads as soon as
    the old process is gone, and never while it lives. One host only: ``flock`` over NFS is not to be relied
    on. The lock's descriptor is close-on-exec, but a child made by a bare ``fork()`` (multiprocessing's
    "fork") would hold the lock after the coordinator died: the coordinator must not fork without exec.
    """

    def __init__(self, run_dir: Path, poll: timedelta = timedelta(seconds=0.1)) -> None:
        super().__init__()
        self.path = Path(run_dir) / JOURNAL_FILE
        self.lock_path = Path(run_dir) / LOCK_FILE
        self.poll_s = poll.total_seconds()
        self._lock_fd: int | None = None

    def campaign(self, timeout: timedelta = CAMPAIGN_TIMEOUT) -> bool:
        if self._lock_fd is not None:
            return True
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return False
                time.sleep(self.poll_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # who holds it, for a human; the lock is the flock
        self._lock_fd = fd
        try:
            self._seen(self.load())
        except ValueError:
            self.resign()
            raise
        return True

    def is_leader(self) -> bool:
        return self._lock_fd is not None

    def load(self) -> State | None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        body, _, digest = raw.rstrip(b"\n").rpartition(b"\n")
        if hashlib.sha256(body).hexdigest().encode() != digest:
            raise ValueError(f"{self.path}: damaged (checksum mismatch); move it away to start afresh")
        try:
            return self._seen(State.from_json(body))
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from None

    def save(self, state: State) -> None:
        if self._lock_fd is None:
            raise StaleWriteError(f"{self.lock_path} is not held by this process: it does not lead")
        self._check_epoch(state)
        body = state.to_json().encode()
        data = body + b"\n" + hashlib.sha256(body).hexdigest().encode() + b"\n"
        # One writer (the lock holder): one temporary name suffices. The folder is fsynced too: the rename
        # itself must reach the disk before the epoch is published.
        write_sealed(self.path, data, self.path.with_name(self.path.name + ".tmp"))
        self._seen(state)

    def resign(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None
