"""A replica of several ranks (``[parallel] shard`` / ``pipeline`` / ``tensor``): its own process group and
device mesh, and the bounded collectives its ranks use to take every decision together.

The ranks of a replica run FSDP's all-gathers and reduce-scatters, tensor parallelism's all-reduces and the
pipeline's sends and receives on the replica's own process group (this process's default group, formed once per
incarnation of the replica under ``keys.replica_prefix``) and its mesh's sub-groups; the fault-tolerant
reduction runs across replicas, per rank index, on the groups of ``comm``. Inside a replica the ranks must run
the same collectives in the same order, so every decision a rank could take differently from its replica-mates
(recover now or start the step, did the reduction complete on every rank index) is agreed first with a small
all-reduce (``agree``, ``any``).

A collective inside the replica that fails (a replica-mate died: its connections reset) or that outlasts
its bound means the replica is down, and so is one whose epoch removes it: this rank then leaves at once
(``down``). A gloo collective blocked on a dead peer cannot be unwound in-process (``abort()`` does not
release it, docs/parallel.md), so ending the process is what bounds it. The coordinator removes a replica
whole; its launcher or agent starts it again as a unit, under a new incarnation.
"""

from __future__ import annotations

import datetime
import logging
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from unbroken.control.store import keys
from unbroken.core.layout import ReplicaLayout
from unbroken.ft.comm import Pending, wait_all

log = logging.getLogger(__name__)


class Replica:
    """This rank's replica: ``index`` among the replicas, ``rank`` inside it (``stage``, ``shard``, ``tensor``),
    its ``mesh`` (the dimensions of ``ReplicaLayout.dims``: ``pp``, ``shard``, ``tensor``, those above 1), and
    bounded collectives over its ranks.

    ``leave(reason)`` ends this process (it must not return); ``removed()`` says whether the membership has
    removed this replica (waiting, bounded, for the news), set once the worker has registered."""

    def __init__(
        self,
        layout: ReplicaLayout,
        worker_id: int,
        store: Store,
        incarnation: str,
        timeout_s: float,
        device: torch.device,
        backend: str,
        leave: Callable[[str], NoReturn],
        spare: bool = False,
    ) -> None:
        self.layout = layout
        self.worker_id = worker_id
        self.index = layout.replica_of(worker_id)
        self.rank = layout.rank_of(worker_id)
        self.size = layout.size
        self.stage = layout.stage_of(worker_id)
        self.shard = layout.shard_of(worker_id)
        self.tensor = layout.tensor_of(worker_id)
        self.timeout_s = timeout_s
        self.incarnation = incarnation
        self._leave = leave
        self.removed: Callable[[], bool] = lambda: False
        self._leaving = threading.Lock()
        # A warm spare's ``worker_id`` is its spare index (spare replica ``index``, rank ``rank``) until it takes
        # a replica's place (``take_place``); its group is formed under the spare replica's rendezvous.
        rendezvous = keys.spare_replica_prefix if spare else keys.replica_prefix
        prefix = PrefixStore(rendezvous(self.index, incarnation), store)
        dist.init_process_group(
            backend,
            store=prefix,
            rank=self.rank,
            world_size=self.size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.pg = dist.group.WORLD
        names, sizes = zip(*layout.dims, strict=True)
        self.mesh: DeviceMesh = init_device_mesh(device.type, sizes, mesh_dim_names=names)
        # The pipeline's sends and receives: between the stages of this rank's (shard, tensor) coordinate.
        self.stage_group = self.mesh["pp"].get_group() if len(names) > 1 and "pp" in names else self.pg
        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        log.info(
            "rank %d of %s %d (incarnation %s): stage %d, shard %d, tensor %d",
            self.rank,
            "spare replica" if spare else "replica",
            self.index,
            incarnation,
            self.stage,
            self.shard,
            self.tensor,
        )

    def take_place(self, worker_id: int) -> None:
        """This rank of a whole spare replica takes the place of worker ``worker_id`` (of the rank it has: its
        part of the model, its process group and mesh stay as built)."""
        if self.layout.rank_of(worker_id) != self.rank:
            raise RuntimeError(f"rank {self.rank} of a spare replica was given worker {worker_id}, of another rank")
        self.worker_id, self.index = worker_id, self.layout.replica_of(worker_id)
        log.info("rank %d now of replica %d (worker %d)", self.rank, self.index, worker_id)

    # -- bounded collectives ----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """All-reduce ``tensor`` in place over the replica's ranks, bounded; a failure means the replica is down."""
        try:
            work = dist.all_reduce(tensor, op=op, group=self.pg, async_op=True)
        except RuntimeError as e:
            self.down(f"a collective inside the replica could not start ({_first_line(e)})")
        status = wait_all([Pending(work)], self.timeout_s, lambda: False)
        if not status:
            self.down(f"a collective inside the replica {status.value}")

    def agree(self, ok: bool) -> bool:
        """True only if ``ok`` is True on every rank of the replica (they all get the same answer)."""
        flag = torch.tensor([1.0 if ok else 0.0], dtype=torch.float64)
        self.all_reduce(flag, dist.ReduceOp.MIN)
        return bool(flag.item() == 1.0)

    def any(self, flag: bool) -> bool:
        """True if ``flag`` is True on some rank of the replica (they all get the same answer)."""
        return not self.agree(not flag)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank (small objects, rarely: set-up, the
        run's end)."""
        out: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(out, obj, group=self.pg)
        except RuntimeError as e:
            self.down(f"gathering inside the replica failed ({_first_line(e)})")
        return out

    # -- leaving ----------------------------------------------------------------------------------
    def down(self, why: str) -> NoReturn:
        """This replica is broken: this rank leaves now (the others leave too; the replica restarts whole)."""
        with self._leaving:
            log.error("replica %d is down (%s); rank %d leaves", self.index, why, self.rank)
            self._leave(f"replica {self.index} is down: {why}")
        raise AssertionError("leave() returned")  # pragma: no cover

    def collective_failed(self, error: BaseException) -> bool:
        """After ``error`` came out of a collective inside the replica (FSDP's, the pipeline's): if the
        membership removes this replica within a heartbeat or two, the replica is down and this rank leaves;
        False (the error is a bug, to be raised) if it does not."""
        if not isinstance(error, RuntimeError):
            return False
        if self.removed():
            self.down(f"a replica-mate is gone ({_first_line(error)})")
        return False

    def _excepthook(self, kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
        """An exception that escaped the user's loop: FSDP's all-gather in a forward raises when a replica-mate
        died. That is not a bug of the loop but the replica going down: leave with one line."""
        self.collective_failed(value)
        self._previous_hook(kind, value, traceback)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:160] if text else type(e).__name__
