"""A fault-tolerant evaluation between steps: the items split over the members, the mean agreed and recorded.

Owns ``Evaluation``, what ``Context.evaluate`` and ``Context.evaluate_pipeline`` run: each member (under FSDP
each of its shards, under pipelining each replica through its pipeline) computes its share of the items, the
sums are reduced over the group, and the mean is published as the last committed step's ``eval`` record. An
evaluation a failure interrupts, or one after a step the group recovered in, is skipped on every member alike
(``StepProtocol.skips_evaluation``): it returns None, and the protocol has already recovered.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from unbroken.core.layout import ReplicaLayout
from unbroken.core.records import RecordKind
from unbroken.ft.protocol import StepProtocol

if TYPE_CHECKING:
    from unbroken.ft.parallel.pipeline import BatchOf, Pipeline
    from unbroken.ft.parallel.replica import Replica


class Evaluation:
    """The evaluations of one worker on ``proto``'s group. ``guard``: around every call into the protocol (a
    stop ends the worker). ``evaluating`` is set while the user's loss function runs (a crash report says so)."""

    def __init__(
        self,
        proto: StepProtocol,
        layout: ReplicaLayout,
        replica: Replica | None,
        guard: Callable[[], contextlib.AbstractContextManager[None]],
    ) -> None:
        self.proto = proto
        self.layout = layout
        self.replica = replica
        self.guard = guard
        self.evaluating = False

    def evaluate(self, num_items: int, loss_of: Callable[[int], float], record: bool) -> float | None:
        """``Context.evaluate``: the mean of ``loss_of(k)`` over the items, each member computing its share."""
        if self.layout.pipeline > 1:
            raise ValueError("under parallel.pipeline > 1, evaluate with evaluate_pipeline()")
        proto = self.proto
        group = proto.membership.group
        assert group is not None  # ``Context`` asks only once the group has formed
        if proto.skips_evaluation:
            return None
        total = torch.zeros(2, dtype=torch.float64)
        # The items are split over every rank computing a forward of its own: the members, and under FSDP each
        # member's shards. A replica's ranks run as many forwards each (FSDP gathers the weights together):
        # one with fewer items runs item 0 again and ignores it.
        lanes = group.size * self.layout.shard
        lane = group.rank * self.layout.shard + (self.replica.shard if self.replica is not None else 0)
        rounds = math.ceil(num_items / lanes) if self.replica is not None else 0
        self.evaluating = True  # left set if loss_of raises: the crash report says where
        for k in range(lane, max(num_items, rounds * lanes), lanes):
            value = float(loss_of(k if k < num_items else 0))
            if k < num_items and self._counts_losses:
                total[0] += value
                total[1] += 1
        self.evaluating = False
        return self._mean_over_members(total, record)

    def evaluate_pipeline(
        self, num_items: int, pipeline: Callable[[], Pipeline], batch_of: BatchOf, record: bool
    ) -> float | None:
        """``Context.evaluate_pipeline``: the mean loss of the items, each replica running its share through its
        pipeline (``pipeline()``, forward only)."""
        proto = self.proto
        group = proto.membership.group
        assert group is not None
        if proto.skips_evaluation:
            return None  # as ``evaluate`` says
        ids = list(range(group.rank, num_items, group.size))
        total = torch.zeros(2, dtype=torch.float64)
        if ids:
            with self.guard():
                losses = pipeline().evaluate(ids, batch_of)
            if self._counts_losses and (self.replica is None or self.replica.shard == 0):  # shards run alike
                total[0], total[1] = sum(losses), len(losses)
        return self._mean_over_members(total, record)

    @property
    def _counts_losses(self) -> bool:
        """Whether this rank's losses count: the tensor ranks of a replica compute the same ones, the first speaks."""
        return self.replica is None or self.replica.tensor == 0

    def _mean_over_members(self, total: torch.Tensor, record: bool) -> float | None:
        """The mean over the members of an evaluation (``total``: this rank's sum and count); with ``record``,
        published as the last committed step's ``eval`` record."""
        proto = self.proto
        with self.guard():
            proto.membership.combine_sum(total)
            if not proto.allreduce_interruptible(total):
                return None
            mean = float(total[0] / total[1])
            if record:
                step = proto.state.step - 1  # the parameters evaluated are those of the last committed step
                proto.membership.publish(RecordKind.EVAL, step=step, val_loss=mean, val_ppl=math.exp(min(mean, 50.0)))
        return mean
