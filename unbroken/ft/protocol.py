"""The step protocol of one worker: plan, compute, reduce, recover, commit (docs/library.md has the diagram).

Owns the sequence of collectives every member runs for a step, and what happens when the membership
changes in the middle of it: the group is abandoned, the next epoch's group is formed, whoever is behind
receives the state, the microbatch ids that no live member holds are planned again over the survivors, and
the reduction is issued again from each survivor's intact local contribution. A step ends in an explicit
commit: only when the reduced counts show each of the M ids exactly once (``drop``: at most once), the
members agree on the epoch, and the gradient is finite; otherwise the step is redone (fixed-point overflow),
skipped on every member alike (a non-finite gradient) or the run stops cleanly (a broken invariant).

It knows the registered state (``state.TrainingState``), the collectives (``comm``), the side vector
(``sidevec``), the coordinator (through ``control.client``) and the fault injector (``inject``); it knows
nothing of the user's model, data or loop, which drive it through ``api.Step``. It is an object, not a
process: unit tests drive several of them from threads of one process on real gloo groups.

With replicas of several ranks (``replica``: FSDP shards or pipeline stages, docs/parallel.md) the member
that plans, counts and commits is the replica; each rank runs the protocol on the group of its rank index
across the live replicas (its shard of the gradient and of the state), and the ranks of a replica agree on
every decision one of them could take differently (``Replica.agree``), so a replica commits, recovers or
leaves as one: every wait on a collective ends in such an agreement.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from unbroken.control.client import CoordinatorClient
from unbroken.core import ckptfiles
from unbroken.core.config import NonfinitePolicy, RecoveryPolicy, Reduction
from unbroken.core.failures import Phase
from unbroken.core.layout import ReplicaLayout
from unbroken.core.records import RecordKind
from unbroken.core.throughput import gpus_in_use, step_throughput
from unbroken.ft import checkpoint as ckpt
from unbroken.ft import datacheck
from unbroken.ft.ckptio import Checkpoints
from unbroken.ft.comm import (
    GradientReducer,
    Group,
    WaitStatus,
    allreduce_async,
    local_tensor,
)
from unbroken.ft.exact import FixedPointScale
from unbroken.ft.foldkernel import extremes
from unbroken.ft.gradnorm import exact_clip, float_clip, peaks
from unbroken.ft.inject import FaultInjector
from unbroken.ft.membership import Membership
from unbroken.ft.protocoldefs import (
    EXIT_COORDINATOR_LOST,
    EXIT_INVARIANT,
    EXIT_NONFINITE,
    EXIT_STOPPED,
    Interrupted,
    InvariantViolation,
    ProtocolConfig,
    StopRun,
)
from unbroken.ft.sidevec import Reduced, SideVector
from unbroken.ft.state import StepOutcome, TrainingState
from unbroken.ft.stepplan import StepPlan

if TYPE_CHECKING:
    from unbroken.ft.replica import Replica

__all__ = [
    "EXIT_COORDINATOR_LOST",
    "EXIT_INVARIANT",
    "EXIT_NONFINITE",
    "EXIT_STOPPED",
    "Interrupted",
    "InvariantViolation",
    "ProtocolConfig",
    "StepProtocol",
    "StopRun",
]

log = logging.getLogger(__name__)


class StepProtocol:
    """One worker's side of the protocol. Call order per step (``api.Step`` does it):
    ``start_step`` -> for each id: ``before_microbatch``, the user's forward, ``backward`` -> ``reduce_step``
    (again with the ids it returns until it returns None) -> ``commit``."""

    def __init__(
        self,
        cfg: ProtocolConfig,
        client: CoordinatorClient,
        state: TrainingState,
        run_dir: Path,
        injector: FaultInjector,
        backend: str,
        device: torch.device,
        ring: tuple[int, ...],
        total: int,
        replica: Replica | None = None,
    ) -> None:
        assert state.model is not None
        self.replica = replica
        self.layout = replica.layout if replica is not None else ReplicaLayout()
        self.cfg = cfg
        self.M = cfg.microbatches
        self.client = client
        self.state = state
        self.run_dir = run_dir
        self.injector = injector
        self.backend = backend
        self.device = device
        self.params = list(state.model.parameters())
        self.names = [n for n, _ in state.model.named_parameters()]
        # This rank's tensors among the whole model's (a pipeline stage holds some of them): their positions,
        # and every tensor's size and name, in the model's order.
        self.index, self.numels, self.all_names = self._model_tensors()
        self.exact = cfg.reduction is Reduction.EXACT
        if self.exact:
            state.scale = FixedPointScale(len(self.numels), self.M)
        self.side = SideVector(self.M)
        buckets = None
        if replica is not None:
            from unbroken.ft.fsdp import fsdp_buckets

            buckets = fsdp_buckets(state.model, self.params)
        self.reducer = GradientReducer(
            self.params,
            cfg.bucket_bytes,
            self.side.size,
            exact=self.exact,
            first_bucket_bytes=cfg.first_bucket_bytes,
            buckets=buckets,
        )
        if buckets is not None:
            from unbroken.ft.fsdp import prepare_fsdp

            prepare_fsdp(state.model, self.reducer)
        self._any_nonfinite = False  # a replica of several ranks, fp32: some rank's reduced shard is not finite
        self.members = Membership(cfg, client, state, injector, backend, device, self.layout, replica, run_dir)
        self.plan = StepPlan(cfg, state, ring, whole=replica is None)
        self.checkpoints = Checkpoints(cfg, self.members, state, injector, run_dir, total)
        client.on_epoch = self.members.epoch_published
        self.resume_pending = False
        # The newest epoch the leader had seen at the last reduction: every member reads the same value, so
        # they all take in joiners at the same step boundary (a join interrupts no collective).
        self.switch_epoch = 0
        self.pending_todo: list[int] | None = None
        self.reduced: Reduced | None = None
        self._nonfinite = False
        self._diagnosis: Reduced | None = None
        self.last_counts: list[int] = [1] * self.M
        self.last_tokens = 0
        # For the step records' MFU (core.throughput): the model's training FLOPs per token (given by the user's
        # loop, 0: unknown) and one device's peak TFLOP/s (0: unknown, e.g. the CPU).
        self.flops_per_token = 0.0
        self.peak_tflops = 0.0

    # -- the parts, as the user's loop (api) and the process reach them ------------------------------
    @property
    def group(self) -> Group | None:
        return self.members.group

    @property
    def unit(self) -> int:
        return self.members.unit

    @property
    def leader(self) -> bool:
        return self.members.leader

    @property
    def publisher(self) -> bool:
        return self.members.publisher

    def _model_tensors(self) -> tuple[list[int], list[int], list[str]]:
        n = len(self.params)
        mine = [(name, p.numel()) for name, p in zip(self.names, self.params, strict=True)]
        if self.replica is None or self.layout.pipeline == 1:
            return list(range(n)), [numel for _, numel in mine], list(self.names)
        stages = self.replica.gather(mine)  # in stage order: the model's order
        start = sum(len(stages[r]) for r in range(self.replica.rank))
        every = [entry for stage in stages for entry in stage]
        return list(range(start, start + n)), [numel for _, numel in every], [name for name, _ in every]

    @property
    def probe(self) -> datacheck.Probe | None:
        return self.plan.probe

    @property
    def probe_fps(self) -> list[float]:
        return self.plan.probe_fps

    def publish(self, kind: RecordKind, **fields: Any) -> None:
        self.members.publish(kind, **fields)

    def append_undrained(self, closing: dict[str, Any]) -> None:
        self.members.append_undrained(closing)

    def _combine_sum(self, tensor: torch.Tensor) -> None:
        self.members.combine_sum(tensor)

    # -- state ------------------------------------------------------------------------------------
    def republish_last_step(self) -> None:
        """The last committed step's record may have been lost with the old leader (killed between its commit
        and its publish): the new leader publishes it again, marked ``republished``."""
        last = self.state.last
        if self.group is None or not self.leader or self.state.step < 1 or math.isnan(last.loss):
            return
        fields = self._step_fields(self.state.step - 1, last, math.nan, fresh=False)
        self.publish(RecordKind.STEP, **fields, republished=True)

    # -- the step -----------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Fresh local state for the current step: no microbatch done, empty accumulators."""
        self.plan.begin()
        self.reducer.reset_local()
        if self.state.scale is not None:
            exponents = self.state.scale.exponents()
            self.reducer.set_exponents([exponents[i] for i in self.index], self.state.scale.limit)

    def start_step(self) -> list[int]:
        """The ids this worker computes first in the current step (after any recovery due now)."""
        group = self.group
        assert group is not None
        self.plan.reset_counts()
        self.reduced = None
        if self.pending_todo is not None:
            todo, self.pending_todo = self.pending_todo, None
            return todo
        # A join agreed in the last reduction (the same value on every rank), or a death between steps. The ranks of
        # a replica may see a death at different moments, so they do not act on it here: they start the step, and
        # its reduction (interrupted on every rank index) recovers.
        removed = self.replica is None and self.client.removed_since(group.epoch, group.members)
        if removed or self.switch_epoch > group.epoch:
            # A death between steps, or a join the group agreed on in the last reduction.
            self.plan.recoveries += 1
            if self.cfg.policy is RecoveryPolicy.DROP:
                # The others may have started this step with the group's plan: under drop only the dead members'
                # share is lost, so this worker still owes its own.
                self.plan.note_owners(self.plan.make(self.members.units()))
            return self.recover()
        self.injector.inject(Phase.START)
        plan = self.plan.make(self.members.units())
        self.plan.adopt(plan, group.epoch)
        return list(plan.ids_for(self.unit))

    def is_efficient(self, microbatch: int) -> bool:
        return self.plan.is_efficient(microbatch)

    def before_last_microbatch(self, microbatch: int) -> None:
        """Overlap the reduction with the last local backward of the step (under FSDP: of its last round, each
        unit's bucket starting once FSDP has reduce-scattered it)."""
        assert self.group is not None
        self.reducer.arm(self.group, microbatch)

    def before_backward(self, microbatch: int, padding: bool = False) -> None:
        """The backward of ``microbatch`` comes next (``padding``: a rank of a replica with nothing left in a
        round, whose gradient must count for nothing)."""
        self.reducer.current = microbatch
        self.reducer.padding = padding

    def after_backward(self, microbatch: int, loss: float | torch.Tensor, tokens: int, seconds: float | None) -> None:
        """Record microbatch ``microbatch`` as computed by this worker (its gradient is in the accumulator)."""
        if self.exact and self.reducer.armed != microbatch:
            self.reducer.fold(microbatch)
        self.plan.after_backward(microbatch, loss, tokens, seconds)

    def note_speed(self, seconds: float) -> None:
        self.plan.note_speed(seconds)

    def round_done(self, microbatches: list[int], seconds: float = 0.0) -> None:
        self.plan.round_done(microbatches, seconds)

    def pipelined(self, losses: dict[int, float], tokens: dict[int, int]) -> None:
        self.plan.pipelined(losses, tokens)

    def reduce(self) -> Reduced:
        """Reduce the local contribution and the side vector over the group; raises Interrupted."""
        assert self.group is not None
        # Every gradient first: launching them finishes the exact fold of the last microbatch, whose flags
        # (non-finite, overflow) the side vector carries.
        self.reducer.launch_gradients(self.group)
        flags = self.reducer.flags
        done = list(self.plan.done)
        if self.injector.duplicates(self.state.step) and done:
            done.append(done[0])  # an injected accounting fault: one id reported twice
        # A replica's ranks each add the losses of the microbatches they computed and what their own fold saw;
        # its first rank alone counts its ids and speaks for it (one member of the group).
        first = self.replica is None or self.replica.rank == 0
        extras = self.side.encode(
            worker=self.unit,
            losses=self.plan.loss_values(),
            tokens=self.plan.local_tokens,
            done=done if first else [],
            efficient=self.plan.done_efficient,
            nonfinite=flags.nonfinite_ids,
            overflow=flags.overflow,
            seconds=self.plan.my_speed if first else 0.0,
            bad_param=self.index[flags.first_bad_param] if flags.first_bad_param is not None else None,
            bad_worker=self.members.wid,
            epoch=self.group.epoch if first else 0,
            newest_epoch=self.client.latest_epoch if self.leader and first else 0,
            member=first,
            probe=(self.plan.probe_fps[0], self.plan.probe_fps[1]),
        )
        # Killed here, a worker has sent its gradients but not its counts, so the reduction cannot complete
        # without it: a kill "in the reduction" always interrupts one (sent after the extras, it could land
        # after the survivors had already finished and committed the step).
        self.injector.inject(Phase.REDUCTION)
        self.injector.stall(self.state.step)
        self.reducer.launch_extras(extras)
        status, reduced = self.reducer.wait(self.cfg.op_timeout_s, self.members.interrupted)
        if status is WaitStatus.TIMED_OUT:
            self.members.report_timeout()
        if self.replica is not None:
            reduced = self._replica_outcome(reduced)
        if reduced is None:
            self.reducer.disarm()
            raise Interrupted
        return self.side.decode(reduced)

    def _replica_outcome(self, reduced: torch.Tensor | None) -> torch.Tensor | None:
        """A rank of a replica of several ranks: the sum over its replica-mates of the side vectors each rank
        index reduced across the replicas (each carried its own rank's part), and whether every rank index was
        reduced (None unless it was: the replica commits only then) and, in fp32, whether any reduced shard is
        not finite; one collective inside the replica for all three."""
        assert self.replica is not None
        done = reduced is not None
        vector = torch.zeros(self.side.size + 2, dtype=torch.float64)
        if reduced is not None:
            vector[: self.side.size] = reduced
            vector[-1] = 1.0 if not self.exact and self._shard_not_finite() else 0.0
        vector[-2] = 1.0 if done else 0.0
        self.replica.all_reduce(vector)
        if int(vector[-2]) != self.replica.size:
            return None
        self._any_nonfinite = bool(vector[-1] > 0)
        return vector[: self.side.size]

    def _shard_not_finite(self) -> bool:
        """fp32 mode: whether the reduced gradient this worker holds (the same bits on every member) has a NaN or
        an infinity. A sum is one pass (a tenth of vector_norm(inf)'s time here); only a non-finite sum (which
        finite values too large to add up also give) needs a closer look."""
        if math.isfinite(float(self.reducer.flat.sum())):
            return False
        low, high = extremes(self.reducer.flat)
        return not (math.isfinite(low) and math.isfinite(high))

    def reduce_step(self) -> list[int] | None:
        """After this worker's microbatches: reduce. None when the step's gradient is reduced (and, unless it
        is not finite, in ``param.grad``); else the ids to compute next (after a recovery, or all of this
        worker's again after a fixed-point overflow)."""
        try:
            reduced = self.reduce()
            self.check_invariants(reduced)
            if self.exact and reduced.overflow > 0 and not any(reduced.nonfinite):
                return self._grow_scale()
            nonfinite = any(reduced.nonfinite) if self.exact else self._reduced_nonfinite(reduced)
        except Interrupted:
            # Recover outside the handler: the exception's traceback holds the abandoned collectives, which
            # keep the old group's connections open, so peers still waiting on them would hang.
            pass
        else:
            self.reduced = reduced
            self._nonfinite = nonfinite
            self._check_data(reduced)
            if not nonfinite:
                counted = sum(reduced.counted)
                self.reducer.apply(scale=self.M / counted if counted != self.M else 1.0)
                if sum(reduced.efficient):
                    self.normalise_attention(counted - sum(reduced.efficient), counted)
            return None
        todo = self.recover()
        self.plan.recoveries += 1
        return todo

    def _check_data(self, reduced: Reduced) -> None:
        """The data check: the probed microbatch's inputs on its computer and on the prober must agree (every
        member sees the same sums; each warns in its log, the leader publishes the record)."""
        probe = self.plan.probe
        line = datacheck.mismatch(self.state.step, probe, *reduced.probe) if probe is not None else None
        if probe is None or line is None:
            return
        log.warning("%s", line)
        workers = [probe.owner, probe.prober]
        self.publish(
            RecordKind.IMPURE_DATA, step=self.state.step, microbatch=probe.microbatch, workers=workers, reason=line
        )

    def _grow_scale(self) -> list[int]:
        """Some microbatch did not fit the fixed point: agree on the largest value each tensor saw over all M
        microbatches (MAX-reduced), grow the bounds above it, and redo the step."""
        assert self.group is not None and self.state.scale is not None
        observed = torch.zeros(len(self.numels), dtype=torch.float64)
        observed[self.index] = torch.tensor(self.reducer.observed, dtype=torch.float64)
        pending = allreduce_async(self.group, observed, max_op=True)
        self.members.wait([pending])
        self.members.combine_max(observed)  # a pipeline stage saw its own tensors only
        grown = self.state.scale.grow(observed.tolist())
        self.plan.redos += 1
        log.warning(
            "step %d: fixed-point overflow in %d tensors (first: %s); redoing the step with larger bounds",
            self.state.step,
            len(grown),
            self.all_names[grown[0]] if grown else "-",
        )
        self.begin_step()
        plan = self.plan.make(self.members.units())
        self.plan.note_owners(plan)
        return list(plan.ids_for(self.unit))

    def _reduced_nonfinite(self, reduced: Reduced) -> bool:
        """fp32 mode: whether the reduced gradient (the same bits on every member) holds a NaN or an infinity;
        if so, find out from every member's local gradient who and what (one more small reduction)."""
        # A replica's ranks each reduced their own shard: they told each other with the side vector's reduction.
        found = self._any_nonfinite if self.replica is not None else self._shard_not_finite()
        if not found:
            return False
        assert self.group is not None
        self.reducer.check_nonfinite(list(self.plan.local_losses))
        flags = self.reducer.flags
        first = self.replica is None or self.replica.rank == 0
        diagnosis = self.side.encode(
            worker=self.unit,
            losses={},
            tokens={},
            done=[],
            efficient=[],
            nonfinite=flags.nonfinite_ids,
            overflow=0,
            seconds=0.0,
            bad_param=self.index[flags.first_bad_param] if flags.first_bad_param is not None else None,
            bad_worker=self.members.wid,
            epoch=self.group.epoch if first else 0,
            member=first,
        )
        self.members.combine_sum(diagnosis)
        self.members.wait([allreduce_async(self.group, diagnosis)])
        self._diagnosis = self.side.decode(diagnosis)
        return True

    def check_invariants(self, reduced: Reduced) -> None:
        """The checks that guard the training state (explicit: they hold under ``python -O`` too)."""
        assert self.group is not None
        step, counted = self.state.step, reduced.counted
        if self.cfg.policy is RecoveryPolicy.DROP:
            bad = [j for j, c in enumerate(counted) if c > 1]
            if bad or sum(counted) < 1:
                raise InvariantViolation(
                    f"step {step}: microbatch counts {counted} (members {list(self.group.members)}, epoch "
                    f"{self.group.epoch}): under drop each id is counted at most once and one at least"
                )
        else:
            bad = [j for j, c in enumerate(counted) if c != 1]
            if bad:
                raise InvariantViolation(
                    f"step {step}: microbatch ids {bad} were counted {[counted[j] for j in bad]} times "
                    f"(members {list(self.group.members)}, epoch {self.group.epoch}); each must be counted "
                    "exactly once"
                )
        if reduced.members != self.group.size or reduced.epoch_sum != self.group.epoch * self.group.size:
            raise InvariantViolation(
                f"step {step}: the members disagree on the epoch: {reduced.members} contributions summing to "
                f"epoch {reduced.epoch_sum}, expected {self.group.size} of epoch {self.group.epoch}"
            )

    @torch.no_grad()
    def normalise_attention(self, contributed: int, counted: int) -> None:
        """MeCeFO: attention parameters got gradients only from the exact microbatches; average over those
        (``contributed``) instead of over every counted one. With none, their gradient is zero this step."""
        eb = self.state.efficient
        assert eb is not None
        for p in eb.attention_parameters():
            if p.grad is None:
                continue
            if contributed > 0:
                p.grad.mul_(counted / contributed)
            else:
                p.grad.zero_()

    def commit(self, optimizer: torch.optim.Optimizer | None, clip_grad_norm: float, seconds: float) -> StepOutcome:
        """The step's explicit end: the optimizer steps (the gradient is finite and every invariant held) or
        the step is skipped on every member alike; then the step advances, and the checkpoint if one is due."""
        assert self.reduced is not None and self.group is not None
        step, reduced = self.state.step, self.reduced
        counted = sum(reduced.counted)
        loss = sum(reduced.loss[j] for j in range(self.M) if reduced.counted[j] > 0) / max(1, counted)
        lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None and optimizer.param_groups else math.nan
        common = {
            "recomputed": self.plan.recomputed,
            "dropped": self.M - counted,
            "recoveries": self.plan.recoveries,
            "efficient": sum(reduced.efficient),
            "overflow_redos": self.plan.redos,
        }
        self.state.speeds = {w: s for w, s in reduced.seconds.items() if w in self.members.units()}
        self.switch_epoch = reduced.newest_epoch
        if self._nonfinite:
            outcome = self._skip(step, reduced, loss, lr, common)
        else:
            self.injector.inject(Phase.OPTIMIZER)
            grad_norm = self._clip(clip_grad_norm)
            if self.state.efficient is not None:
                self.state.efficient.wait()  # the bases have read the weights (torch optimizers also do this)
            if optimizer is not None:
                optimizer.step()
            if self.state.scale is not None:
                self.state.scale.track(peaks(self._local_grads(), self.index, self.numels, self.members.combine_max))
            self.state.nonfinite_streak = 0
            outcome = StepOutcome(loss, grad_norm, lr, **common)
        self.state.last = outcome
        self.state.step = step + 1
        self.last_counts = reduced.counted
        self.last_tokens = sum(t for j, t in enumerate(reduced.tokens) if reduced.counted[j] > 0)
        self.publish(RecordKind.STEP, **self._step_fields(step, outcome, seconds))
        self.begin_step()
        return outcome

    def _local_grads(self) -> list[torch.Tensor]:
        """This rank's part of every gradient (an empty tensor for a parameter without one)."""
        empty = torch.zeros(0)
        return [empty if p.grad is None else local_tensor(p.grad) for p in self.params]

    def _clip(self, max_norm: float) -> float:
        """The gradient's global norm, clipped to ``max_norm`` (0: not clipped). Exact mode: the same bits
        however the model is split (``gradnorm.exact_clip``); fp32: torch's for a whole model."""
        if self.exact:
            return exact_clip(
                self._local_grads(),
                self.index,
                self.numels,
                max_norm,
                self.members.combine_max,
                self.members.combine_sum,
            )
        if self.replica is not None:
            return float_clip(self._local_grads(), max_norm, self.members.combine_sum)
        if max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True))
        return float(torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None], foreach=True))

    def _skip(self, step: int, reduced: Reduced, loss: float, lr: float, common: dict[str, int]) -> StepOutcome:
        found = reduced if self.exact else self._diagnosis
        assert found is not None
        ids = [j for j, n in enumerate(found.nonfinite) if n]
        workers = sorted(found.bad_param)
        param = self.all_names[min(found.bad_param.values())] if found.bad_param else "?"
        what = (
            f"step {step}: non-finite gradient in microbatch{'es' if len(ids) != 1 else ''} "
            f"{', '.join(map(str, ids)) or '?'} (worker{'s' if len(workers) != 1 else ''} "
            f"{', '.join(map(str, workers)) or '?'}), first in parameter {param}"
        )
        if self.cfg.nonfinite is NonfinitePolicy.STOP:
            raise StopRun(
                f"{what}; stopped (train.nonfinite = stop); {self._last_checkpoint_words()}",
                fatal=True,
                code=EXIT_NONFINITE,
                shared=True,
            )
        self.state.nonfinite_streak += 1
        self.publish(
            RecordKind.NONFINITE_SKIP,
            step=step,
            microbatches=ids,
            workers=workers,
            parameter=param,
            streak=self.state.nonfinite_streak,
        )
        log.warning("%s; skipping the step on every member (%d in a row)", what, self.state.nonfinite_streak)
        if self.state.nonfinite_streak >= self.cfg.max_nonfinite_skips:
            raise StopRun(
                f"{what}; {self.state.nonfinite_streak} consecutive steps skipped for non-finite gradients "
                f"(train.max_nonfinite_skips = {self.cfg.max_nonfinite_skips}); {self._last_checkpoint_words()}",
                fatal=True,
                code=EXIT_NONFINITE,
                shared=True,
            )
        return StepOutcome(loss, math.nan, lr, skipped=True, **common)

    def _last_checkpoint_words(self) -> str:
        return ckptfiles.last_checkpoint_words(self.run_dir)

    def _step_fields(self, step: int, outcome: StepOutcome, seconds: float, fresh: bool = True) -> dict[str, Any]:
        """The step record's fields; ``fresh``: this worker took part in the step's reduction (a republished
        record has no counts, tokens or timing of its own)."""
        assert self.group is not None
        fields: dict[str, Any] = {
            "step": step,
            "loss": outcome.loss,
            "lr": outcome.lr,
            "grad_norm": outcome.grad_norm,
            "step_time_s": seconds,
            "tokens": self.last_tokens if fresh else 0,
            "tokens_per_s": self.last_tokens / seconds if fresh and seconds > 0 else math.nan,
            "alive": self.group.size,
            "epoch": self.group.epoch,
            "microbatches": self.M,
            "committed": not outcome.skipped,
            "skipped": outcome.skipped,
            "recomputed": outcome.recomputed,
            "dropped": outcome.dropped,
            "recoveries": outcome.recoveries,
            "efficient": outcome.efficient,
            "overflow_redos": outcome.overflow_redos,
        }
        if fresh:
            workers = self.group.size * self.layout.size
            gpus = gpus_in_use(workers, self.cfg.workers_per_gpu) if self.device.type == "cuda" else 0
            fields |= step_throughput(self.last_tokens, seconds, workers, gpus, self.flops_per_token, self.peak_tflops)
            fields["counted"] = int(sum(self.last_counts))
            fields["counted_once"] = all(c == 1 for c in self.last_counts)
            fields["quotas"] = {str(w): n for w, n in self.plan.quotas.items()}
            # each member's seconds per microbatch, agreed in this step's reduction (the status view's speeds)
            fields["speeds"] = {str(w): s for w, s in self.state.speeds.items()}
        return fields

    # -- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint_if_due(self) -> None:
        self.checkpoints.save_if_due()

    def write_checkpoint(self) -> None:
        self.checkpoints.write()

    # -- recovery -----------------------------------------------------------------------------------
    def recover(self) -> list[int]:
        """Join the next membership epoch: form its group, agree on the step and state (whoever is behind
        receives it), find the current step's microbatches that no member holds, and return this worker's
        share of them (none under ``drop`` when a member died). Every member runs exactly this sequence of
        collectives after every membership change (start, failure, join), wherever it was, so the collectives
        always match."""
        old_members = self.group.members if self.group is not None else ()
        self.members.recovering = True
        try:
            return self._recover(old_members)
        finally:
            self.members.recovering = False

    def _recover(self, old_members: tuple[int, ...]) -> list[int]:
        while True:
            t0 = time.monotonic()
            old_epoch = self.group.epoch if self.group is not None else 0
            try:
                if self.cfg.policy is RecoveryPolicy.RESTART and self.group is not None:
                    reason = "membership changed; the restart policy restarts from the last checkpoint"
                    raise StopRun(reason, fatal=False)
                self.members.form_next_group()
                assert self.group is not None
                # Formed ahead (GroupFormer), the group may be older than this recovery.
                formed = max(t0, time.monotonic() - max(0.0, time.time() - self.group.formed_at))
                if self.resume_pending:
                    self.resume_pending = False
                    if self.leader:
                        self.checkpoints.load()
                        self.begin_step()
                was_behind = self.members.sync_state()
                if was_behind:
                    self.begin_step()
                held = torch.zeros(self.M, dtype=torch.float64)
                held[self.plan.done] = 1.0
                self.members.wait([allreduce_async(self.group, held)])
            except Interrupted:
                continue  # another change while recovering: go again from the newest epoch (the handler ends here)
            assert self.group is not None
            if was_behind or (old_members and old_members[0] not in self.group.members):
                self.republish_last_step()
            self.checkpoints.ensure()
            counts = [int(c) for c in held.tolist()]
            if any(c > 1 for c in counts):
                raise InvariantViolation(
                    f"step {self.state.step}: after re-forming epoch {self.group.epoch}, microbatch ids "
                    f"{[j for j, c in enumerate(counts) if c > 1]} are held by more than one member"
                )
            missing = [j for j, c in enumerate(counts) if c == 0]
            if old_epoch > 0:
                self.publish(
                    RecordKind.RECOVERY,
                    step=self.state.step,
                    from_epoch=old_epoch,
                    epoch=self.group.epoch,
                    alive=self.group.size,
                    reform_s=formed - t0,
                    missing=missing,
                    time_reformed=self.group.formed_at,
                    time_recovered=time.time(),
                    state_bytes=self.members.state_bytes,
                )
            died = not set(old_members) <= set(self.group.members)
            lost_mid_step = old_epoch > 0 and died and len(missing) < self.M
            if lost_mid_step and self.cfg.policy is RecoveryPolicy.DROP:
                # Someone died mid-step: their microbatches are lost; a live member that had not computed its
                # own yet (it met the death before starting the step) still does. (A join alone loses nothing,
                # and a step nobody had started yet is planned as usual.)
                return [j for j in missing if self.plan.step_owners.get(j) == self.unit]
            if lost_mid_step:
                # The step's ids computed again because a member died (the same count on every member: the step's
                # record says it whichever member publishes it).
                self.plan.recomputed += len(missing)
            plan = self.plan.make(self.members.units(), missing)
            if len(missing) == self.M:
                self.plan.adopt(plan, self.group.epoch)
            return list(plan.ids_for(self.unit))

    def join(self, resume: bool, late: bool) -> None:
        """The first recovery of this worker: form the first group (or join a running one), agree on the state
        (``resume``: the leader loads the newest checkpoint; ``late``: this worker receives it)."""
        self.resume_pending = resume and not late
        if late:
            self.state.step = -1  # behind everyone: it receives the state from a live peer
        self.begin_step()
        self.pending_todo = self.recover()
        assert self.group is not None
        log.info(
            "member of epoch %d as rank %d of %d at step %d",
            self.group.epoch,
            self.group.rank,
            self.group.size,
            self.state.step,
        )

    def allreduce_interruptible(self, tensor: torch.Tensor) -> bool:
        """SUM-reduce ``tensor`` over the group; False (and this worker has recovered, keeping its share of the
        next step for when it starts) if a failure interrupted it."""
        assert self.group is not None
        try:
            self.members.wait([allreduce_async(self.group, tensor)])
            return True
        except Interrupted:
            pass
        self.pending_todo = self.recover()
        return False

    def finish(self) -> None:
        """The end of the run: every member's parameter checksum, exchanged in one reduction (the store may
        have been replaced by a restarted coordinator); the leader then checks that the final checkpoint is
        on disk and whole (writing it if its writer died), records the checksums and marks the run done, so a
        run that says "done" has its final state saved."""
        while True:
            assert self.group is not None
            digests = torch.zeros(self.group.size, 32, dtype=torch.float64)
            digests[self.group.rank] = torch.tensor(list(bytes.fromhex(self.state.checksum())), dtype=torch.float64)
            if self.allreduce_interruptible(digests):
                break
        assert self.group is not None
        if self.leader:
            self.checkpoints.ensure()
            checksums = {
                str(w): bytes(int(x) for x in digests[rank].tolist()).hex() for rank, w in enumerate(self.group.members)
            }
            # Replicas of several ranks: every rank index's checksums (equal across replicas, not across indices).
            parts = self.replica.gather(checksums) if self.replica is not None else [checksums]
            identical = all(len(set(part.values())) == 1 for part in parts)
            if not self.publisher:
                return
            ckpt.clean_partial(self.run_dir)
            step = self.state.step
            sharded = self.replica is not None
            self.publish(
                RecordKind.FINAL,
                step=step,
                checksums={w: digest for part in parts for w, digest in part.items()},
                identical=identical,
                checkpoint=str(
                    ckpt.sharded_path(self.run_dir, step) if sharded else ckpt.checkpoint_path(self.run_dir, step)
                ),
            )
            self.client.flush_metrics()  # the coordinator drains the records once more on "done", then ends
            self.client.mark_done()
