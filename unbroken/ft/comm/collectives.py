"""The collectives started on an epoch's group: ``allreduce_async`` and ``broadcast_async``, each a ``Pending``.

A collective that cannot start (a dead group fails at once) is a ``Pending`` whose wait fails; a group of one
has nothing to start. A CPU tensor given to a NCCL collective (the side vector, the state transfer) goes through
a copy on the group's GPU, copied back once the wait succeeds.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from unbroken.ft.comm.groups import Group
from unbroken.ft.comm.waits import Pending

log = logging.getLogger(__name__)


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
