"""Collectives over the alive workers: one process group per membership epoch, bounded polled waits, and
the bucketed gradient reducer that overlaps the reduction with the last backward of a step.

Owns everything that touches ``torch.distributed`` in the workers. Nothing here raises into model code:
a wait returns ``False`` when it was interrupted (the membership epoch changed or the deadline passed) and
the caller abandons the group and re-plans. Reductions are out of place: a worker's local gradient
(``param.grad``) is never touched by a collective, so an interrupted reduction can be re-issued on the
next epoch's group from that intact copy.

NCCL groups (docs/gpu.md, 4.3) differ in three places: the communicator is created eagerly and non-blocking
inside ``form_group``; waits poll ``Work.is_completed()`` (a NCCL work's future completes when the collective
is enqueued, not when it ran); and an abandoned group is aborted (``abort_group``: ncclCommAbort ends the
kernel spinning on a dead peer) before the next one forms. CPU tensors given to a NCCL collective (the side
vector, the state transfer) go through a copy on the group's GPU.
"""

from __future__ import annotations

import collections
import datetime
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store

from unbroken.control.store import keys
from unbroken.ft.foldkernel import (
    KERNEL_ARITY,
    dequantise,
    kernel_applies,
    kernels_serve,
    quantise_sum,
    quantise_sum_many,
)

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 0.005
ABORT_DEADLINE_S = 30.0  # past this, a NCCL abort that has not returned ends the worker (it rejoins if restarted)
EXIT_ABORT_HUNG = 7
# Exact mode on the CPU: a parameter's gradients of up to this many microbatches wait to be folded in one pass
# (the fold is bound by memory writes: one write of the sum instead of one per microbatch), at the price of
# keeping up to this many gradients at once.
PENDING_FOLDS = KERNEL_ARITY


class WaitStatus(Enum):
    """How a bounded wait on collectives ended."""

    DONE = "done"
    INTERRUPTED = "interrupted"  # ``interrupted()`` turned true (a member was removed, the run stops)
    TIMED_OUT = "timed out"  # the deadline passed with every member still in the group (a stall, a partition)
    FAILED = "failed"  # the backend reported an error (e.g. a connection reset by a dead peer)

    def __bool__(self) -> bool:
        return self is WaitStatus.DONE


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


def _start_rendezvous_thread(target: Callable[[], None], name: str) -> None:
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

    _start_rendezvous_thread(build, f"rendezvous-{epoch}")
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
        log.warning("forming the group of epoch %d failed: %s", epoch, result[0])
        return None, WaitStatus.FAILED
    return Group(epoch, ordered, rank, result[0], device, backend=backend), WaitStatus.DONE


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
        _start_rendezvous_thread(lambda: self._form(epoch, tuple(members), attempt), f"pre-form-{epoch}")

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


class Pending:
    """A collective in flight (or already complete for a group of one). ``poll``: wait by polling
    ``is_completed()`` (NCCL); ``result``: where the result goes once done, when the collective ran on a
    copy (``staged``) of a CPU tensor on the group's GPU."""

    def __init__(
        self,
        work: dist.Work | None,
        poll: bool = False,
        staged: torch.Tensor | None = None,
        result: torch.Tensor | None = None,
    ) -> None:
        self.work = work
        self.poll = poll
        self.staged = staged
        self.result = result

    def done(self) -> bool:
        return self.work is None or self.work.is_completed()

    def finish(self) -> None:
        """After a successful wait: the result into the caller's tensor (a staged collective)."""
        if self.staged is not None and self.result is not None:
            self.result.copy_(self.staged)


