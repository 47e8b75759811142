"""The step protocol of one worker: plan, compute, reduce, recover, commit (docs/library.md has the diagram).

Owns the sequence of collectives every member runs for a step, and what happens when the membership
changes in the middle of it: the group is abandoned, the next epoch's group is formed, whoever is behind
receives the state, the microbatch ids that no live member holds are planned again over the survivors, and
the reduction is issued again from each survivor's intact local contribution. A step ends in an explicit
commit: only when the reduced counts show each of the M ids exactly once (``drop``: at most once), the
members agree on the epoch, and the gradient is finite; otherwise the step is redone (fixed-point overflow),
skipped on every member alike (a non-finite gradient) or the run stops cleanly (a broken invariant).

``StepProtocol`` is that sequence (start, reduce, recover, commit); each part is a collaborator that owns its
state and can be read alone, and every one is built from the same ``stepcontext.StepContext`` (the settings,
the client, the training state, the run directory, the fault hook, the device, the replica): ``membership``
(the group, the waits on its collectives, the next epoch's group, the state transfer, the records),
``stepplan`` (the step's plan and this worker's accounting), ``reduction`` (the reduced gradient and side
vector, and the checks on them), ``update`` (the optimizer step or the skip, the step record) and
``checkpoint.policy`` (checkpoints). Callers reach a part directly (``proto.plan``, ``proto.membership``);
the settings and the ways a worker stops are ``stops``'s (imported here too). It knows nothing of the
user's model, data or loop, which drive it through ``step.Step``. It is an object, not a process: unit tests
drive several of them from threads of one process on real gloo groups.

With replicas of several ranks (``replica``: FSDP shards or pipeline stages, docs/parallel.md) the member
that plans, counts and commits is the replica; each rank runs the protocol on the group of its rank index
across the live replicas (its shard of the gradient and of the state), and the ranks of a replica agree on
every decision one of them could take differently (``Replica.agree``), so a replica commits, recovers or
leaves as one: every wait on a collective ends in such an agreement.
"""

from __future__ import annotations

import logging
import time

import torch

