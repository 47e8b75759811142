"""One optimizer step as the user's loop drives it: ``Step`` (``microbatches()``, ``backward()``, ``commit()``).

Owns ``Step``, the thin shell over the step protocol (``protocol.StepProtocol``) that ``Context.steps`` yields:
``microbatches()`` starts the step and yields the ids the plan gives this worker and, after the last one,
reduces; if a member died meanwhile it recovers and yields the ids that were lost, so the loop body runs for
them too; ``commit`` applies the agreed gradient (or skips a non-finite one on every member) and steps the
optimizer. Around each microbatch it drives the protocol's parts directly (the reduction armed before the
last backward, the plan's accounting after each) and calls the run's fault hook (``inject.PhaseHook``: the
null one when nothing is scheduled) where a fault fires inside the model. Also here: the data check's probe
(``datacheck``: another member's id, whose forward alone runs) and the rounds in which the FSDP ranks of a
replica compute their ids (``rounds``); a pipelined replica runs its microbatches with ``Step.pipeline``.
What the steps of a worker share is its ``Loop`` (``Context`` makes it): with ``Autocast``, the precision of
each microbatch's forward (``Context.autocast``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from unbroken.core.config import Precision
from unbroken.core.layout import ReplicaLayout
from unbroken.core.records import ErrorPhase
from unbroken.ft import datacheck, determinism
from unbroken.ft.protocol import StepProtocol, StopRun
from unbroken.ft.state import StepOutcome, TrainingState

if TYPE_CHECKING:
    from unbroken.ft.parallel.pipeline import BatchOf, Pipeline
    from unbroken.ft.parallel.replica import Replica

log = logging.getLogger(__name__)


class Autocast:
    """The precision of the forward (``train.precision``): ``Context.autocast`` under bf16, and the warning, once,
    when a microbatch's forward ran outside it (``check``). ``entered``: how many times it was entered."""

    def __init__(self, precision: Precision, state: TrainingState, device: Callable[[], torch.device]) -> None:
        self.fp32 = precision is Precision.FP32
        self.state = state
        self.device = device  # the worker's, for before a model is registered
        self.entered = 0
        self.warned = False

    def __call__(self) -> contextlib.AbstractContextManager[Any]:
        if self.fp32:
            return contextlib.nullcontext()
        self.entered += 1
        return torch.autocast(self.device_type(), dtype=torch.bfloat16)

    def device_type(self) -> str:
        """The registered model's device type (the worker's before one is registered)."""
        model = self.state.model
        param = next(model.parameters(), None) if model is not None else None
        return param.device.type if param is not None else self.device().type

    def check(self, seen: int) -> None:
        """Under bf16, a microbatch whose forward never entered ``autocast()`` (``entered`` is still ``seen``):
        warn once (it ran in float32)."""
        if self.fp32 or self.warned or self.entered != seen:
            return
        if torch.is_autocast_enabled(self.device_type()):
            return  # the user's own autocast, around the backward too
        self.warned = True
        log.warning('train.precision = "bf16" but the forward ran outside ctx.autocast(): it computed in float32')


@dataclass
class Loop:
    """What the steps of one worker's loop share: ``guard`` around every call into the protocol (a stop ends the
    worker, ``leaving.Leaving.guard``), the precision of the forward, the replica (its layout, and the
    ``Replica`` of a replica of several ranks), this rank's pipeline stage for a loss function (``pipeline``),
    and whether the loop gives ``backward`` its microbatches' inputs (``inputs_seen``: the data check can run)."""

    guard: Callable[[], contextlib.AbstractContextManager[None]]
    autocast: Autocast
    layout: ReplicaLayout
    replica: Replica | None
    pipeline: Callable[[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]], Pipeline]
    inputs_seen: bool = False


class StepStatus(Enum):
    OPEN = "open"  # microbatches not finished yet
    REDUCED = "reduced"  # the gradient is agreed: commit() next
    COMMITTED = "committed"
    ELSEWHERE = "elsewhere"  # the others committed it while this worker recovered; it received their state