def wait_all(
    pending: Sequence[Pending],
    timeout_s: float,
    interrupted: Callable[[], bool],
) -> WaitStatus:
    """Wait for every collective; anything but ``DONE`` (falsy) if ``interrupted()`` turns true, time runs
    out, or the backend fails.

    ``interrupted`` is typically "the membership epoch changed" and must be cheap (a cached value). A gloo
    collective whose peer died errors only on the dead rank's neighbours; everyone else would block until
    the group timeout, so the epoch watch is what bounds the wait. The thread sleeps on the collective's
    completion (no busy polling that would steal CPU from compute) and wakes every ``CHECK_INTERVAL_S``.
    """
    deadline = time.monotonic() + timeout_s
    for p in pending:
        if p.work is None:
            if interrupted():  # a group of one: no collective, but a membership change still ends the wait
                return WaitStatus.INTERRUPTED
            p.finish()
            continue
        if not p.done():
            finished = threading.Event()
            if not p.poll:
                p.work.get_future().add_done_callback(lambda _f, e=finished: e.set())
            while not (finished.is_set() or (p.poll and p.work.is_completed())):
                # A collective that completed counts, even when the membership has changed since: every member took
                # part in it, and the others go on with its result (commit the step), so this member must too.
                if interrupted() and not p.work.is_completed():
                    return WaitStatus.INTERRUPTED
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning("collective timed out after %.1f s", timeout_s)
                    return WaitStatus.TIMED_OUT
                finished.wait(min(remaining, CHECK_INTERVAL_S))
        try:
            p.work.wait()  # completed: surfaces a backend error (e.g. a reset connection) as an exception
        except RuntimeError as e:
            log.warning("collective failed: %s", e)
            return WaitStatus.FAILED
        p.finish()
    return WaitStatus.DONE


