"""The process group of one membership epoch (``Group``): forming it, and retiring or aborting it once replaced.

Owns ``form_group`` (the epoch's rendezvous on a helper thread, bounded by a deadline and by the epoch being
superseded), the threads that may be inside a rendezvous and ``settle``, which waits for them before the
interpreter exits, ``retire_group`` (a replaced group destroyed off the training thread once none of its
collectives runs) and ``abort_group`` (a NCCL group's communicators aborted: ncclCommAbort ends a kernel spinning
on a dead peer before the next group forms). NCCL groups (docs/gpu.md, 4.3) create their communicator eagerly
and non-blocking inside ``form_group``. Forming the next epoch's group ahead of need is ``groupformer``'s.
"""

from __future__ import annotations

import collections
import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store

from unbroken.control.store import keys
from unbroken.ft.comm.waits import CHECK_INTERVAL_S, WaitStatus, backend_timed_out

log = logging.getLogger(__name__)

ABORT_DEADLINE_S = 30.0  # past this, a NCCL abort that has not returned ends the worker (it rejoins if restarted)
EXIT_ABORT_HUNG = 7


@dataclass
class Group:
    """The process group of one membership epoch. ``rank`` is this worker's index among ``members``."""

    epoch: int
    members: tuple[int, ...]
    rank: int
    pg: dist.ProcessGroup | None  # None for a group of one (every collective is the identity)
    device: torch.device
    works: list[dist.Work] = field(default_factory=list)  # collectives started on it, not yet seen complete
    backend: str = "gloo"
    aborted: bool = False
    formed_at: float = field(default_factory=time.time)  # wall clock when its rendezvous completed

    @property
    def nccl(self) -> bool:
        return self.pg is not None and self.backend == "nccl"

    @property
    def size(self) -> int:
        return len(self.members)

    def track(self, work: dist.Work) -> None:
        self.works = [w for w in self.works if not w.is_completed()]
        self.works.append(work)

    def idle(self) -> bool:
        """No collective of this group is still running (destroying it now would not block)."""
        return all(w.is_completed() for w in self.works)


class _Reaper:
    """Destroys retired process groups on its own thread, once their collectives have ended.

    Destroying a gloo group joins its worker threads, and a worker thread inside a collective abandoned
    because a peer died returns only at the group timeout: on the training thread that stalls recovery for
    the whole timeout (seen as 60 s steps under chaos). A retired group is held here until none of its
    collectives is running, or until ``hold_s`` has passed, and its last reference is dropped here.
    """

    POLL_S = 0.5

    def __init__(self) -> None:
        self._held: collections.deque[tuple[float, Group]] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False  # the interpreter is exiting: nothing more is destroyed on this thread
        self._destroying = False

    def retire(self, group: Group, hold_s: float) -> None:
        with self._lock:
            self._held.append((time.monotonic() + hold_s, group))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="group-reaper", daemon=True)
                self._thread.start()
        self._wake.set()

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.POLL_S)
            self._wake.clear()
            self._release(time.monotonic())

    def _release(self, now: float) -> None:
        with self._lock:
            if self._stopped:
                return
            due = [deadline <= now or group.idle() for deadline, group in self._held]
            done = [entry for entry, d in zip(self._held, due, strict=True) if d]
            self._held = collections.deque(entry for entry, d in zip(self._held, due, strict=True) if not d)
            self._destroying = bool(done)
        done.clear()  # the last references: the groups' destructors run here, on this thread, outside the lock
        with self._lock:
            self._destroying = False

    def stop(self) -> bool:
        """Destroy nothing more on this thread (the interpreter is exiting: a destructor, which releases the
        GIL, must not be running when it finalizes; what is held is destroyed with the interpreter, on its main
        thread). Returns whether a destruction is still under way."""
        with self._lock:
            self._stopped = True
            return self._destroying


_reaper = _Reaper()

# Threads that may be inside a C++ rendezvous (a gloo group being built). One that returns into Python while
# the interpreter finalizes is ended by pthread_exit (CPython 3.11), whose unwinding through the C++ frames
# calls std::terminate: a worker that finished its run would die of SIGABRT. ``settle`` waits for them at exit.
_rendezvous_threads: set[threading.Thread] = set()
_rendezvous_lock = threading.Lock()


def start_rendezvous_thread(target: Callable[[], None], name: str) -> None:
    held = [target]

    def run() -> None:
        try:
            # The target, and what it holds (a group formed for an abandoned rendezvous), is dropped before the
            # thread leaves the set: that group's destructor, which releases the GIL, runs while ``settle`` waits.
            held.pop()()
        finally:
            with _rendezvous_lock:
                _rendezvous_threads.discard(threading.current_thread())

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _rendezvous_lock:
        _rendezvous_threads.add(thread)
    thread.start()