from unbroken.core.config import RecoveryPolicy, Workload
from unbroken.core.failures import Phase
from unbroken.core.records import RecordKind
from unbroken.ft.checkpoint import schema as ckpt
from unbroken.ft.checkpoint.policy import Checkpoints
from unbroken.ft.comm import allreduce_async
from unbroken.ft.membership import Membership
from unbroken.ft.reduction import StepReduction
from unbroken.ft.state import StepOutcome
from unbroken.ft.stepcontext import StepContext
from unbroken.ft.stepplan import StepPlan
from unbroken.ft.stops import (
    EXIT_COORDINATOR_LOST,
    EXIT_INVARIANT,
    EXIT_NONFINITE,
    EXIT_STOPPED,
    Interrupted,
    InvariantViolation,
    ProtocolConfig,
    StopRun,
)
from unbroken.ft.update import StepCommit

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
    """One worker's side of the protocol: ``join`` once, then per step ``start_step`` -> the microbatches ->
    ``reduce_step`` (again with the ids it returns until it returns None) -> ``commit``; ``recover`` whenever
    the membership changes, ``finish`` after the last step. Around each microbatch the caller (``step.Step``)
    drives the parts directly: ``reduction.arm`` before the last one, ``reduction.before_backward``, the
    backward, ``reduction.after_backward`` and ``plan.after_backward``; the records go through ``membership``
    and the checkpoints through ``checkpoints``."""

    def __init__(self, ctx: StepContext) -> None:
        assert ctx.state.model is not None
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.M = ctx.cfg.microbatches
        self.state = ctx.state
        self.membership = Membership(ctx)
        self.plan = StepPlan(ctx)
        self.reduction = StepReduction(ctx, self.membership, self.plan)
        self.committer = StepCommit(ctx, self.membership, self.plan, self.reduction.tensors)
        self.checkpoints = Checkpoints(ctx, self.membership)
        ctx.client.on_epoch = self.membership.epoch_published
        self.resume_pending = False  # --resume: the leader loads the newest checkpoint in its first recovery
        self.pending_todo: list[int] | None = None  # this worker's share of a step, planned while it recovered
        # The evaluation after a step that the group recovered in from a failure is skipped on every member: they
        # may have recovered at different points (one in the step's reduction, another in the evaluation before it,
        # or one in a step's reduction and the other, which committed that step, in the next one's), and only
        # skipping it on every one keeps their collectives matched (``skips_evaluation``). ``failure_in_step``: this
        # worker recovered from a failure in the current loop iteration (at the step's start or in its reduction);
        # ``failed_step``: the step that the group last agreed one of its members recovered in from a failure (the
        # same on every member of the group; a worker that received the state recovered in the step before).
        self.failure_in_step = False
        self.failed_step = -1

    # -- the step -----------------------------------------------------------------------------------
    def _begin_step(self) -> None:
        """Fresh local state for the current step: no microbatch done, empty accumulators."""
        self.plan.begin()
        self.reduction.begin()

    def start_step(self) -> list[int]:
        """The ids this worker computes first in the current step (after any recovery due now)."""
        group = self.membership.group
        assert group is not None
        self.plan.reset_counts()
        self.reduction.reduced = None
        self.failure_in_step = False
        if self.pending_todo is not None:
            todo, self.pending_todo = self.pending_todo, None
            return todo
        # A join agreed in the last reduction (the same value on every rank), or a death between steps. The ranks of
        # a replica may see a death at different moments, so they do not act on it here: they start the step, and
        # its reduction (interrupted on every rank index) recovers. Nor does MeCeFO: a death seen now would run this
        # worker's own microbatches in efficient mode, one seen in the reduction exactly, so the step would depend on
        # when the death was seen; deferred, its own are always exact and only the orphans efficient.
        removed = (
            self.ctx.replica is None
            and not self.cfg.policy.mecefo
            and self.ctx.client.removed_since(group.epoch, group.members)
        )
        if removed or self.committer.switch_epoch > group.epoch:
            # A death between steps, or a join the group agreed on in the last reduction.
            self.plan.recoveries += 1
            self.failure_in_step = removed
            if self.cfg.policy is RecoveryPolicy.DROP:
                # The others may have started this step with the group's plan: under drop only the dead members'
                # share is lost, so this worker still owes its own.
                self.plan.note_owners(self.plan.make(self.membership.units()))
            return self.recover(in_step=removed)
        self.ctx.hook.at(Phase.START)
        plan = self.plan.make(self.membership.units())
        self.plan.adopt(plan, group.epoch)
        return list(plan.ids_for(self.membership.unit))

    def reduce_step(self) -> list[int] | None:
        """After this worker's microbatches: reduce. None when the step's gradient is reduced (and, unless it
        is not finite, in ``param.grad``); else the ids to compute next (after a recovery, or all of this
        worker's again after a fixed-point overflow)."""
        reduction = self.reduction
        try:
            reduced = reduction.reduce()
            reduction.check_invariants(reduced)
            if reduction.overflowed(reduced):
                return self._redo_step()
            nonfinite = reduction.nonfinite_found(reduced)
        except Interrupted:
            # Recover outside the handler: the exception's traceback holds the abandoned collectives, which
            # keep the old group's connections open, so peers still waiting on them would hang.
            pass
        else:
            reduction.accept(reduced, nonfinite)
            return None
        todo = self.recover(in_step=True)
        self.plan.recoveries += 1
        self.failure_in_step = True
        return todo

    def _redo_step(self) -> list[int]:
        """A fixed-point overflow: grow the scale (agreed over the group), then compute the step again."""
        self.reduction.grow_scale()
        self.plan.redos += 1
        self._begin_step()
        plan = self.plan.make(self.membership.units())
        self.plan.note_owners(plan)
        return list(plan.ids_for(self.membership.unit))

    def commit(self, optimizer: torch.optim.Optimizer | None, clip_grad_norm: float, seconds: float) -> StepOutcome:
        """The step's explicit end: the optimizer steps (the gradient is finite and every invariant held) or
        the step is skipped on every member alike; then the step advances (the caller saves the checkpoint if
        one is due, ``checkpoints.save_if_due``)."""
        outcome = self.committer.commit(self.reduction, optimizer, clip_grad_norm, seconds)
        self._begin_step()
        return outcome

    # -- recovery -----------------------------------------------------------------------------------
    def recover(self, in_step: bool) -> list[int]:
        """Join the next membership epoch: form its group, agree on the step and state (whoever is behind
        receives it), find the current step's microbatches that no member holds, and return this worker's
        share of them (none under ``drop`` when a member died). Every member runs exactly this sequence of
        collectives after every membership change (start, failure, join), wherever it was, so the collectives
        always match. ``in_step``: a failure in the current step brought this worker here (a death seen at its
        start, its reduction interrupted), not a join or one between steps; the group agrees whether one of its
        members came from inside the step it recovers in (``failed_step``)."""
        group = self.membership.group
        old_members = group.members if group is not None else ()
        self.membership.recovering = True
        try:
            return self._recover(old_members, in_step)
        finally:
            self.membership.recovering = False

    @property
    def skips_evaluation(self) -> bool:
        """Whether the evaluation after the last committed step is skipped, on every member alike: this worker
        recovered from a failure while running the step's loop iteration, or its group agreed that it recovered
        from one in that step."""
        return self.failure_in_step or self.failed_step == self.state.step - 1

    def _recover(self, old_members: tuple[int, ...], in_step: bool) -> list[int]:
        membership = self.membership
        entered_at = self.state.step
        # The recovery record goes from the group this worker had when the change came, and its time from then,
        # not from a group formed since and left at once for a newer epoch (a warm spare admitted while the
        # survivors re-formed without its worker: one recovery, from the epoch the failure interrupted to the
        # one with the spare).
        entry_epoch = membership.group.epoch if membership.group is not None else 0
        entered = time.monotonic()
        while True:
            t0 = entered if entry_epoch else time.monotonic()
            old_epoch = entry_epoch or (membership.group.epoch if membership.group is not None else 0)
            try:
                if self.cfg.policy is RecoveryPolicy.RESTART and membership.group is not None:
                    reason = "membership changed; the restart policy restarts from the last checkpoint"
                    raise StopRun(reason, fatal=False)
                membership.form_next_group()
                group = membership.group
                assert group is not None
                self.plan.workload = Workload(membership.workload) if membership.workload else self.cfg.workload
                # Formed ahead (GroupFormer), the group may be older than this recovery.
                formed = max(t0, time.monotonic() - max(0.0, time.time() - group.formed_at))
                if self.resume_pending:
                    self.resume_pending = False
                    if membership.leader:
                        self.checkpoints.load()
                        self._begin_step()
                was_behind = membership.sync_state()
                if was_behind:
                    self._begin_step()
                # Each id this worker holds for the current step, and whether a failure in this step brought it here
                # (one in a step the others have committed since, whose state it received, was in an earlier step).
                held = torch.zeros(self.M + 1, dtype=torch.float64)
                held[self.plan.done] = 1.0
                held[self.M] = 1.0 if in_step and self.state.step == entered_at else 0.0
                membership.wait([allreduce_async(group, held)])
            except Interrupted:
                continue  # another change while recovering: go again from the newest epoch (the handler ends here)
            if was_behind or (old_members and old_members[0] not in group.members):
                self.committer.republish_last_step()
            self.checkpoints.ensure()
            counts = [int(c) for c in held[: self.M].tolist()]
            if held[self.M] > 0:
                self.failed_step = self.state.step
            if any(c > 1 for c in counts):
                raise InvariantViolation(
                    f"step {self.state.step}: after re-forming epoch {group.epoch}, microbatch ids "
                    f"{[j for j, c in enumerate(counts) if c > 1]} are held by more than one member"
                )
            missing = [j for j, c in enumerate(counts) if c == 0]
            if old_epoch > 0:
                membership.publish(
                    RecordKind.RECOVERY,
                    step=self.state.step,
                    from_epoch=old_epoch,
                    epoch=group.epoch,
                    alive=group.size,
                    reform_s=formed - t0,
                    missing=missing,
                    time_reformed=group.formed_at,
                    time_recovered=time.time(),
                    state_bytes=membership.state_bytes,
                )
            return self._replan(missing, lost=old_epoch > 0 and not set(old_members) <= set(group.members))

    def _replan(self, missing: list[int], lost: bool) -> list[int]:
        """This worker's share of the ``missing`` ids of the current step after a recovery (``lost``: a member
        of the old group died, not only joins)."""
        lost_mid_step = lost and len(missing) < self.M
        unit = self.membership.unit
        if lost_mid_step and self.cfg.policy is RecoveryPolicy.DROP:
            # Someone died mid-step: their microbatches are lost; a live member that had not computed its
            # own yet (it met the death before starting the step) still does. (A join alone loses nothing,
            # and a step nobody had started yet is planned as usual.)
            return [j for j in missing if self.plan.step_owners.get(j) == unit]
        if lost_mid_step:
            # The step's ids computed again because a member died (the same count on every member: the step's
            # record says it whichever member publishes it).
            self.plan.recomputed += len(missing)
        plan = self.plan.make(self.membership.units(), missing)
        if len(missing) == self.M:
            group = self.membership.group
            assert group is not None
            self.plan.adopt(plan, group.epoch)
        return list(plan.ids_for(unit))

    def join(self, resume: bool, late: bool) -> None:
        """The first recovery of this worker: form the first group (or join a running one), agree on the state
        (``resume``: the leader loads the newest checkpoint; ``late``: this worker receives it)."""
        self.resume_pending = resume and not late
        if late:
            self.state.step = -1  # behind everyone: it receives the state from a live peer
        self._begin_step()
        self.pending_todo = self.recover(in_step=False)
        group = self.membership.group
        assert group is not None
        log.info("member of epoch %d as rank %d of %d at step %d", group.epoch, group.rank, group.size, self.state.step)

    def allreduce_interruptible(self, tensor: torch.Tensor) -> bool:
        """SUM-reduce ``tensor`` over the group; False (and this worker has recovered, keeping its share of the
        next step for when it starts) if a failure interrupted it."""
        assert self.membership.group is not None
        try:
            self.membership.wait([allreduce_async(self.membership.group, tensor)])
            return True
        except Interrupted:
            pass
        self.pending_todo = self.recover(in_step=False)
        return False

    def finish(self) -> None:
        """The end of the run: every member's parameter checksum, exchanged in one reduction (the store may
        have been replaced by a restarted coordinator); the leader then checks that the final checkpoint is
        on disk and whole (writing it if its writer died), records the checksums and marks the run done, so a
        run that says "done" has its final state saved."""
        membership = self.membership
        while True:
            assert membership.group is not None
            digests = torch.zeros(membership.group.size, 32, dtype=torch.float64)
            checksum = bytes.fromhex(self.state.checksum())
            digests[membership.group.rank] = torch.tensor(list(checksum), dtype=torch.float64)
            if self.allreduce_interruptible(digests):
                break
        group = membership.group
        assert group is not None
        if not membership.leader:
            return
        self.checkpoints.ensure()
        checksums = {
            str(w): bytes(int(x) for x in digests[rank].tolist()).hex() for rank, w in enumerate(group.members)
        }
        # Replicas of several ranks: every rank index's checksums (equal across replicas, not across indices).
        replica, run_dir = self.ctx.replica, self.ctx.run_dir
        parts = replica.gather(checksums) if replica is not None else [checksums]
        identical = all(len(set(part.values())) == 1 for part in parts)
        if not membership.publisher:
            return
        ckpt.clean_partial(run_dir)
        step = self.state.step
        membership.publish(
            RecordKind.FINAL,
            step=step,
            checksums={w: digest for part in parts for w, digest in part.items()},
            identical=identical,
            checkpoint=str(
                ckpt.sharded_path(run_dir, step) if replica is not None else ckpt.checkpoint_path(run_dir, step)
            ),
        )
        self.ctx.client.flush_metrics()  # the coordinator drains the records once more on "done", then ends
        self.ctx.client.mark_done()
