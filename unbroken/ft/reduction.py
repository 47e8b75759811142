"""A step's reduction and its outcome: the gradient and the side vector reduced over the group, then judged.

Owns the gradient reducer (``comm.GradientReducer``: buckets, the exact mode's fold) and the side vector's
layout, this rank's tensors among the model's (``ModelTensors``), and what the step's reduction gave: the
reduced side vector, whether the gradient is finite (fp32: with the diagnosis of who and where when it is
not), the checks that guard the training state (each id counted once, the members on one epoch), the data
check's verdict, the growth of the exact mode's scale after a fixed-point overflow, and the reduced gradient
applied to ``param.grad`` (MeCeFO's attention normalisation included). It raises ``Interrupted`` when the
membership changes under a collective; recovering from that, and committing, are the caller's. It is built
from the step's ``StepContext`` and calls its fault hook inside the reduction (``reduction`` phase, ``stall``,
``dup``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from unbroken.core.config import RecoveryPolicy, Reduction
from unbroken.core.failures import Phase
from unbroken.core.layout import ReplicaLayout
from unbroken.core.records import RecordKind
from unbroken.ft import datacheck
from unbroken.ft.comm import GradientReducer, WaitStatus, allreduce_async, split_over_tensor_ranks
from unbroken.ft.exact import FixedPointScale
from unbroken.ft.foldkernel import extremes
from unbroken.ft.membership import Membership
from unbroken.ft.sidevec import Reduced, SideVector
from unbroken.ft.stepcontext import StepContext
from unbroken.ft.stepplan import StepPlan
from unbroken.ft.stops import Interrupted, InvariantViolation

if TYPE_CHECKING:
    from unbroken.ft.parallel.replica import Replica
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelTensors:
    """This rank's parameters (``params``) and where they sit among the whole model's tensors (a pipeline
    stage holds some of them): their positions (``index``), and every tensor's size and name in the model's
    order (``numels``, ``names``). ``counted[i]``: whether this rank's part of ``params[i]`` counts in a sum over
    the replica (a part every tensor rank holds the same, unsplit by tensor parallelism, counts on the first)."""

    params: list[torch.nn.Parameter]
    index: list[int]
    numels: list[int]
    names: list[str]
    counted: list[bool]

    @staticmethod
    def of(model: torch.nn.Module, replica: Replica | None, layout: ReplicaLayout) -> ModelTensors:
        """The table for ``model``; a pipeline stage gathers its stages' names and sizes (a collective inside
        the replica)."""
        params = list(model.parameters())
        names = [n for n, _ in model.named_parameters()]
        n = len(params)
        first = replica is None or replica.tensor == 0
        counted = [first or split_over_tensor_ranks(p) for p in params]
        mine = [(name, p.numel()) for name, p in zip(names, params, strict=True)]
        if replica is None or layout.pipeline == 1:
            return ModelTensors(params, list(range(n)), [numel for _, numel in mine], list(names), counted)
        # in stage order (the model's order); a stage's tensor ranks hold the same tensors: take the first's
        stages = replica.gather(mine)[:: layout.shard * layout.tensor]
        start = sum(len(stages[r]) for r in range(replica.stage))
        every = [entry for stage in stages for entry in stage]
        return ModelTensors(
            params, list(range(start, start + n)), [numel for _, numel in every], [name for name, _ in every], counted
        )


class StepReduction:
    """The current step's reduction. Call order: ``begin`` at each step's start; ``arm``, ``before_backward``
    and ``after_backward`` around the microbatches; ``reduce``, ``check_invariants``, then either
    ``grow_scale`` (``overflowed``) or ``nonfinite_found`` and ``accept``."""

    def __init__(self, ctx: StepContext, membership: Membership, plan: StepPlan) -> None:
        model = ctx.state.model
        assert model is not None
        self.cfg = cfg = ctx.cfg
        self.M = cfg.microbatches
        self.membership = membership
        self.plan = plan
        self.state = ctx.state
        self.hook = ctx.hook
        self.replica = ctx.replica
        self.tensors = ModelTensors.of(model, ctx.replica, ctx.layout)
        self.exact = cfg.reduction is Reduction.EXACT
        if self.exact:
            self.state.scale = FixedPointScale(len(self.tensors.numels), self.M)
        self.side = SideVector(self.M)
        buckets = None
        if self.replica is not None:
            from unbroken.ft.parallel.fsdp import fsdp_buckets

            buckets = fsdp_buckets(model, self.tensors.params)
        self.reducer = GradientReducer(
            self.tensors.params,
            cfg.bucket_bytes,
            self.side.size,
            exact=self.exact,
            first_bucket_bytes=cfg.first_bucket_bytes,
            buckets=buckets,
        )
        if buckets is not None:
            from unbroken.ft.parallel.fsdp import prepare_fsdp

            prepare_fsdp(model, self.reducer)
        # the step's outcome
        self.reduced: Reduced | None = None
        self.nonfinite = False
        self.diagnosis: Reduced | None = None  # fp32, a non-finite gradient: every member's flags, reduced
        self._any_nonfinite = False  # a replica of several ranks, fp32: some rank's reduced shard is not finite

    def begin(self) -> None:
        """Empty accumulators for the current step (exact mode: at the current scale)."""
        self.reducer.reset_local()
        if self.state.scale is not None:
            exponents = self.state.scale.exponents()
            self.reducer.set_exponents([exponents[i] for i in self.tensors.index], self.state.scale.limit)

    # -- around the microbatches --------------------------------------------------------------------
    def arm(self, microbatch: int) -> None:
        """Overlap the reduction with the last local backward of the step (under FSDP: of its last round, each
        unit's bucket starting once FSDP has reduce-scattered it)."""
        group = self.membership.group
        assert group is not None
        self.reducer.arm(group, microbatch)

    def before_backward(self, microbatch: int, padding: bool = False) -> None:
        """The backward of ``microbatch`` comes next (``padding``: a rank of a replica with nothing left in a
        round, whose gradient must count for nothing)."""
        self.reducer.current = microbatch
        self.reducer.padding = padding

    def after_backward(self, microbatch: int) -> None:
        """Microbatch ``microbatch``'s gradient is in the accumulator (exact mode: fold it, unless it is the
        armed one, which the launch of the reduction folds)."""
        if self.exact and self.reducer.armed != microbatch:
            self.reducer.fold(microbatch)

    # -- the reduction ------------------------------------------------------------------------------
    def reduce(self) -> Reduced:
        """Reduce the local contribution and the side vector over the group; raises Interrupted."""
        group = self.membership.group
        assert group is not None
        # Every gradient first: launching them finishes the exact fold of the last microbatch, whose flags
        # (non-finite, overflow) the side vector carries.
        self.reducer.launch_gradients(group)
        flags = self.reducer.flags
        done = self.hook.reported(list(self.plan.done), self.state.step)  # ``dup``: one id reported twice
        # A replica's ranks each add the losses of the microbatches they computed and what their own fold saw
        # (its tensor ranks compute the same microbatches: the first of them adds their losses); its first rank
        # alone counts its ids and speaks for it (one member of the group).
        first = self.replica is None or self.replica.rank == 0
        computes = self.replica is None or self.replica.tensor == 0
        index = self.tensors.index
        extras = self.side.encode(
            worker=self.membership.unit,
            losses=self.plan.loss_values() if computes else {},
            tokens=self.plan.local_tokens if computes else {},
            done=done if first else [],
            efficient=self.plan.done_efficient if computes else [],
            nonfinite=flags.nonfinite_ids,
            overflow=flags.overflow,
            seconds=self.plan.my_speed if first else 0.0,
            bad_param=index[flags.first_bad_param] if flags.first_bad_param is not None else None,
            bad_worker=self.membership.wid,
            epoch=group.epoch if first else 0,
            newest_epoch=self.membership.client.latest_epoch if self.membership.leader and first else 0,
            member=first,
            probe=(self.plan.probe_fps[0], self.plan.probe_fps[1]) if computes else (0.0, 0.0),
        )
        # Killed here, a worker has sent its gradients but not its counts, so the reduction cannot complete
        # without it: a kill "in the reduction" always interrupts one (sent after the extras, it could land
        # after the survivors had already finished and committed the step).
        self.hook.at(Phase.REDUCTION)
        self.hook.stall(self.state.step)
        self.reducer.launch_extras(extras)
        status, reduced = self.reducer.wait(self.cfg.op_timeout_s, self.membership.interrupted)
        if status is WaitStatus.TIMED_OUT:
            self.membership.report_timeout()
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

    def check_invariants(self, reduced: Reduced) -> None:
        """The checks that guard the training state (explicit: they hold under ``python -O`` too)."""
        group = self.membership.group
        assert group is not None
        step, counted = self.state.step, reduced.counted
        if self.cfg.policy is RecoveryPolicy.DROP:
            bad = [j for j, c in enumerate(counted) if c > 1]
            if bad or sum(counted) < 1:
                raise InvariantViolation(
                    f"step {step}: microbatch counts {counted} (members {list(group.members)}, epoch "
                    f"{group.epoch}): under drop each id is counted at most once and one at least"
                )
        else:
            bad = [j for j, c in enumerate(counted) if c != 1]
            if bad:
                raise InvariantViolation(
                    f"step {step}: microbatch ids {bad} were counted {[counted[j] for j in bad]} times "
                    f"(members {list(group.members)}, epoch {group.epoch}); each must be counted "
                    "exactly once"
                )
        if reduced.members != group.size or reduced.epoch_sum != group.epoch * group.size:
            raise InvariantViolation(
                f"step {step}: the members disagree on the epoch: {reduced.members} contributions summing to "
                f"epoch {reduced.epoch_sum}, expected {group.size} of epoch {group.epoch}"
            )

    # -- a fixed-point overflow ---------------------------------------------------------------------
    def overflowed(self, reduced: Reduced) -> bool:
        """Exact mode: some microbatch's finite gradient did not fit the fixed point (the step is redone)."""
        return self.exact and reduced.overflow > 0 and not any(reduced.nonfinite)

    def grow_scale(self) -> None:
        """Some microbatch did not fit the fixed point: agree on the largest value each tensor saw over all M
        microbatches (MAX-reduced), grow the bounds above it (the caller redoes the step)."""
        group = self.membership.group
        assert group is not None and self.state.scale is not None
        observed = torch.zeros(len(self.tensors.numels), dtype=torch.float64)
        observed[self.tensors.index] = torch.tensor(self.reducer.observed, dtype=torch.float64)
        pending = allreduce_async(group, observed, max_op=True)
        self.membership.wait([pending])
        self.membership.combine_max(observed)  # a pipeline stage saw its own tensors only
        grown = self.state.scale.grow(observed.tolist())
        log.warning(
            "step %d: fixed-point overflow in %d tensors (first: %s); redoing the step with larger bounds",
            self.state.step,
            len(grown),
            self.tensors.names[grown[0]] if grown else "-",
        )

    # -- a non-finite gradient ----------------------------------------------------------------------
    def nonfinite_found(self, reduced: Reduced) -> bool:
        """Whether the step's gradient holds a NaN or an infinity (exact mode: a flag of the side vector)."""
        return any(reduced.nonfinite) if self.exact else self._reduced_nonfinite(reduced)

    def _reduced_nonfinite(self, reduced: Reduced) -> bool:
        """fp32 mode: whether the reduced gradient (the same bits on every member) holds a NaN or an infinity;
        if so, find out from every member's local gradient who and what (one more small reduction)."""
        # A replica's ranks each reduced their own shard: they told each other with the side vector's reduction.
        found = self._any_nonfinite if self.replica is not None else self._shard_not_finite()
        if not found:
            return False
        group = self.membership.group
        assert group is not None
        self.reducer.check_nonfinite(list(self.plan.local_losses))
        flags = self.reducer.flags
        first = self.replica is None or self.replica.rank == 0
        index = self.tensors.index
        diagnosis = self.side.encode(
            worker=self.membership.unit,
            losses={},
            tokens={},
            done=[],
            efficient=[],
            nonfinite=flags.nonfinite_ids,
            overflow=0,
            seconds=0.0,
            bad_param=index[flags.first_bad_param] if flags.first_bad_param is not None else None,
            bad_worker=self.membership.wid,
            epoch=group.epoch if first else 0,
            member=first,
        )
        self.membership.combine_sum(diagnosis)
        self.membership.wait([allreduce_async(group, diagnosis)])
        self.diagnosis = self.side.decode(diagnosis)
        return True

    def culprits(self) -> Reduced | None:
        """Where the step's non-finite values were found: the ids and each worker's first parameter (exact
        mode: in the step's side vector; fp32: in the diagnosis)."""
        return self.reduced if self.exact else self.diagnosis

    # -- the outcome --------------------------------------------------------------------------------
    def accept(self, reduced: Reduced, nonfinite: bool) -> None:
        """The step's reduction completed and its checks held: keep its outcome, run the data check, and
        unless the gradient is not finite put the reduced gradient, averaged over the counted ids, in
        ``param.grad``."""
        self.reduced = reduced
        self.nonfinite = nonfinite
        self._check_data(reduced)
        if not nonfinite:
            counted = sum(reduced.counted)
            self.reducer.apply(scale=self.M / counted if counted != self.M else 1.0)
            if sum(reduced.efficient):
                self.normalise_attention(counted - sum(reduced.efficient), counted)

    def _check_data(self, reduced: Reduced) -> None:
        """The data check: the probed microbatch's inputs on its computer and on the prober must agree (every
        member sees the same sums; each warns in its log, the leader publishes the record)."""
        probe = self.plan.probe
        line = datacheck.mismatch(self.state.step, probe, *reduced.probe) if probe is not None else None
        if probe is None or line is None:
            return
        log.warning("%s", line)
        workers = [probe.owner, probe.prober]
        self.membership.publish(
            RecordKind.IMPURE_DATA, step=self.state.step, microbatch=probe.microbatch, workers=workers, reason=line
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
