"""A step's explicit end: the optimizer steps on the agreed gradient, or the step is skipped on every member.

Owns the commit of a reduced step (clip, optimizer step, the exact scale's tracking) or its skip for a
non-finite gradient (``train.nonfinite``: skip, or stop; too many skips in a row stop), what the group
agreed at the last commit (the members' speeds, the epoch at which joiners are taken in, the counts and
tokens), and the step record's fields (throughput, and MFU from the ``StepContext``'s figures). It runs no
collective of the group (only the ranks of a replica combine their parts of the gradient's norm), and the
reduction it commits is ``reduction.StepReduction``'s.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from unbroken.core import ckptfiles
from unbroken.core.config import NonfinitePolicy, Reduction
from unbroken.core.failures import Phase
from unbroken.core.plan import agreed_speed
from unbroken.core.records import RecordKind
from unbroken.core.throughput import gpus_in_use, step_throughput
from unbroken.ft.comm import local_tensor
from unbroken.ft.gradnorm import exact_clip, float_clip, peaks
from unbroken.ft.membership import Membership
from unbroken.ft.reduction import ModelTensors, StepReduction
from unbroken.ft.sidevec import Reduced
from unbroken.ft.state import StepOutcome
from unbroken.ft.stepcontext import StepContext
from unbroken.ft.stepplan import StepPlan
from unbroken.ft.stops import EXIT_NONFINITE, StopRun

log = logging.getLogger(__name__)


class StepCommit:
    """Commits (or skips) the current step and writes its record."""

    def __init__(self, ctx: StepContext, membership: Membership, plan: StepPlan, tensors: ModelTensors) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.M = ctx.cfg.microbatches
        self.membership = membership
        self.plan = plan
        self.tensors = tensors
        self.state = ctx.state
        self.exact = ctx.cfg.reduction is Reduction.EXACT
        # The newest epoch the leader had seen at the last reduction: every member reads the same value, so
        # they all take in joiners at the same step boundary (a join interrupts no collective).
        self.switch_epoch = 0
        self.last_counts: list[int] = [1] * self.M
        self.last_tokens = 0

    def commit(
        self, reduction: StepReduction, optimizer: torch.optim.Optimizer | None, clip_grad_norm: float, seconds: float
    ) -> StepOutcome:
        """The optimizer steps (the gradient is finite and every invariant held) or the step is skipped on
        every member alike; then the step advances and its record is published. The caller begins the next
        step's local state."""
        assert reduction.reduced is not None and self.membership.group is not None
        step, reduced = self.state.step, reduction.reduced
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
        self.state.speeds = {w: agreed_speed(s) for w, s in reduced.seconds.items() if w in self.membership.units()}
        self.switch_epoch = reduced.newest_epoch
        if reduction.nonfinite:
            outcome = self.skip(step, reduction.culprits(), loss, lr, common)
        else:
            self.ctx.hook.at(Phase.OPTIMIZER)
            grad_norm = self._clip(clip_grad_norm)
            if self.state.efficient is not None:
                self.state.efficient.wait()  # the bases have read the weights (torch optimizers also do this)
            if optimizer is not None:
                optimizer.step()
            if self.state.scale is not None:
                t = self.tensors
                self.state.scale.track(peaks(self._local_grads(), t.index, t.numels, self.membership.combine_max))
            self.state.nonfinite_streak = 0
            outcome = StepOutcome(loss, grad_norm, lr, **common)
        self.state.last = outcome
        self.state.step = step + 1
        self.last_counts = reduced.counted
        self.last_tokens = sum(t for j, t in enumerate(reduced.tokens) if reduced.counted[j] > 0)
        self.membership.publish(RecordKind.STEP, **self.step_fields(step, outcome, seconds))
        return outcome

    def _local_grads(self) -> list[torch.Tensor]:
        """This rank's part of every gradient (an empty tensor for a parameter without one)."""
        empty = torch.zeros(0)
        return [empty if p.grad is None else local_tensor(p.grad) for p in self.tensors.params]

    def _clip(self, max_norm: float) -> float:
        """The gradient's global norm, clipped to ``max_norm`` (0: not clipped). Exact mode: the same bits
        however the model is split (``gradnorm.exact_clip``); fp32: torch's for a whole model."""
        t, membership = self.tensors, self.membership
        if self.exact:
            return exact_clip(
                self._local_grads(),
                t.index,
                t.numels,
                max_norm,
                membership.combine_max,
                membership.combine_sum,
                t.counted,
            )
        if membership.replica is not None:
            return float_clip(self._local_grads(), max_norm, membership.combine_sum, t.counted)
        if max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(t.params, max_norm, foreach=True))
        return float(torch.nn.utils.get_total_norm([p.grad for p in t.params if p.grad is not None], foreach=True))

    def skip(self, step: int, found: Reduced | None, loss: float, lr: float, common: dict[str, int]) -> StepOutcome:
        """Skip step ``step`` for a non-finite gradient (``found``: where it was found), or stop the run
        (``train.nonfinite = "stop"``, or ``train.max_nonfinite_skips`` skips in a row): StopRun, shared."""
        assert found is not None
        ids = [j for j, n in enumerate(found.nonfinite) if n]
        workers = sorted(found.bad_param)
        param = self.tensors.names[min(found.bad_param.values())] if found.bad_param else "?"
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
        self.membership.publish(
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
        return ckptfiles.last_checkpoint_words(self.ctx.run_dir)

    def republish_last_step(self) -> None:
        """The last committed step's record may have been lost with the old leader (killed between its commit
        and its publish): the new leader publishes it again, marked ``republished``."""
        last = self.state.last
        if self.membership.group is None or not self.membership.leader or self.state.step < 1 or math.isnan(last.loss):
            return
        fields = self.step_fields(self.state.step - 1, last, math.nan, fresh=False)
        self.membership.publish(RecordKind.STEP, **fields, republished=True)

    def step_fields(self, step: int, outcome: StepOutcome, seconds: float, fresh: bool = True) -> dict[str, Any]:
        """The step record's fields; ``fresh``: this worker took part in the step's reduction (a republished
        record has no counts, tokens or timing of its own)."""
        group = self.membership.group
        assert group is not None
        fields: dict[str, Any] = {
            "step": step,
            "loss": outcome.loss,
            "lr": outcome.lr,
            "grad_norm": outcome.grad_norm,
            "step_time_s": seconds,
            "tokens": self.last_tokens if fresh else 0,
            "tokens_per_s": self.last_tokens / seconds if fresh and seconds > 0 else math.nan,
            "alive": group.size,
            "epoch": group.epoch,
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
            workers = group.size * self.membership.layout.size
            ctx = self.ctx
            gpus = gpus_in_use(workers, self.cfg.workers_per_gpu) if ctx.device.type == "cuda" else 0
            fields |= step_throughput(self.last_tokens, seconds, workers, gpus, ctx.flops_per_token, ctx.peak_tflops)
            fields["counted"] = int(sum(self.last_counts))
            fields["counted_once"] = all(c == 1 for c in self.last_counts)
            fields["quotas"] = {str(w): n for w, n in self.plan.quotas.items()}
            # each member's seconds per microbatch, agreed in this step's reduction (the status view's speeds)
            fields["speeds"] = {str(w): s for w, s in self.state.speeds.items()}
        return fields
