"""Collectives over the alive workers: one process group per membership epoch, bounded polled waits, and the
bucketed gradient reducer that overlaps the reduction with the last backward of a step.

Owns everything that touches ``torch.distributed`` in the workers, by concern:

- ``groups``: the epoch's process group (``Group``, ``form_group``), retired off the training thread once replaced
  (``retire_group``), aborted when it is NCCL (``abort_group``), and ``settle`` before the interpreter exits;
- ``groupformer``: the next epoch's group formed ahead of need (``GroupFormer``);
- ``waits``: how a wait ended (``WaitStatus``), a collective in flight (``Pending``) and ``wait_all``;
- ``collectives``: ``allreduce_async`` and ``broadcast_async`` on a group;
- ``reducer``: ``GradientReducer``, over ``buckets`` (which parameters are reduced together, in backward order),
  ``fold`` (exact mode's fixed-point fold, ``PENDING_FOLDS``) and ``fp32`` (fp32 mode's local gradients);
- ``dtensors``: a rank's part of a ``DTensor`` (``local_tensor``, ``split_over_tensor_ranks``).

Nothing here raises into model code: a wait returns a falsy ``WaitStatus`` when it was interrupted (the membership
epoch changed or the deadline passed) and the caller abandons the group and re-plans. Reductions are out of place:
a worker's local gradient (``param.grad``) is never touched by a collective, so an interrupted reduction can be
re-issued on the next epoch's group from that intact copy.

NCCL groups (docs/gpu.md, 4.3) differ in three places: the communicator is created eagerly and non-blocking
inside ``form_group``; waits poll ``Work.is_completed()`` (a NCCL work's future completes when the collective
is enqueued, not when it ran); and an abandoned group is aborted (``abort_group``: ncclCommAbort ends the
kernel spinning on a dead peer) before the next one forms. CPU tensors given to a NCCL collective (the side
vector, the state transfer) go through a copy on the group's GPU.
"""

from unbroken.ft.comm.collectives import allreduce_async, broadcast_async
from unbroken.ft.comm.dtensors import TENSOR_DIMS, is_dtensor, local_tensor, split_over_tensor_ranks
from unbroken.ft.comm.fold import PENDING_FOLDS, ExactFold, LocalFlags
from unbroken.ft.comm.groupformer import GroupFormer
from unbroken.ft.comm.groups import (
    ABORT_DEADLINE_S,
    EXIT_ABORT_HUNG,
    Group,
    abort_group,
    form_group,
    retire_group,
    retired_groups,
    settle,
)
from unbroken.ft.comm.reducer import GradientReducer
from unbroken.ft.comm.waits import CHECK_INTERVAL_S, Pending, WaitStatus, wait_all

__all__ = [
    "ABORT_DEADLINE_S",
    "CHECK_INTERVAL_S",
    "EXIT_ABORT_HUNG",
    "PENDING_FOLDS",
    "TENSOR_DIMS",
    "ExactFold",
    "GradientReducer",
    "Group",
    "GroupFormer",
    "LocalFlags",
    "Pending",
    "WaitStatus",
    "abort_group",
    "allreduce_async",
    "broadcast_async",
    "form_group",
    "is_dtensor",
    "local_tensor",
    "retire_group",
    "retired_groups",
    "settle",
    "split_over_tensor_ranks",
    "wait_all",
]
