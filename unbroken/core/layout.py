"""Replicas of several ranks: which worker is which rank of which replica. Pure Python, no torch.

A job of N workers under ``[parallel] shard = k, pipeline = p, tensor = t`` is R = N / (k x p x t) replicas.
Worker ``w`` is rank ``w mod (k x p x t)`` of replica ``w div (k x p x t)``; inside a replica, rank ``c`` is the
coordinate (stage, shard, tensor) of the replica's device mesh (pipeline, shard, tensor), row-major: tensor ranks
innermost (they talk most: every block's all-reduce), as torchtitan and Megatron lay them out. Every replica holds
the whole training state, split the same way; the fault-tolerant reduction runs per rank index ("coordinate")
across the live replicas. A replica is alive only while every one of its ranks is: the coordinator removes it
whole, and the planner plans microbatches over replicas. With k = p = t = 1 a replica is one worker and every
function here is the identity on worker ids.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

INCARNATION_ENV = "UNBROKEN_REPLICA_INCARNATION"  # set per start of a replica by whoever starts its ranks
DEFAULT_INCARNATION = "0"  # ranks started by hand (torchrun, srun) that are never restarted


@dataclass(frozen=True)
class ReplicaLayout:
    """``shard`` FSDP ranks of ``tensor`` tensor-parallel ranks each, for each of ``pipeline`` stages: a replica of
    ``size`` ranks."""

    shard: int = 1
    pipeline: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        if min(self.shard, self.pipeline, self.tensor) < 1:
            raise ValueError(f"a replica's degrees must be >= 1: {self}")

    @staticmethod
    def of(parallel: Any) -> ReplicaLayout:
        """The layout of a ``[parallel]`` config section (``core.config.ParallelConfig``)."""
        return ReplicaLayout(parallel.shard, parallel.pipeline, parallel.tensor)

    @property
    def size(self) -> int:
        return self.shard * self.pipeline * self.tensor

    @property
    def dims(self) -> tuple[tuple[str, int], ...]:
        """The replica's mesh dimensions above 1, outermost first, as (name, size): ``pp``, ``shard``, ``tensor``
        (one dimension ``shard`` for a replica of one rank)."""
        named = (("pp", self.pipeline), ("shard", self.shard), ("tensor", self.tensor))
        return tuple((name, n) for name, n in named if n > 1) or (("shard", 1),)

    def replica_of(self, worker: int) -> int:
        return worker // self.size

    def rank_of(self, worker: int) -> int:
        """The worker's rank inside its replica (its coordinate)."""
        return worker % self.size

    def stage_of(self, worker: int) -> int:
        return self.rank_of(worker) // (self.shard * self.tensor)

    def shard_of(self, worker: int) -> int:
        return self.rank_of(worker) // self.tensor % self.shard

    def tensor_of(self, worker: int) -> int:
        return self.rank_of(worker) % self.tensor

    def workers_of(self, replica: int) -> range:
        return range(replica * self.size, (replica + 1) * self.size)

    def replicas(self, workers: Iterable[int]) -> tuple[int, ...]:
        """The replicas ``workers`` belong to, sorted."""
        return tuple(sorted({self.replica_of(w) for w in workers}))

    def whole(self, workers: Iterable[int]) -> tuple[int, ...]:
        """The workers of ``workers`` whose replica is complete among them, sorted."""
        present = set(workers)
        return tuple(sorted(w for w in present if all(m in present for m in self.workers_of(self.replica_of(w)))))

    def with_replicas(self, workers: Iterable[int]) -> tuple[int, ...]:
        """Every worker of the replicas of ``workers`` (a death takes its whole replica down), sorted."""
        return tuple(sorted({m for w in workers for m in self.workers_of(self.replica_of(w))}))

    def coordinate(self, workers: Iterable[int], rank: int) -> tuple[int, ...]:
        """The workers of ``workers`` that are rank ``rank`` of their replica: one FT group's members."""
        return tuple(sorted(w for w in workers if self.rank_of(w) == rank))

    def replicas_in(self, workers: int) -> int:
        """How many replicas ``workers`` workers make; ValueError (one line) unless a whole number."""
        if workers % self.size:
            raise ValueError(
                f"--workers = {workers} is not a whole number of replicas of {self.size} ranks (parallel.shard = "
                f"{self.shard} x parallel.pipeline = {self.pipeline} x parallel.tensor = {self.tensor}); use a "
                f"multiple of {self.size}"
            )
        return workers // self.size
