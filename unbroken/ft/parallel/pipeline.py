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

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining._backward import stage_backward  # what PipelineStage's own backward calls
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from unbroken.core.config import PipelineSchedule
from unbroken.ft.comm import GradientReducer

BatchOf = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def schedule_kind(schedule: PipelineSchedule, n: int, stages: int) -> type[PipelineScheduleSingle]:
    """torch's schedule class for ``n`` microbatches through ``stages`` stages: the configured one, except GPipe
    for fewer microbatches than stages, which 1F1B refuses."""
    return ScheduleGPipe if schedule is PipelineSchedule.GPIPE or n < stages else Schedule1F1B


class _FoldingStage(PipelineStage):
    """A ``PipelineStage`` that folds each microbatch's gradient into the exact reduction after its backward.

    A stage sharded by FSDP (``exact_fsdp``): torch's pipelining defers FSDP's reduce-scatter to the last
    microbatch, summing the microbatches' gradients in floating point first (in the schedule's order, over the
    ids this replica happens to compute). In exact mode each microbatch's backward reduce-scatters instead, so
    ``fsdp.ExactReduceScatter`` folds every microbatch's gradient on its own, as it does without pipelining: the
    cost is one reduce-scatter per microbatch instead of one per step, and no memory (the deferred path keeps
    the unsharded gradient for the whole step; this one for one microbatch)."""

    def __init__(
        self,
        *args: Any,
        before_forward: Callable[[int], None],
        on_backward: Callable[[int], None],
        before_backward: Callable[[int], None],
        padding: Callable[[int], bool],
        exact_fsdp: bool,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._before_forward = before_forward
        self._on_backward = on_backward
        self._before_backward = before_backward
        self._padding = padding
        self._exact_fsdp = exact_fsdp

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if self.has_backward:  # a training forward (eval() runs with the backward switched off)
            self._before_forward(fwd_chunk_id)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> None:
        # A schedule's eval() goes through the same calls with the backward switched off: nothing to fold then.
        if self.has_backward:
            self._before_backward(bwd_chunk_id)
        if loss is not None and self._padding(bwd_chunk_id):
            loss = loss * 0.0  # a padding microbatch: it takes part in the collectives only (every stage gets zeros)
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        if self.has_backward:
            self._on_backward(bwd_chunk_id)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
        if not (self._exact_fsdp and backward_type == "full" and isinstance(self.submod, FSDPModule)):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        # FSDP's own post-backward reduce-scatters this microbatch's gradient (parameters stay gathered until the
        # schedule's last backward: the step's later microbatches need them)
        self.submod.set_is_last_backward(False)
        self.submod.set_reshard_after_backward(False)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None


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
        self._schedules: dict[tuple[int, type[PipelineScheduleSingle]], PipelineScheduleSingle] = {}
        self._ids: list[int] = []
        self._padding: set[int] = set()  # positions in ``_ids`` of padding microbatches
        # id of each scaled loss the schedule got -> the microbatch's loss (the schedule may also call the loss
        # function to infer shapes: only the losses it returns count)
        self._unscaled: dict[int, float] = {}
        # Before each training forward on this stage, with the microbatch's id (MeCeFO: the efficient mode is
        # chosen per microbatch at its forward, which decides what its backward computes)
        self.before_forward: Callable[[int], None] = lambda _id: None

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

    def _forward_of(self, chunk: int) -> None:
        self.before_forward(self._ids[chunk])

    def _folded(self, chunk: int) -> None:
        if self.reducer.exact and chunk not in self._padding:
            self.reducer.fold(self._ids[chunk])

    def _backward_of(self, chunk: int) -> None:
        self.reducer.current = self._ids[chunk]  # the microbatch FSDP's reduce-scatter folds (exact mode)
        self.reducer.padding = chunk in self._padding

    def _is_padding(self, chunk: int) -> bool:
        return chunk in self._padding

    def _schedule(self, n: int) -> PipelineScheduleSingle:
        kind = schedule_kind(self.schedule, n, self.stages)
        key = (n, kind)
        if key not in self._schedules:
            stage = _FoldingStage(
                self.module,
                self.stage,
                self.stages,
                self.device,
                group=self.group,
                before_forward=self._forward_of,
                on_backward=self._folded,
                before_backward=self._backward_of,
                padding=self._is_padding,
                exact_fsdp=self.reducer.exact and self.reducer.sharded,
            )
            self._schedules[key] = kind(stage, n_microbatches=n, loss_fn=self._scaled_loss, scale_grads=False)
        return self._schedules[key]

    def _batch(self, ids: Sequence[int], batch_of: BatchOf) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not (self.first or self.last):
            return None, None
        pairs = [batch_of(j) for j in ids]
        inputs = torch.cat([x for x, _ in pairs]).to(self.device) if self.first else None
        targets = torch.cat([y for _, y in pairs]).to(self.device) if self.last else None
        return inputs, targets

    def run(self, ids: Sequence[int], batch_of: BatchOf, padding: Collection[int] = ()) -> dict[int, float]:
        """Forward and backward of microbatches ``ids`` through the pipeline (every stage calls it with the same
        ids); the losses by id on the last stage, nothing elsewhere. The microbatches at positions ``padding``
        count for nothing (a shard's lane with none left in a round: their gradient is zero, their loss left out)."""
        self._ids = list(ids)
        self._padding = set(padding)
        self.reducer.current = None  # until a microbatch's backward names its id (a shape inference's does not)
        schedule = self._schedule(len(ids))
        inputs, targets = self._batch(ids, batch_of)
        args = (inputs,) if self.first else ()
        if not self.last:
            schedule.step(*args)
            return {}
        losses: list[torch.Tensor] = []
        self._unscaled = {}
        schedule.step(*args, target=targets, losses=losses)
        pairs = zip(ids, losses, strict=True)
        return {j: self._unscaled[id(loss)] for i, (j, loss) in enumerate(pairs) if i not in self._padding}

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
