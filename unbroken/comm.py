"""Collectives over the alive workers: one process group per membership epoch, bounded polled waits, and
the bucketed gradient reducer that overlaps the reduction with the last backward of a step.

Owns everything that touches ``torch.distributed`` in the workers. Nothing here raises into model code:
a wait returns ``False`` when it was interrupted (the membership epoch changed or the deadline passed) and
the caller abandons the group and re-plans. Reductions are out of place: a worker's local gradient
(``param.grad``) is never touched by a collective, so an interrupted reduction can be re-issued on the
next epoch's group from that intact copy.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.0005


def default_backend(requested: str) -> str:
    """``auto`` -> ``nccl`` when CUDA is present, else ``gloo``."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return requested


@dataclass
class Group:
    """The process group of one membership epoch. ``rank`` is this worker's index among ``members``."""

    epoch: int
    members: tuple[int, ...]
    rank: int
    pg: dist.ProcessGroup | None  # None for a group of one (every collective is the identity)
    device: torch.device

    @property
    def size(self) -> int:
        return len(self.members)


def form_group(
    store: Store,
    epoch: int,
    members: Sequence[int],
    worker_id: int,
    backend: str,
    timeout_s: float,
    device: torch.device,
) -> Group:
    """Build the epoch's process group under the store prefix ``pg/<epoch>`` (every member calls this)."""
    ordered = tuple(sorted(members))
    assert worker_id in ordered, (worker_id, ordered)
    rank = ordered.index(worker_id)
    if len(ordered) == 1:
        return Group(epoch, ordered, 0, None, device)
    prefixed = PrefixStore(f"pg/{epoch}", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg: dist.ProcessGroup = dist.ProcessGroupNCCL(prefixed, rank, len(ordered), opts)
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, len(ordered), timeout)
    return Group(epoch, ordered, rank, pg, device)


class Pending:
    """A collective in flight (or already complete for a group of one)."""

    def __init__(self, work: dist.Work | None) -> None:
        self.work = work

    def done(self) -> bool:
        return self.work is None or self.work.is_completed()


def wait_all(
    pending: Sequence[Pending],
    timeout_s: float,
    interrupted: Callable[[], bool],
) -> bool:
    """Wait for every collective, polling; ``False`` if ``interrupted()`` turns true or time runs out.

    ``interrupted`` is typically "the membership epoch changed". A gloo collective whose peer died blocks
    only the dead rank's neighbours with an error; everyone else would block until the group timeout, so
    the epoch watch is what bounds the wait.
    """
    deadline = time.monotonic() + timeout_s
    next_check = 0.0
    for p in pending:
        while not p.done():
            now = time.monotonic()
            if now > deadline:
                log.warning("collective timed out after %.1f s", timeout_s)
                return False
            if now >= next_check:
                if interrupted():
                    return False
                next_check = now + 0.002
            time.sleep(POLL_INTERVAL_S)
        if p.work is not None:
            try:
                p.work.wait()  # completed: surfaces a backend error (e.g. a reset connection) as an exception
            except RuntimeError as e:
                log.warning("collective failed: %s", e)
                return False
    return True


def allreduce_async(group: Group, tensor: torch.Tensor) -> Pending:
    """Start a SUM all-reduce of ``tensor`` in place over the group."""
    if group.pg is None:
        return Pending(None)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    try:
        return Pending(group.pg.allreduce([tensor], opts))
    except RuntimeError as e:  # a dead group fails at once
        log.warning("allreduce could not start: %s", e)
        return _failed()


def broadcast_async(group: Group, tensor: torch.Tensor, src_rank: int) -> Pending:
    """Start a broadcast of ``tensor`` from the member at ``src_rank``."""
    if group.pg is None:
        return Pending(None)
    opts = dist.BroadcastOptions()
    opts.rootRank = src_rank
    opts.rootTensor = 0
    try:
        return Pending(group.pg.broadcast([tensor], opts))
    except RuntimeError as e:
        log.warning("broadcast could not start: %s", e)
        return _failed()


