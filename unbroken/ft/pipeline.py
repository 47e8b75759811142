"""A replica of pipeline stages: this rank's stage run by a schedule of ``torch.distributed.pipelining``.

Each step a replica runs the microbatch ids the plan gives it as one pipelined batch: pipeline microbatch
``i`` is id ``ids[i]``, the same on every stage. ``Pipeline.run`` builds the batch from the user's
``batch_of(id) -> (inputs, targets)``, runs the schedule (GPipe or 1F1B; GPipe for a batch of fewer
microbatches than stages, which 1F1B refuses) and returns the losses the last stage computed. The loss of
each microbatch is divided by the step's M before its backward, as ``Step.backward`` does, and gradients
are summed, never averaged over the batch (``scale_grads=False``).

Exact mode folds every microbatch's gradient of the stage's parameters as its backward ends: the stage
tells the reducer which id each backward chunk is (``_FoldingStage``), so the fold does not depend on the
schedule's order. A ``PipelineStage`` cannot be reused by a schedule of another microbatch count, so one
stage and schedule are kept per count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from unbroken.core.config import PipelineSchedule
from unbroken.ft.comm import GradientReducer

BatchOf = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


class _FoldingStage(PipelineStage):
    """A ``PipelineStage`` that folds each microbatch's gradient into the exact reduction after its backward."""

    def __init__(self, *args: Any, on_backward: Callable[[int], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_backward = on_backward

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> None:
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        # A schedule's eval() goes through the same calls with the backward switched off: nothing to fold then.
        if self.has_backward:
            self._on_backward(bwd_chunk_id)


class Pipeline:
    """This rank's stage (``module``, index ``stage`` of ``stages``) of its replica's pipeline over ``group``."""

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        stages: int,
        device: torch.device,
        group: ProcessGroup,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        schedule: PipelineSchedule,
        reducer: GradientReducer,
        microbatches: int,
    ) -> None:
        self.module = module
        self.stage = stage
        self.stages = stages
        self.device = device
        self.group = group
        self.loss_fn = loss_fn
        self.schedule = schedule
        self.reducer = reducer
        self.M = microbatches
        self._schedules: dict[tuple[int, bool], PipelineScheduleSingle] = {}
        self._ids: list[int] = []
        # id of each scaled loss the schedule got -> the microbatch's loss (the schedule may also call the loss
        # function to infer shapes: only the losses it returns count)
        self._unscaled: dict[int, float] = {}
        self.on_microbatch: Callable[[int], None] = lambda _id: None  # before each forward (failure injection)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(output, target)
        scaled = loss / self.M
        self._unscaled[id(scaled)] = float(loss.detach())
        return scaled

    def _folded(self, chunk: int) -> None:
        if self.reducer.exact:
            self.reducer.fold(self._ids[chunk])

    def _schedule(self, n: int) -> PipelineScheduleSingle:
        gpipe = self.schedule is PipelineSchedule.GPIPE or n < self.stages
        key = (n, gpipe)
        if key not in self._schedules:
            stage = _FoldingStage(
                self.module, self.stage, self.stages, self.device, group=self.group, on_backward=self._folded
            )
            kind = ScheduleGPipe if gpipe else Schedule1F1B
            self._schedules[key] = kind(stage, n_microbatches=n, loss_fn=self._scaled_loss, scale_grads=False)
        return self._schedules[key]

    def _batch(self, ids: Sequence[int], batch_of: BatchOf) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not (self.first or self.last):
            return None, None
        pairs = [batch_of(j) for j in ids]
        inputs = torch.cat([x for x, _ in pairs]).to(self.device) if self.first else None
        targets = torch.cat([y for _, y in pairs]).to(self.device) if self.last else None
        return inputs, targets

    def run(self, ids: Sequence[int], batch_of: BatchOf) -> dict[int, float]:
        """Forward and backward of microbatches ``ids`` through the pipeline (every stage calls it with the same
        ids); the losses by id on the last stage, nothing elsewhere."""
        self._ids = list(ids)
        schedule = self._schedule(len(ids))
        inputs, targets = self._batch(ids, batch_of)
        args = (inputs,) if self.first else ()
        if not self.last:
            schedule.step(*args)
            return {}
        losses: list[torch.Tensor] = []
        self._unscaled = {}
        schedule.step(*args, target=targets, losses=losses)
        return {j: self._unscaled[id(loss)] for j, loss in zip(ids, losses, strict=True)}

    @torch.no_grad()
    def evaluate(self, ids: Sequence[int], batch_of: BatchOf) -> list[float]:
        """Forward only: the loss of each of ``ids`` on the last stage (empty elsewhere)."""
        schedule = self._schedule(len(ids))
        inputs, targets = self._batch(ids, batch_of)
        args = (inputs,) if self.first else ()
        if not self.last:
            schedule.eval(*args)
            return []
        losses: list[torch.Tensor] = []
        self._unscaled = {}
        schedule.eval(*args, target=targets, losses=losses)
        return [self._unscaled[id(loss)] for loss in losses]
