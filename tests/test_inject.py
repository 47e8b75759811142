"""``inject``'s phase hook, the one object the step's parts call at its named points: a worker with no fault
scheduled holds the null hook, which arms nothing in the model and changes nothing; a schedule gives the
injector, whose in-worker faults act at the step and microbatch they name (the signals it asks its launcher for
are tested end to end in test_faults.py)."""

from __future__ import annotations

import pytest
from torch import nn

from unbroken.core.failures import FailureSchedule
from unbroken.ft.inject import FaultInjector, PhaseHook, phase_hook

pytestmark = pytest.mark.timeout(60)


def hooks_on(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


def test_no_fault_scheduled_is_the_null_hook_which_arms_and_changes_nothing() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    hook = phase_hook(FailureSchedule.parse(""), store=None, worker=0)
    assert type(hook) is PhaseHook and not hook.enabled
    hook.enter(model, 3, first=True, last=True, first_of_step=True)
    assert hooks_on(model) == 0
    assert (hook.loss_factor(1), hook.slow_down(2.0, 4), hook.reported([1, 2], 3)) == (1.0, 0.0, [1, 2])
    hook.leave()


def test_a_schedule_gives_the_injector_acting_at_the_step_and_microbatch_it_names() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    schedule = FailureSchedule.parse(
        "kill:worker=0,step=3,phase=forward; nan:worker=0,step=3; scale:step=3,microbatch=1,factor=4; "
        "dup:worker=0,step=3"
    )
    hook = phase_hook(schedule, store=None, worker=0)
    assert isinstance(hook, FaultInjector) and hook.enabled
    hook.enter(model, 2, first=True, last=True, first_of_step=True)  # another step: nothing armed
    assert hooks_on(model) == 0 and hook.loss_factor(1) == 1.0 and hook.reported([1], 2) == [1]
    hook.enter(model, 3, first=True, last=False, first_of_step=True)
    assert hooks_on(model) == 2  # the forward phase's kill, the poison's pre-hook
    assert (hook.loss_factor(1), hook.loss_factor(0)) == (4.0, 1.0)
    assert hook.reported([1, 2], 3) == [1, 2, 1]
    hook.leave()
    assert hooks_on(model) == 0
    hook.enter(model, 3, first=False, last=False)  # not the first microbatch: neither fires
    assert hooks_on(model) == 0
