"""Forming the group of a newly published epoch ahead of need, on a thread of its own: ``GroupFormer``.

A survivor still computing its microbatches when a member dies would otherwise reach the new group's rendezvous
only at its reduction, with every other member waiting there for it (gloo only; ``groups.form_group`` does the
forming).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed import Store

from unbroken.ft.comm.groups import Group, form_group, retire_group, start_rendezvous_thread
from unbroken.ft.comm.waits import WaitStatus

log = logging.getLogger(__name__)


class GroupFormer:
    """Forms the group of a newly published epoch ahead of need, on a thread of its own (gloo only).

    The coordinator publishes an epoch the moment it learns of a death. A survivor still computing its
    microbatches would reach the new group's rendezvous only at its reduction, and every other member would
    wait there for it; formed as soon as each member's watcher sees the epoch (``offer``), the group is ready
    when the training thread asks for it (``take``), and the computing survivor's microbatches were not wasted.
    An attempt whose epoch is superseded ends (``superseded``), and a group formed but never taken is retired.

    NCCL groups are not formed ahead: a new communicator must not be created on a GPU where the old one may be
    spinning on a dead peer until ``abort_group`` has ended it (docs/gpu.md)."""

    def __init__(
        self,
        connect: Callable[[], Store],
        worker_id: int,
        backend: str,
        timeout_s: float,
        device: torch.device,
        superseded: Callable[[int], bool],
        coordinate: int | None = None,
    ) -> None:
        self._coordinate = coordinate
        self._connect = connect
        self._worker_id = worker_id
        self._backend = backend
        self._timeout_s = timeout_s
        self._device = device
        self._superseded = superseded
        self._lock = threading.Lock()
        self._attempts: dict[int, _Attempt] = {}
        self._taken = 0  # the newest epoch the training thread has asked for

    def offer(self, epoch: int, members: Sequence[int]) -> None:
        """Start forming ``epoch``'s group (members ``members``) unless it is not this worker's to form ahead.
        Cheap and never raises: the client's watcher thread calls it."""
        if self._backend != "gloo" or self._worker_id not in members or len(members) < 2:
            return
        with self._lock:
            if epoch <= self._taken or epoch in self._attempts:
                return
            attempt = _Attempt()
            self._attempts[epoch] = attempt
        start_rendezvous_thread(lambda: self._form(epoch, tuple(members), attempt), f"pre-form-{epoch}")

    def _form(self, epoch: int, members: tuple[int, ...], attempt: _Attempt) -> None:
        try:
            attempt.result = form_group(
                self._connect(),
                epoch,
                members,
                self._worker_id,
                self._backend,
                self._timeout_s,
                self._device,
                lambda: self._superseded(epoch),
                self._coordinate,
            )
        except (RuntimeError, OSError, ConnectionError) as e:  # no store connection: the training thread retries
            log.warning("forming the group of epoch %d ahead failed: %s", epoch, e)
            attempt.result = (None, WaitStatus.FAILED)
        with self._lock:
            stale = epoch < self._taken
            if stale:
                self._attempts.pop(epoch, None)
        if stale and attempt.result[0] is not None:
            retire_group(attempt.result[0], self._timeout_s + 1.0)
        attempt.done.set()

    def take(self, epoch: int) -> tuple[Group | None, WaitStatus] | None:
        """The training thread needs ``epoch``'s group: the attempt's outcome once it ends (bounded by the
        rendezvous timeout and by the epoch being superseded), or None if none was started (form it
        directly). Attempts for older epochs are dropped (their groups retired)."""
        with self._lock:
            self._taken = max(self._taken, epoch)
            attempt = self._attempts.pop(epoch, None)
            older = [e for e in self._attempts if e < epoch]
            finished = [self._attempts.pop(e) for e in older if self._attempts[e].done.is_set()]
        for old in finished:
            if old.result[0] is not None:
                retire_group(old.result[0], self._timeout_s + 1.0)
        if attempt is None:
            return None
        attempt.done.wait()
        return attempt.result

    def pending(self) -> int:
        """Attempts started and not yet taken or dropped (for tests)."""
        with self._lock:
            return len(self._attempts)


@dataclass
class _Attempt:
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple[Group | None, WaitStatus] = (None, WaitStatus.FAILED)