class _FailedWork:
    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        raise RuntimeError("collective could not be started on this group")


def _failed() -> Pending:
    return Pending(_FailedWork())  # type: ignore[arg-type]


class GradientReducer:
    """Sums the workers' local gradients into a separate flat buffer, bucket by bucket.

    Buckets hold parameters in reverse registration order (the order backward produces them). While a
    step's last local backward runs, a bucket's all-reduce starts as soon as all its gradients are final,
    so communication overlaps compute (as DDP does). Buckets start strictly in index order on every
    worker, so the collectives match across workers whatever order the hooks fire in. A final small
    bucket carries the step's extras (loss sum and per-microbatch counts).

    ``param.grad`` keeps the local contribution until ``apply()`` copies the reduced sum into it, so a
    reduction interrupted by a failure can be restarted on a new group from the same source.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], bucket_bytes: int, num_extras: int) -> None:
        self.params = list(params)
        self.num_extras = num_extras
        device = self.params[0].device
        self.buckets: list[list[int]] = []
        current: list[int] = []
        current_bytes = 0
        for index in reversed(range(len(self.params))):
            current.append(index)
            current_bytes += self.params[index].numel() * 4
            if current_bytes >= bucket_bytes:
                self.buckets.append(current)
                current, current_bytes = [], 0
        if current:
            self.buckets.append(current)
        self.offsets: list[int] = [0] * len(self.params)
        self.bucket_ranges: list[tuple[int, int]] = []
        offset = 0
        for bucket in self.buckets:
            start = offset
            for index in bucket:
                self.offsets[index] = offset
                offset += self.params[index].numel()
            self.bucket_ranges.append((start, offset))
        self.extras_range = (offset, offset + num_extras)
        self.flat = torch.zeros(offset + num_extras, dtype=torch.float32, device=device)
        self.bucket_of = {index: b for b, bucket in enumerate(self.buckets) for index in bucket}
        self._group: Group | None = None
        self._ready: list[int] = [0] * len(self.buckets)
        self._launched = 0
        self._pending: list[Pending] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            if self._group is None:
                return
            b = self.bucket_of[index]
            self._ready[b] += 1
            self._launch_ready()

        return hook

    def arm(self, group: Group) -> None:
        """Overlap the coming backward (the last local one of the step) with the reduction on ``group``."""
        self._group = group
        self._ready = [0] * len(self.buckets)
        self._launched = 0
        self._pending = []

    def _fill_bucket(self, b: int) -> None:
        with torch.no_grad():
            for index in self.buckets[b]:
                p = self.params[index]
                view = self.flat[self.offsets[index] : self.offsets[index] + p.numel()]
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad.reshape(-1))

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

    def finish(
        self, group: Group, extras: torch.Tensor, timeout_s: float, interrupted: Callable[[], bool]
    ) -> torch.Tensor | None:
        """Start whatever has not started (from the intact local grads), add the extras, and wait.

        Returns the reduced extras, or ``None`` if the reduction was interrupted. Call ``arm()`` first
        when an overlapped backward preceded it; without it, everything is reduced here.
        """
        assert extras.numel() == self.num_extras
        if self._group is not group:
            self.arm(group)
        self._ready = [len(bucket) for bucket in self.buckets]  # params with no grad this step count as ready
        self._launch_ready()
        start, end = self.extras_range
        self.flat[start:end].copy_(extras)
        self._pending.append(allreduce_async(group, self.flat[start:end]))
        pending, self._pending, self._group = self._pending, [], None
        if not wait_all(pending, timeout_s, interrupted):
            return None
        return self.flat[start:end].clone()

    def disarm(self) -> None:
        """Forget an interrupted reduction (its buffer may be half-reduced; the local grads are intact)."""
        self._group = None
        self._pending = []

    def apply(self) -> None:
        """Replace every ``param.grad`` with the reduced sum (after a successful ``finish``)."""
        with torch.no_grad():
            for index, p in enumerate(self.params):
                view = self.flat[self.offsets[index] : self.offsets[index] + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