def _staged(group: Group, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a collective of ``group`` runs on: ``tensor``, or for NCCL a copy on the group's GPU."""
    return tensor.to(group.device) if group.nccl and tensor.device != group.device else tensor


def _pending(group: Group, work: dist.Work, staged: torch.Tensor, tensor: torch.Tensor) -> Pending:
    group.track(work)
    return Pending(work, poll=group.nccl, staged=staged if staged is not tensor else None, result=tensor)


def allreduce_async(group: Group, tensor: torch.Tensor, max_op: bool = False) -> Pending:
    """Start a SUM (``max_op``: MAX) all-reduce of ``tensor`` in place over the group."""
    if group.pg is None:
        return Pending(None)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX if max_op else dist.ReduceOp.SUM
    staged = _staged(group, tensor)
    try:
        work = group.pg.allreduce([staged], opts)
    except RuntimeError as e:  # a dead group fails at once
        log.warning("allreduce could not start: %s", e)
        return _failed()
    return _pending(group, work, staged, tensor)


def broadcast_async(group: Group, tensor: torch.Tensor, src_rank: int) -> Pending:
    """Start a broadcast of ``tensor`` from the member at ``src_rank``."""
    if group.pg is None:
        return Pending(None)
    opts = dist.BroadcastOptions()
    opts.rootRank = src_rank
    opts.rootTensor = 0
    staged = _staged(group, tensor)
    try:
        work = group.pg.broadcast([staged], opts)
    except RuntimeError as e:
        log.warning("broadcast could not start: %s", e)
        return _failed()
    return _pending(group, work, staged, tensor)


class _FailedWork:
    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        raise RuntimeError("collective could not be started on this group")


def _failed() -> Pending:
    return Pending(_FailedWork())  # type: ignore[arg-type]


@dataclass
class LocalFlags:
    """What the exact fold saw in this step's local microbatches (reported through the side vector)."""

    nonfinite_ids: list[int] = field(default_factory=list)  # microbatches with a NaN or an infinity
    first_bad_param: int | None = None  # index of the first parameter whose gradient was not finite
    overflow: int = 0  # microbatches whose gradient did not fit the fixed point


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (FSDP2's sharded parameters), without importing DTensor's module: it
    costs a worker about a second at start, and where it was never imported no tensor can be one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: the local part of a ``DTensor`` (FSDP's shard, a tensor-parallel split),
    else the tensor."""
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def split_over_tensor_ranks(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is split over the replica's tensor ranks (a ``DTensor`` sharded on the mesh dimension
    named ``"tensor"``); if not, every tensor rank holds the same values of it."""
    if not is_dtensor(tensor):
        return False
    from torch.distributed.tensor import Shard

    names = tensor.device_mesh.mesh_dim_names or ()  # type: ignore[attr-defined]
    return any(n == "tensor" and isinstance(p, Shard) for n, p in zip(names, tensor.placements, strict=True))  # type: ignore[attr-defined]


class GradientReducer:
    """Sums the workers' local gradients into a separate flat buffer, bucket by bucket.

    Buckets hold parameters in reverse registration order (the order backward produces them). While a step's
    last local backward runs (``arm``), a bucket's all-reduce starts as soon as all its gradients are final,
    so communication overlaps compute (as DDP does). Buckets start strictly in index order on every worker,
    so the collectives match across workers whatever order the hooks fire in.

    In ``exact`` mode every microbatch's gradient is folded into a local int64 fixed-point accumulator with a
    per-tensor power-of-two scale (``exact.FixedPointScale``, set with ``set_exponents``); integer addition
    is associative, so the reduced gradient is bitwise the same whichever worker computed which microbatch.
    The armed backward folds each gradient as soon as it is final, so exact mode overlaps too. A gradient
    that is not finite, or that would not fit, is noted in ``flags`` (a property of the microbatch, so every
    worker agrees after the reduction); the step is then skipped or redone, never committed.

    The local contribution (``param.grad`` in fp32 mode, the int64 accumulator in exact mode) is never
    touched by a collective, so a reduction interrupted by a failure is restarted on the next group from it.

    Parameters sharded by FSDP or split by tensor parallelism (``DTensor``s) are reduced as their local parts:
    across replicas, rank coordinate by rank coordinate. In exact mode FSDP's parameters have their microbatch
    gradients folded inside FSDP's reduce-scatter (``fsdp.ExactReduceScatter``, through ``note`` and
    ``accumulate``) instead of by ``fold``.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        bucket_bytes: int,
        num_extras: int,
        exact: bool = False,
        first_bucket_bytes: int | None = None,
        buckets: list[list[int]] | None = None,
    ) -> None:
        self.params = list(params)
        self.num_extras = num_extras
        self.exact = exact
        # Sharded by FSDP (its units give the buckets): FSDP's reduce-scatter folds their gradients. Tensor
        # parallelism alone also makes ``DTensor``s, whose local parts are folded here as whole tensors are.
        self.sharded = buckets is not None and any(is_dtensor(p) for p in self.params)
        self.numels = [local_tensor(p).numel() for p in self.params]
        device = local_tensor(self.params[0]).device
        element_bytes = 8 if exact else 4
        # A small first bucket (DDP's policy) starts the reduction of the last layers' gradients while the
        # rest of the backward runs.
        first_bytes = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
        self.buckets: list[list[int]] = []
        current: list[int] = []
        current_bytes = 0
        for index in reversed(range(len(self.params))):
            current.append(index)
            current_bytes += self.numels[index] * element_bytes
            if current_bytes >= (bucket_bytes if self.buckets else first_bytes):
                self.buckets.append(current)
                current, current_bytes = [], 0
        if current:
            self.buckets.append(current)
        if buckets is not None:  # the order gradients become final in: FSDP's units (``fsdp.fsdp_buckets``)
            assert sorted(i for b in buckets for i in b) == list(range(len(self.params))), "every parameter once"
            self.buckets = [list(b) for b in buckets]
        self.offsets: list[int] = [0] * len(self.params)
        self.bucket_ranges: list[tuple[int, int]] = []
        offset = 0
        for bucket in self.buckets:
            start = offset
            for index in bucket:
                self.offsets[index] = offset
                offset += self.numels[index]
            self.bucket_ranges.append((start, offset))
        dtype = torch.int64 if exact else torch.float32
        self.flat = torch.zeros(offset, dtype=dtype, device=device)
        self.extras = torch.zeros(num_extras, dtype=torch.float64)
        self.accumulator = torch.zeros(offset, dtype=torch.int64, device=device) if exact else None
        # Exact mode: a parameter's slice of the accumulator counts as zero until first written, and its
        # gradients wait, not yet folded, in ``_unfolded`` (microbatch id, gradient) until PENDING_FOLDS of them
        # are there or the reduction starts: one pass then reads them all and writes their sum once.
        self._written = [False] * len(self.params)
        self._unfolded: list[list[tuple[int, torch.Tensor]]] = [[] for _ in self.params]
        self._overflowed: set[int] = set()  # microbatches with a gradient that did not fit
        self.exponents = [0] * len(self.params)
        self.limit = math.inf
        self._flags = LocalFlags()
        self._observed = [0.0] * len(self.params)  # exact mode: max |microbatch gradient| seen, per tensor
        # Exact mode on a GPU: folded gradients' peaks still on the device, as ((parameter index, microbatch id)
        # of each peak, peaks): read back all at once when the flags are needed (one wait for the device per
        # reduction).
        self._unread: list[tuple[list[tuple[int, int]], torch.Tensor]] = []
        # Exact mode off the CPU kernels (a GPU): the fold and the conversion back run over all parameters at
        # once. fp32 mode never asks: loading the kernels (numba) costs a process about 57 MiB.
        self._together = exact and not kernels_serve(device)
        self.bucket_of = {index: b for b, bucket in enumerate(self.buckets) for index in bucket}
        self._group: Group | None = None
        self._ready: list[int] = [0] * len(self.buckets)
        self._launched = 0
        self._pending: list[Pending] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []  # only while a backward is armed
        self._armed_microbatch: int | None = None
        # The microbatch whose backward runs now (set by the step protocol); a padding microbatch (a rank of a
        # replica with nothing left to compute in a round) contributes nothing.
        self.current: int | None = None
        self.padding = False

    def _view(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        return buffer[self.offsets[index] : self.offsets[index] + self.numels[index]]

    # -- exact mode ---------------------------------------------------------------------------------
    def set_exponents(self, exponents: Sequence[int], limit: float) -> None:
        """Exact mode: values are rounded to multiples of ``2**-exponents[i]``; |value x 2**e| < ``limit``."""
        assert self.exact and len(exponents) == len(self.params)
        self.exponents = list(exponents)
        self.limit = limit

    def reset_local(self) -> None:
        """Forget the local contribution (a new step, or a step that must be redone)."""
        self._written = [False] * len(self.params)
        self._unfolded = [[] for _ in self.params]
        self._overflowed = set()
        self._flags = LocalFlags()
        self._observed = [0.0] * len(self.params)
        self._unread = []
        for p in self.params:
            p.grad = None

    @property
    def flags(self) -> LocalFlags:
        """What the exact fold saw in this step's local microbatches so far."""
        self._read_peaks()
        return self._flags

    @property
    def observed(self) -> list[float]:
        """Exact mode: the largest |microbatch gradient| folded so far, per tensor."""
        self._read_peaks()
        return self._observed

    def _read_peaks(self) -> None:
        """Note the peaks still on the device (one transfer for all of them)."""
        if not self._unread:
            return
        unread, self._unread = self._unread, []
        values = torch.cat([peaks for _, peaks in unread]).tolist()
        at = 0
        for pairs, _ in unread:
            for index, microbatch in pairs:
                self._note(index, microbatch, values[at])
                at += 1

    def _take(self, index: int, microbatch: int) -> None:
        """Take parameter ``index``'s gradient of ``microbatch`` out of ``param.grad`` into the waiting ones."""
        p = self.params[index]
        if p.grad is None:
            return
        grad = local_tensor(p.grad)
        p.grad = None
        self._unfolded[index].append((microbatch, grad))

    def _fold_due(self, indices: Sequence[int]) -> None:
        """Fold into the accumulator the waiting gradients of ``indices`` that are due: on the CPU kernels once
        PENDING_FOLDS of a parameter's wait, elsewhere at once (torch's ops gain nothing from waiting)."""
        due = [
            i
            for i in indices
            if self._unfolded[i]
            and (len(self._unfolded[i]) >= PENDING_FOLDS or not kernel_applies(self._unfolded[i][0][1]))
        ]
        self._fold_into(due, self.accumulator)
        for i in due:
            self._unfolded[i].clear()
            self._written[i] = True

    def _fold_into(self, indices: Sequence[int], target: torch.Tensor) -> None:
        """``_fold`` of each of ``indices`` into its view of ``target`` (the accumulator, or the buffer the
        collective reduces). Off the CPU kernels, the parameters with one waiting gradient (all of them, on a
        GPU) are folded together, in a number of kernel launches that does not grow with their count."""
        together = [i for i in indices if len(self._unfolded[i]) == 1 and not kernel_applies(self._unfolded[i][0][1])]
        alone = set(indices).difference(together)
        for index in indices:
            if index in alone:
                self._fold(index, self._view(target, index))
        if not together:
            return
        peaks = quantise_sum_many(
            [self._unfolded[i][0][1] for i in together],
            [self._view(self.accumulator, i) if self._written[i] else None for i in together],
            [self._view(target, i) for i in together],
            [self.exponents[i] for i in together],
        )
        self._unread.append(([(i, self._unfolded[i][0][0]) for i in together], peaks))

    @torch.no_grad()
    def _fold(self, index: int, out: torch.Tensor) -> None:
        """``out`` = parameter ``index``'s accumulated sum plus its waiting gradients, fixed point; notes what
        each gradient's microbatch showed (not finite, did not fit). Folding the same gradients again (a
        reduction restarted on a new group) notes nothing new."""
        unfolded = self._unfolded[index]
        accumulated = self._view(self.accumulator, index) if self._written[index] else None
        exponent = self.exponents[index]
        # The accumulator is written before the checks: a microbatch that fails them makes the step skipped
        # (not finite) or redone from an empty accumulator (did not fit), never committed.
        peaks = quantise_sum([g for _, g in unfolded], accumulated, out, exponent, self.limit, lazy=True)
        if isinstance(peaks, torch.Tensor):
            self._unread.append(([(index, microbatch) for microbatch, _ in unfolded], peaks))
            return
        for (microbatch, _), value in zip(unfolded, peaks, strict=True):
            self._note(index, microbatch, value)

    def _note(self, index: int, microbatch: int, value: float) -> bool:
        """What microbatch ``microbatch``'s gradient of parameter ``index`` showed (its max |value|): True if it
        is finite and fits the fixed point; else the flags say so (the step is then skipped or redone)."""
        if not math.isfinite(value):
            if microbatch not in self._flags.nonfinite_ids:
                self._flags.nonfinite_ids.append(microbatch)
            if self._flags.first_bad_param is None or index < self._flags.first_bad_param:
                self._flags.first_bad_param = index
            fits = False
        else:
            self._observed[index] = max(self._observed[index], value)
            fits = value * 2.0 ** self.exponents[index] < self.limit
            if not fits:
                self._overflowed.add(microbatch)
        self._flags.overflow = len(self._overflowed - set(self._flags.nonfinite_ids))
        return fits

    def note(self, index: int, value: float) -> bool:
        """The current microbatch's gradient of parameter ``index`` has max |value| ``value`` (folded outside,
        by FSDP's reduce-scatter): see ``_note``."""
        assert self.current is not None, "the step protocol names the microbatch before its backward"
        return self._note(index, self.current, value)

    def accumulate(self, index: int, values: torch.Tensor) -> None:
        """Add ``values`` (int64, parameter ``index``'s local shard) into the local contribution."""
        assert self.accumulator is not None
        view = self._view(self.accumulator, index)
        if self._written[index]:
            view.add_(values)
        else:
            view.copy_(values)
            self._written[index] = True

    def fold(self, microbatch: int) -> None:
        """Exact mode: move the gradient of microbatch ``microbatch``, just back-propagated, into the local
        contribution (the armed backward takes its own gradients as they come; FSDP's reduce-scatter folds
        sharded parameters itself)."""
        assert self.accumulator is not None
        if self.sharded:
            return
        for index in range(len(self.params)):
            self._take(index, microbatch)
        self._fold_due(range(len(self.params)))

    def check_nonfinite(self, microbatch_ids: Sequence[int]) -> None:
        """fp32 mode: note whether this worker's local gradient (its microbatches ``microbatch_ids``) holds a
        NaN or an infinity (one fused pass; called only on the path that diagnoses a skipped step)."""
        assert not self.exact
        grads = [(i, local_tensor(p.grad)) for i, p in enumerate(self.params) if p.grad is not None]
        if not grads:
            return
        peaks = torch._foreach_norm([g for _, g in grads], float("inf"))
        bad = [i for (i, _), peak in zip(grads, peaks, strict=True) if not math.isfinite(float(peak))]
        if bad:
            self._flags.first_bad_param = bad[0]
            self._flags.nonfinite_ids = list(microbatch_ids)

    # -- overlapped launch --------------------------------------------------------------------------
    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            if self._group is None:
                return
            if self.exact and not self.sharded:  # (FSDP's reduce-scatter has folded a sharded one already)
                assert self._armed_microbatch is not None
                self._take(index, self._armed_microbatch)  # folded as its bucket is filled
            self._ready[self.bucket_of[index]] += 1
            self._launch_ready()

        return hook

    def arm(self, group: Group, microbatch: int) -> None:
        """Overlap the coming backward of ``microbatch`` (the last local one of the step) with the reduction
        on ``group``: each bucket's all-reduce starts once its gradients are final (exact mode: folded).

        The gradient hooks exist only from here to the launch: the step's other backwards (local
        accumulation, like DDP's ``no_sync``) run without a Python call per parameter."""
        self._start(group)
        self._armed_microbatch = microbatch
        if not self._hooks:
            self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

    @property
    def armed(self) -> int | None:
        """The microbatch whose backward is armed (its gradients are folded and launched as they come)."""
        return self._armed_microbatch

    @property
    def launched(self) -> int:
        """Buckets whose all-reduce has started in the current reduction."""
        return self._launched

    def _start(self, group: Group) -> None:
        self._group = group
        self._ready = [0] * len(self.buckets)
        self._launched = 0
        self._pending = []

    def _unhook(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @torch.no_grad()
    def _fill_bucket(self, b: int) -> None:
        if self.accumulator is not None:
            # The sum goes straight into the buffer the collective reduces; the accumulator and the waiting
            # gradients stay as they are, so a restarted reduction fills it again from them.
            self._fold_into([i for i in self.buckets[b] if self._unfolded[i]], self.flat)
            for index in self.buckets[b]:
                if not self._unfolded[index]:
                    view = self._view(self.flat, index)
                    if self._written[index]:
                        view.copy_(self._view(self.accumulator, index))
                    else:
                        view.zero_()
            return
        for index in self.buckets[b]:
            view = self._view(self.flat, index)
            if self.params[index].grad is None:
                view.zero_()
            else:
                grad = local_tensor(self.params[index].grad)
                assert grad.data_ptr() != view.data_ptr(), "reset_local() must drop the last step's reduced views"
                view.copy_(grad.reshape(-1))

    def _launch_ready(self) -> None:
        assert self._group is not None
        while self._launched < len(self.buckets):
            b = self._launched
            if self._ready[b] < len(self.buckets[b]):
                return
            self._fill_bucket(b)
            start, end = self.bucket_ranges[b]
            self._pending.append(allreduce_async(self._group, self.flat[start:end]))
            self._launched += 1

    def launch_gradients(self, group: Group) -> None:
        """Start every bucket that has not started yet (from the intact local contribution)."""
        self._unhook()
        if self._armed_microbatch is not None:
            if self.exact and not self.sharded:  # gradients the hooks never saw (none fires without a gradient)
                for index in range(len(self.params)):
                    self._take(index, self._armed_microbatch)
            self._armed_microbatch = None
        if self._group is not group:
            self._start(group)
        self._ready = [len(bucket) for bucket in self.buckets]  # params with no grad this step count as ready
        self._launch_ready()

    def launch_extras(self, extras: torch.Tensor) -> None:
        """Start the extras' reduction, the last collective of the step (after ``launch_gradients``)."""
        assert extras.numel() == self.num_extras and self._group is not None
        self.extras.copy_(extras)
        self._pending.append(allreduce_async(self._group, self.extras))

    def wait(self, timeout_s: float, interrupted: Callable[[], bool]) -> tuple[WaitStatus, torch.Tensor | None]:
        """The wait's status and, when ``DONE``, the reduced extras."""
        pending, self._pending, self._group = self._pending, [], None
        status = wait_all(pending, timeout_s, interrupted)
        return status, (self.extras.clone() if status else None)

    def disarm(self) -> None:
        """Forget an interrupted reduction. Its collectives may still run on the abandoned group and write
        into their buffers, so later reductions get fresh ones; the local contribution is intact."""
        self._unhook()
        self._group = None
        self._pending = []
        self.flat = torch.zeros_like(self.flat)
        self.extras = torch.zeros_like(self.extras)

    @torch.no_grad()
    def apply(self, scale: float = 1.0) -> None:
        """Replace every ``param.grad`` with the reduced sum (times ``scale``) after a successful ``wait``.

        In fp32 mode each ``param.grad`` becomes a view of the reduced buffer (no copy back, unlike DDP's
        default): the step's local gradients are no longer needed once the reduction completed, and the
        buffer is next written by the following step's reduction, after ``reset_local`` has dropped these
        views. In exact mode the integers are converted (int64 to float32 rounds once; the power-of-two scale
        is exact)."""
        converted = None
        if self._together and all(local_tensor(p).dtype == torch.float32 for p in self.params):
            # One conversion of the whole buffer and one multi-tensor scaling: the same bits as ``dequantise``
            # parameter by parameter, without a kernel launch per parameter.
            floats = self.flat.to(torch.float32)
            converted = [self._view(floats, index) for index in range(len(self.params))]
            torch._foreach_mul_(converted, [2.0**-e for e in self.exponents])
        for index, p in enumerate(self.params):
            view = self._view(self.flat, index)
            shard = local_tensor(p)
            if converted is not None:
                grad = converted[index].view_as(shard)
            elif self.exact:
                grad = dequantise(view, self.exponents[index], p.dtype).view_as(shard)
            else:
                grad = view.view_as(shard)
            if scale != 1.0:
                grad.mul_(scale)
            if is_dtensor(p):
                from torch.distributed.tensor import DTensor

                grad = DTensor.from_local(grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            p.grad = grad

    def close(self) -> None:
        self._unhook()