def settle(timeout_s: float) -> bool:
    """Wait, at most ``timeout_s``, for the group rendezvous still running on helper threads (one abandoned
    or formed ahead ends at its own timeout, or at once when the coordinator's store closes) and for a retired
    group's destruction under way; stop destroying retired groups. Call before the interpreter exits; returns
    whether nothing is left running."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _rendezvous_lock:
            alive = [t for t in _rendezvous_threads if t.is_alive()]
        destroying = _reaper.stop()
        if not alive and not destroying:
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if alive:
            alive[0].join(remaining)
        else:
            time.sleep(min(remaining, CHECK_INTERVAL_S))


def retire_group(group: Group | None, hold_s: float) -> None:
    """Hand over a group that is being replaced: it is destroyed off this thread once it is idle (or after
    ``hold_s``, past which no collective of it can still be running). The caller must drop its own
    references to it."""
    if group is not None and group.pg is not None:
        _reaper.retire(group, hold_s)


def retired_groups() -> int:
    """Retired groups not yet destroyed (for tests and resource checks)."""
    return _reaper.held()


def abort_group(group: Group | None, deadline_s: float = ABORT_DEADLINE_S) -> threading.Event | None:
    """A NCCL group that will not be used again: abort its communicators (``ProcessGroupNCCL.abort()``,
    ncclCommAbort: local, no peer needed; a collective spinning on a dead peer ends with an error) on a helper
    thread, now. If the abort has not returned within ``deadline_s`` (NCCL's error handling can hang), the
    worker exits with ``EXIT_ABORT_HUNG`` rather than hang: restarted, it rejoins. Nothing for gloo. Returns
    the event set when the abort has returned (None: nothing to abort)."""
    if group is None or not group.nccl or group.aborted:
        return None
    group.aborted = True
    pg, epoch = group.pg, group.epoch
    assert pg is not None
    done = threading.Event()

    def abort() -> None:
        t0 = time.monotonic()
        try:
            pg.abort()
        except RuntimeError as e:
            log.warning("aborting the NCCL group of epoch %d: %s", epoch, e)
        log.info("aborted the NCCL group of epoch %d in %.3f s", epoch, time.monotonic() - t0)
        done.set()

    def watch() -> None:
        if not done.wait(deadline_s):
            log.error("aborting the NCCL group of epoch %d hung for %.0f s; this worker exits", epoch, deadline_s)
            logging.shutdown()
            os._exit(EXIT_ABORT_HUNG)

    threading.Thread(target=abort, name=f"nccl-abort-{epoch}", daemon=True).start()
    threading.Thread(target=watch, name=f"nccl-abort-watch-{epoch}", daemon=True).start()
    return done


def form_group(
    store: Store,
    epoch: int,
    members: Sequence[int],
    worker_id: int,
    backend: str,
    timeout_s: float,
    device: torch.device,
    interrupted: Callable[[], bool] = lambda: False,
    coordinate: int | None = None,
) -> tuple[Group | None, WaitStatus]:
    """Build the epoch's process group under the store prefix ``pg/<epoch>`` (every member calls this; with
    replicas of several ranks, ``coordinate`` names the rank index whose group this is: ``pg/<epoch>/c<r>``).

    The rendezvous blocks until every member has arrived, so it runs on a helper thread while this one
    watches ``interrupted`` (a newer epoch: a member died before arriving) and the ``timeout_s`` deadline (a
    member that never arrives while alive). Returns the group, or None and why not; an abandoned rendezvous
    thread ends at the store's timeout.
    """
    ordered = tuple(sorted(members))
    assert worker_id in ordered, (worker_id, ordered)
    rank = ordered.index(worker_id)
    if len(ordered) == 1:
        return Group(epoch, ordered, 0, None, device), WaitStatus.DONE
    prefixed = PrefixStore(keys.group_prefix(epoch, coordinate), store)
    timeout = datetime.timedelta(seconds=timeout_s)
    result: list[dist.ProcessGroup | BaseException] = []
    finished, abandoned = threading.Event(), threading.Event()

    def build() -> None:
        try:
            if backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                opts.config.blocking = False  # creation bounded by TORCH_NCCL_NONBLOCKING_TIMEOUT, abortable
                pg = dist.ProcessGroupNCCL(prefixed, rank, len(ordered), opts)
                pg._set_sequence_number_for_group()
                # The communicator now, on this thread: lazily, the first collective would create it on the
                # training thread, where a member that died after the rendezvous blocks it (torchft does this too).
                pg.eager_connect_single_device(device)
                if abandoned.is_set():  # the caller moved on: do not leave a communicator behind
                    pg.abort()
                result.append(pg)
            else:
                result.append(dist.ProcessGroupGloo(prefixed, rank, len(ordered), timeout))
        except BaseException as e:  # noqa: BLE001 - reported to the waiting thread
            result.append(e)
        finally:
            finished.set()

    start_rendezvous_thread(build, f"rendezvous-{epoch}")
    deadline = time.monotonic() + timeout_s
    while not finished.wait(CHECK_INTERVAL_S):
        if interrupted():
            abandoned.set()
            log.warning("epoch %d superseded while forming its group", epoch)
            return None, WaitStatus.INTERRUPTED
        if time.monotonic() > deadline:  # a member never arrived (the rendezvous thread is abandoned)
            abandoned.set()
            log.warning("forming the group of epoch %d timed out after %.1f s", epoch, timeout_s)
            return None, WaitStatus.TIMED_OUT
    if isinstance(result[0], BaseException):
        if backend_timed_out(result[0]):
            log.warning("forming the group of epoch %d timed out: %s", epoch, result[0])
            return None, WaitStatus.TIMED_OUT
        log.warning("forming the group of epoch %d failed: %s", epoch, result[0])
        return None, WaitStatus.FAILED
    return Group(epoch, ordered, rank, result[0], device, backend=backend), WaitStatus.DONE