class Step:
    """One optimizer step: ``microbatches()``, ``backward()`` for each, then ``commit()``."""

    def __init__(self, loop: Loop, proto: StepProtocol, index: int) -> None:
        self._loop = loop
        self._proto = proto
        self._guard = loop.guard
        self._autocast = loop.autocast
        self.index = index
        self._status = StepStatus.OPEN
        self._awaiting: int | None = None
        self._started = time.perf_counter()
        self._t0 = 0.0
        self._first = True
        self._factor = 1.0
        self._autocasts = 0
        self._padding = False
        self._body: int | None = None  # the microbatch whose loop body runs (the user's code), for a crash report
        self._committing = False
        self._probing = False  # the current microbatch is the data check's probe: its forward only
        self._probed = False
        self._saved: tuple[Any, ...] = ()  # what the probe's forward must not change: RNG states, buffers

    @property
    def _open(self) -> bool:
        """Its microbatches or its commit are still to come (the loop must commit it before the next step)."""
        return self._status in (StepStatus.OPEN, StepStatus.REDUCED)

    def _where(self) -> tuple[ErrorPhase, int | None]:
        """Where the user's code is in this step, for a crash report: the phase, and the microbatch whose loop
        body runs (None outside one)."""
        if self._committing:
            return ErrorPhase.COMMIT, None
        if self._body is not None:
            return ErrorPhase.MICROBATCH, self._body
        if self._open:
            return ErrorPhase.STEP, None
        return ErrorPhase.BETWEEN_STEPS, None

    def microbatches(self) -> Iterator[int]:
        """The microbatch ids this worker computes in this step: its share of the plan, then, if a member died
        meanwhile, its share of the lost ones (so the loop body runs for those too). Call ``backward`` once
        per id. When the iteration ends, ``param.grad`` holds the step's agreed gradient."""
        if self._status is not StepStatus.OPEN:
            raise ValueError(f"step {self.index}: microbatches() was already iterated")
        if self._loop.layout.pipeline > 1:
            raise ValueError("under parallel.pipeline > 1 a step runs its microbatches with step.pipeline()")
        proto, guard = self._proto, self._guard
        try:
            with guard():
                todo = proto.start_step()
            while not self._elsewhere(todo):
                lanes = rounds(todo, self._loop.layout.shard, self._loop.replica)
                started = time.perf_counter()
                for k, (j, padding, round_ids) in enumerate(lanes):
                    with guard():
                        self._enter(j, first=k == 0, last=k == len(lanes) - 1, padding=padding)
                    self._body = j
                    yield j
                    self._body = None
                    if self._awaiting is not None:
                        raise ValueError(f"step {self.index}: call step.backward(loss) for microbatch {j}")
                    if round_ids is not None:
                        proto.plan.round_done(round_ids)
                self._round_timed(started, len(lanes))
                if self._probe_due(bool(lanes)):
                    j = self._enter_probe()
                    yield j
                    if self._awaiting is not None:
                        raise ValueError(f"step {self.index}: call step.backward(loss) for microbatch {j}")
                todo_next = self._reduce()
                if todo_next is None:
                    return
                todo = todo_next
        finally:
            self._exit()

    def _round_timed(self, started: float, computed: int) -> None:
        """On a GPU: the seconds per microbatch of the round just computed, once its kernels have run (one wait
        for the compute stream a round; the gradients' reduction, on its own stream, goes on)."""
        device = self._proto.ctx.device
        if device.type != "cuda" or computed == 0:
            return
        torch.cuda.current_stream(device).synchronize()
        self._proto.plan.note_speed((time.perf_counter() - started) / computed)

    def _probe_due(self, computed: bool) -> bool:
        """Whether this worker runs the data check's probe now: it is this step's prober, has not run it yet,
        and its loop gives the library its inputs (known from its own microbatches, if it had any)."""
        probe = self._proto.plan.probe
        if probe is None or probe.prober != self._proto.membership.unit or self._probed:
            return False
        self._probed = True
        return self._loop.inputs_seen or not computed

    def _enter_probe(self) -> int:
        """The probe's microbatch comes next: only its forward runs (``backward`` takes its inputs' fingerprint
        and back-propagates nothing); the RNG states and the model's buffers it may change are put back then."""
        proto = self._proto
        probe, device = proto.plan.probe, proto.ctx.device
        assert probe is not None and proto.state.model is not None
        cuda = device.type == "cuda"
        buffers = [(b, b.detach().clone()) for b in proto.state.model.buffers()]
        self._saved = (torch.random.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None, buffers)
        eb = proto.state.efficient
        if eb is not None:
            eb.set_active(False)
        self._probing = True
        self._awaiting = probe.microbatch
        return probe.microbatch

    @torch.no_grad()
    def _leave_probe(self, inputs: Any) -> None:
        proto = self._proto
        if inputs is not None:
            proto.plan.probe_fps[1] = datacheck.fingerprint(inputs)
        cpu_rng, cuda_rng, buffers = self._saved
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, proto.ctx.device)
        for b, saved in buffers:
            b.copy_(saved)
        self._saved = ()
        self._probing = False
        self._awaiting = None

    def _elsewhere(self, todo: list[int]) -> bool:
        """The others committed this step while this worker recovered (it received their state): keep ``todo``,
        its share of the next step, for when that starts."""
        if self._proto.state.step == self.index:
            return False
        self._proto.pending_todo = todo
        self._status = StepStatus.ELSEWHERE
        return True

    def _reduce(self) -> list[int] | None:
        """Reduce this worker's microbatches: None once the step's gradient is agreed, else the ids to compute
        next (its share of those a failure lost, or all its own again after a fixed-point overflow)."""
        with self._guard():
            todo = self._proto.reduce_step()
        if todo is None:
            self._status = StepStatus.REDUCED
        return todo

    def pipeline(self, batch_of: BatchOf, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Under ``parallel.pipeline`` > 1, instead of ``microbatches()``: run this replica's microbatches through
        its pipeline (``batch_of(id) -> (inputs, targets)``, stacked along the first dimension; ``loss_fn(output,
        target)`` the mean loss of one microbatch, on the last stage), then, if a replica died meanwhile, its
        share of the lost ones. When it returns, ``param.grad`` holds the step's agreed gradient."""
        if self._status is not StepStatus.OPEN:
            raise ValueError(f"step {self.index}: its microbatches already ran")
        loop, proto, guard = self._loop, self._proto, self._guard
        model, hook = proto.state.model, proto.ctx.hook
        assert model is not None
        with guard():
            pipe = loop.pipeline(loss_fn)
            todo = proto.start_step()
        while not self._elsewhere(todo):
            hook.enter(model, self.index, first=True, last=True)
            started = time.perf_counter()
            # Under FSDP each shard's pipeline runs its lane of the rounds (a padding microbatch where a lane has
            # none left), so that every stage's ranks run as many backwards and reduce-scatters.
            lanes = rounds(todo, loop.layout.shard, loop.replica)
            ids = [j for j, _, _ in lanes]
            padding = {i for i, (_, pad, _) in enumerate(lanes) if pad}
            try:
                with guard():
                    losses = pipe.run(ids, batch_of, padding) if ids else {}
            finally:
                hook.leave()
                if proto.state.efficient is not None:
                    proto.state.efficient.set_active(False)
            hook.slow_down(time.perf_counter() - started, len(ids))  # this rank (so its replica) slower
            if pipe.last:
                proto.plan.pipelined(losses, {j: int(batch_of(j)[1].numel()) for j in losses})
            proto.plan.round_done(todo, (time.perf_counter() - started) / max(1, len(todo)))
            todo_next = self._reduce()
            if todo_next is None:
                return
            todo = todo_next

    def _enter(self, microbatch: int, first: bool, last: bool, padding: bool = False) -> None:
        proto = self._proto
        model = proto.state.model
        assert model is not None
        hook = proto.ctx.hook
        hook.enter(model, self.index, first, last, self._first)
        self._first = False
        if last:
            proto.reduction.arm(microbatch)  # the reduction overlaps the step's last backward
        eb = proto.state.efficient
        if eb is not None:
            eb.set_active(proto.plan.is_efficient(microbatch))
        self._awaiting = microbatch
        self._padding = padding
        proto.reduction.before_backward(microbatch, padding)
        self._factor = hook.loss_factor(microbatch)
        self._autocasts = self._autocast.entered
        self._t0 = time.perf_counter()

    def _exit(self) -> None:
        self._proto.ctx.hook.leave()
        eb = self._proto.state.efficient
        if eb is not None:
            eb.set_active(False)

    def backward(self, loss: torch.Tensor, tokens: int = 0, inputs: Any = None) -> None:
        """Back-propagate this microbatch's loss (its mean over its tokens); the library divides it by M, the
        microbatches of a step, so the step's gradient is their average whoever computed them. ``tokens``:
        how many tokens the microbatch trained on (for the step records' throughput). ``inputs``: the
        microbatch's input tensors (a tensor, or a tuple, list or dict of them), which the data check compares
        across workers (``unbroken.ft.datacheck``): give them, and data that is not a pure function of (seed,
        step, id) is caught."""
        j = self._awaiting
        if j is None:
            raise ValueError("step.backward() outside the microbatches() loop, or twice for one microbatch")
        if inputs is not None:
            datacheck.check_inputs(inputs)
            self._loop.inputs_seen = True
        if self._probing:
            self._leave_probe(inputs)
            return
        proto = self._proto
        probe = proto.plan.probe
        if inputs is not None and probe is not None and probe.microbatch == j:
            proto.plan.probe_fps[0] = datacheck.fingerprint(inputs)
        self._autocast.check(self._autocasts)
        if self._factor != 1.0:
            loss = loss * self._factor
        if self._padding:
            loss = loss * 0.0  # a padding microbatch of a round: it takes part in FSDP's collectives only
        with self._guard():  # failure injection inside the backward talks to the launcher
            try:
                (loss / proto.M).backward()
            except RuntimeError as e:
                op = determinism.nondeterministic_op(e)
                if op is None:
                    raise
                raise StopRun(determinism.stop_line(op), shared=True) from None  # the same on every worker
        hook = proto.ctx.hook
        hook.leave()
        eb = proto.state.efficient
        if eb is not None:
            eb.set_active(False)
        elapsed = time.perf_counter() - self._t0
        elapsed += hook.slow_down(elapsed)  # an injected slow-down: this worker computes slower
        self._awaiting = None
        if not self._padding:
            # On a GPU the time so far is the kernels' launch, not their run (timed per round, ``_round_timed``);
            # the loss stays on the device: nothing here waits for it.
            seconds = None if proto.ctx.device.type == "cuda" else elapsed
            proto.reduction.after_backward(j)
            proto.plan.after_backward(j, loss.detach(), tokens, seconds)

    def commit(self, optimizer: torch.optim.Optimizer | None = None, clip_grad_norm: float = 0.0) -> StepOutcome:
        """End the step: unless the gradient is not finite (then the step is skipped on every member alike),
        clip it to ``clip_grad_norm`` (0: no clipping) and step ``optimizer`` (default: the registered one);
        then save the checkpoint if one is due. Returns what the step did (the others' outcome if they
        committed it while this worker was recovering)."""
        proto = self._proto
        if self._status == StepStatus.ELSEWHERE:
            self._status = StepStatus.COMMITTED
            return proto.state.last
        if self._status != StepStatus.REDUCED:
            raise ValueError(f"step {self.index}: iterate microbatches() to the end before commit()")
        optimizer = optimizer if optimizer is not None else proto.state.optimizer
        self._committing = True  # left set if the optimizer raises: the crash report says where
        with self._guard():
            outcome = proto.commit(optimizer, clip_grad_norm, time.perf_counter() - self._started)
            self._status = StepStatus.COMMITTED
            proto.checkpoints.save_if_due()
        self._committing = False
        return outcome


def rounds(todo: list[int], shard: int, replica: Replica | None) -> list[tuple[int, bool, list[int] | None]]:
    """This rank's microbatches of ``todo`` as (id, padding, the round's ids): a replica of ``shard`` FSDP ranks
    computes them in rounds of ``shard``, rank j taking the j-th id of each (a microbatch is never split over
    ranks, so its gradient is the same bits whoever computes it); a rank with none left in the last round
    runs the round's first id as padding. A replica of one rank: its ids, no rounds."""
    if replica is None:
        return [(j, False, None) for j in todo]
    out: list[tuple[int, bool, list[int] | None]] = []
    for start in range(0, len(todo), shard):
        ids = todo[start : start + shard]
        mine = replica.shard < len(ids)
        out.append((ids[replica.shard] if mine else ids[0], not mine, ids))
    return out
