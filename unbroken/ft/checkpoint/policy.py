"""The protocol's checkpoints: when one is due, who writes it, and loading the newest on ``--resume``.

Owns the decision (``checkpoint_due``: every ``checkpoint.every`` steps and at the end of the run), the
leader's write after a commit (sharded by the ranks of the leading replica, or one file), the new leader's
repair of a due checkpoint its writer left half-written, and the leader's load of the newest good one, each
with its record. The schema and the files are ``checkpoint``'s and ``core.ckptfiles``'s; it runs no
collective of the group (the ranks of a replica agree, and write a sharded checkpoint together). It is built
from the step's ``StepContext`` and calls its fault hook half-way through a write (``checkpoint`` phase).
"""

from __future__ import annotations

import logging
import time

from unbroken.core.failures import Phase
from unbroken.core.records import RecordKind
from unbroken.ft.checkpoint import schema as ckpt
from unbroken.ft.membership import Membership
from unbroken.ft.stepcontext import StepContext
from unbroken.ft.stops import StopRun

log = logging.getLogger(__name__)


def checkpoint_due(next_step: int, total: int, every: int) -> bool:
    """Whether the state at ``next_step`` (after committing ``next_step - 1``) of a run of ``total`` steps is
    to be saved: every ``every`` steps (0: never), and always at the end of the run."""
    return next_step == total or (every > 0 and next_step > 0 and next_step % every == 0)


class Checkpoints:
    """The checkpoints of a run of ``ctx.total`` steps in ``ctx.run_dir``, as this worker's part in them."""

    def __init__(self, ctx: StepContext, membership: Membership) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.membership = membership
        self.state = ctx.state
        self.run_dir = ctx.run_dir
        self.total = ctx.total  # the run's steps: the state after the last one is the final checkpoint

    def due(self, next_step: int) -> bool:
        """Whether the state at ``next_step`` is to be saved (``checkpoint_due``)."""
        return checkpoint_due(next_step, self.total, self.cfg.checkpoint_every)

    def save_if_due(self) -> None:
        """After a commit: the leader saves the state if a checkpoint is due (a phase of no collective: if the
        leader dies while writing, the others find out at their next collective and, once re-formed, the
        new leader writes it, ``ensure``)."""
        if self.membership.group is not None and self.membership.leader and self.due(self.state.step):
            self.write()

    def ensure(self) -> None:
        """On the leader of a new group: if the current state's checkpoint is due but not on disk and whole (its
        writer died half-way), write it now, replacing the dead writer's temporary files."""
        assert self.membership.group is not None
        if self.membership.leader and self.state.step > 0 and self.due(self.state.step):
            whole = True
            try:
                ckpt.check(self.run_dir, self.state.step)
            except ValueError:
                whole = False
            if not self.membership.agreed(whole):  # a replica's ranks write it together
                log.warning("the checkpoint of step %d is missing or damaged: writing it", self.state.step)
                self.write()

    def write(self) -> None:
        """Write the current state's checkpoint (the leader; of replicas of several ranks, its ranks together)."""
        step = self.state.step
        t0 = time.perf_counter()
        midway = lambda: self.ctx.hook.at(Phase.CHECKPOINT, step=step)  # noqa: E731
        replica = self.membership.replica
        if replica is not None:  # sharded, by the ranks of the leading replica together
            assert self.state.model is not None
            path = ckpt.save_sharded(
                self.run_dir,
                step,
                self.state.model,
                self.state.optimizer,
                self.state.snapshot(local=True),
                replica,
                self.cfg.checkpoint_keep,
                midway,
                self.state.efficient.named_bases() if self.state.efficient is not None else None,
            )
        else:
            ckpt.clean_partial(self.run_dir)  # what a writer that died left: only the group's leader writes
            path = ckpt.save_checkpoint(self.run_dir, step, self.state.snapshot(), self.cfg.checkpoint_keep, midway)
        self.membership.publish(RecordKind.CHECKPOINT, step=step, path=str(path), seconds=time.perf_counter() - t0)

    def load(self) -> None:
        """Load the newest good checkpoint (``--resume``, on the leader: every rank of the leading replica)."""
        replica = self.membership.replica
        sharded = replica is not None
        loaded = ckpt.load_latest(self.run_dir, read_sharded=not sharded)
        if loaded is None:
            raise StopRun(f"--resume: no usable checkpoint in {ckpt.checkpoint_dir(self.run_dir)}")
        for line in loaded.skipped:
            self.membership.publish(RecordKind.CHECKPOINT_REJECTED, detail=line)
        bases = self.state.efficient.empty_named_bases() if self.state.efficient is not None else None
        try:
            if loaded.sharded and replica is not None:
                assert self.state.model is not None
                rest = ckpt.load_sharded(loaded.path, self.state.model, self.state.optimizer, replica, bases)
                self.state.restore(rest, tensors=False)
            elif replica is not None:
                raise ValueError(
                    "is the checkpoint of replicas of one rank (one file); replicas of several ranks resume from a "
                    "sharded one (resume with parallel.shard = parallel.pipeline = parallel.tensor = 1)"
                )
            elif loaded.sharded:
                assert self.state.model is not None
                rest = ckpt.load_sharded(loaded.path, self.state.model, self.state.optimizer, None, bases)
                self.state.restore(rest, tensors=False)
            else:
                self.state.restore(loaded.state)
        except ValueError as e:
            raise StopRun(f"checkpoint {loaded.path.name}: {e}") from None
        self.membership.publish(RecordKind.RESUME, step=loaded.step, path=str(loaded.path))
        log.info("resumed from %s (step %d)", loaded.path, loaded.step)
