"""Fault injection inside a worker: the one hook the step's parts call at its named points.

Owns ``PhaseHook``, the hook every part of a step holds (``stepcontext.StepContext.hook``) and calls at the
step's named points (``core.failures.Phase``): ``at`` for the start, the reduction, the optimizer step, a state
received and a checkpoint half-written; ``enter`` / ``leave`` around each microbatch (the forward and backward
phases fire inside the model); and the faults a worker produces in itself. ``PhaseHook`` itself is the null
object a worker holds when no fault is scheduled: every call does nothing. ``FaultInjector`` is the worker's side
of a schedule: at a named phase of a step it asks the process that started it (launcher or agent) for the real
signal (``kill``, ``hang``, ``pause``) or cuts its own connections (``cut``); and it applies the faults a worker
produces in itself: a slowed-down microbatch (``slow``), a poisoned microbatch gradient (``nan``, ``inf``), a
scaled microbatch (``scale``, to force a fixed-point overflow), a stall inside the reduction while the
heartbeats go on (``stall``) and a microbatch reported twice (``dup``, to prove the accounting check).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from typing import Any

import torch
from torch import nn

from unbroken.control.member.client import INJECT_FD_ENV
from unbroken.control.store import keys
from unbroken.core.failures import FailureKind, FailureSchedule, Phase, cut_connections

log = logging.getLogger(__name__)

HANDSHAKE_S = 5.0  # how long a worker waits at an injection point for the process that signals it


def wake_agent() -> None:
    """Wake the agent that started this worker (``INJECT_FD_ENV``), if one did: it then looks at once for the
    injection point just reached (without it, at its next look)."""
    fd = os.environ.get(INJECT_FD_ENV, "")
    if fd.isdigit():
        try:
            os.write(int(fd), b"!")
        except OSError:  # a full pipe already wakes it; a closed one: the agent looks anyway
            pass


class PhaseHook:
    """The step's hook at its named points, as the step's parts call it. This class is the null object: a
    worker with no fault scheduled holds one, and every call does nothing (``FaultInjector`` acts)."""

    enabled = False  # whether any fault is scheduled

    def at(self, phase: Phase, step: int | None = None) -> None:
        """Named point ``phase`` of step ``step`` (default: the step of the microbatch last entered)."""

    def stall(self, step: int) -> None:
        """Inside the reduction of ``step``, once this worker's gradients are sent."""

    def reported(self, done: list[int], step: int) -> list[int]:
        """The microbatch ids this worker reports computed in ``step`` (it computed ``done``)."""
        return done

    def enter(self, model: nn.Module, step: int, first: bool, last: bool, first_of_step: bool = False) -> None:
        """A microbatch of step ``step`` comes next (``first`` / ``last`` of this worker's round of them;
        ``first_of_step``: its first of the step): arm what fires inside ``model``'s forward and backward."""

    def leave(self) -> None:
        """The microbatch's backward ran, or the loop left it: disarm what ``enter`` armed."""

    def loss_factor(self, microbatch: int) -> float:
        """The factor microbatch ``microbatch``'s loss is multiplied by (of the step last entered)."""
        return 1.0

    def slow_down(self, elapsed_s: float, microbatches: int = 1) -> float:
        """After ``microbatches`` computed in ``elapsed_s``: the seconds this worker was slowed down by."""
        return 0.0


def phase_hook(schedule: FailureSchedule, store: Any, worker: int) -> PhaseHook:
    """Worker ``worker``'s hook: the null one when nothing is scheduled, else a ``FaultInjector`` on ``store``."""
    if not schedule.events:
        return PhaseHook()
    injector = FaultInjector(schedule)
    injector.attach(store, worker)
    return injector


class FaultInjector(PhaseHook):
    """The schedule's events for one worker. ``store`` and ``worker`` are set once it has joined."""

    def __init__(self, schedule: FailureSchedule) -> None:
        self.schedule = schedule
        self.store: Any = None
        self.worker = -1
        self.step = 0  # the step of the microbatch last entered (``enter``)
        self._handles: list[Any] = []
        self.enabled = bool(schedule.events)

    def attach(self, store: Any, worker: int) -> None:
        self.store = store
        self.worker = worker

    def at(self, phase: Phase, step: int | None = None) -> None:
        """If the schedule says so, tell the launcher we reached (step, phase) and wait to be signalled.

        A kill, hang or pause is a real signal from the launcher (SIGKILL, SIGSTOP, SIGSTOP + SIGCONT);
        without one (a worker started by hand), the worker acts on itself after a few seconds. A cut is done
        here once the launcher has recorded it: every TCP connection of this process is shut down.
        """
        step = self.step if step is None else step
        candidates = self.schedule.injections(self.worker, step, phase)
        if not candidates or self.store is None:
            return
        store = self.store
        # Each event fires once per run, also when a restart replays its step.
        event = next((e for e in candidates if not store.check([keys.fired(e.describe())])), None)
        if event is None:
            return
        log.warning("injection point reached: %s", event.describe())
        key = keys.inject(self.worker)
        store.set(key, json.dumps({"event": event.describe(), "time": time.time()}))
        store.add(keys.INJECT_BELL, 1)
        wake_agent()
        deadline = time.monotonic() + HANDSHAKE_S
        while time.monotonic() < deadline and store.check([key]):
            time.sleep(0.005)  # the launcher takes the key, then signals
        if store.check([keys.skip(self.worker)]):  # the launcher spares the group's last alive member
            store.delete_key(keys.skip(self.worker))
            log.warning("injection skipped: no other member of the group is alive")
            return
        if event.kind is FailureKind.CUT:
            log.warning("cutting %d connections", cut_connections())
            return
        if event.kind is FailureKind.PAUSE:
            # SIGSTOP arrives within the launcher's poll period; after SIGCONT this sleep ends at once.
            time.sleep(0.5 if not store.check([key]) else event.seconds)
            return
        while time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL if event.kind is FailureKind.KILL else signal.SIGSTOP)

    def enter(self, model: nn.Module, step: int, first: bool, last: bool, first_of_step: bool = False) -> None:
        """One-shot hooks that fire inside the forward of the first / the backward of the last microbatch (on
        the model's middle sub-module: the ``forward`` / ``backward`` phases), and a ``nan`` / ``inf`` event's
        poison in the first microbatch of the step."""
        self.step = step
        self._handles = self._phase_hooks(model, first, last)
        if first_of_step:
            self._handles += self._poison_hook(model)

    def leave(self) -> None:
        remove(self._handles)
        self._handles = []

    def _phase_hooks(self, model: nn.Module, first: bool, last: bool) -> list[Any]:
        handles = []
        modules = [m for m in model.modules() if m is not model] or [model]
        middle = modules[len(modules) // 2]
        if first and self.schedule.injection(self.worker, self.step, Phase.FORWARD) is not None:
            handles.append(middle.register_forward_hook(lambda *_: self.at(Phase.FORWARD)))
        if last and self.schedule.injection(self.worker, self.step, Phase.BACKWARD) is not None:
            handles.append(middle.register_full_backward_hook(lambda *_: self.at(Phase.BACKWARD)))
        return handles

    def slow_down(self, elapsed_s: float, microbatches: int = 1) -> float:
        """``slow`` events: sleep what makes ``microbatches`` computed in ``elapsed_s`` take as long as the schedule
        says (``factor`` x the time, plus ``seconds`` each); returns the seconds slept."""
        factor = self.schedule.slow_factor(self.worker, self.step)
        extra = (factor - 1.0) * elapsed_s + self.schedule.slow_seconds(self.worker, self.step) * microbatches
        if extra > 0.0:
            time.sleep(extra)
        return extra

    def loss_factor(self, microbatch: int) -> float:
        """``scale`` events: the factor microbatch ``microbatch`` of this step's loss is multiplied by, whoever
        computes it (so a recomputation after a failure is the same microbatch)."""
        return self.schedule.scale_factor(self.step, microbatch)

    def _poison_hook(self, model: nn.Module) -> list[Any]:
        """``nan`` / ``inf`` events: the first microbatch this worker computes in the step gets a gradient with
        one non-finite value in the model's middle parameter (its loss stays finite)."""
        event = self.schedule.poison(self.worker, self.step)
        if event is None:
            return []
        names = [name for name, _ in model.named_parameters()]
        path, _, attr = names[len(names) // 2].rpartition(".")
        owner = model.get_submodule(path)
        value = float("nan") if event.kind is FailureKind.NAN else float("inf")
        log.warning("poisoning this microbatch's gradient: %s", event.describe())

        def poison(grad: torch.Tensor) -> torch.Tensor:
            out = grad.clone()
            out.view(-1)[0] = value
            return out

        handles: list[Any] = []

        def on_forward(module: nn.Module, _args: Any) -> None:
            # The parameter the forward computes with: under FSDP the unsharded one (the hook on the sharded
            # parameter would never see a gradient), else the parameter itself.
            if len(handles) == 1:
                handles.append(getattr(module, attr).register_hook(poison))

        handles.append(owner.register_forward_pre_hook(on_forward))
        return [_Handles(handles)]

    def stall(self, step: int) -> None:
        """``stall`` events: block inside the reduction (the heartbeat thread goes on)."""
        event = self.schedule.stall(self.worker, step)
        if event is None or self.store is None or self.store.check([keys.fired(event.describe())]):
            return
        self.store.set(keys.fired(event.describe()), "1")
        log.warning("stalling %.1f s inside the reduction: %s", event.seconds, event.describe())
        time.sleep(event.seconds)

    def reported(self, done: list[int], step: int) -> list[int]:
        """``dup`` events: report one microbatch twice in this step's counts."""
        if done and self.schedule.duplicate(self.worker, step):
            return [*done, done[0]]
        return done


class _Handles:
    """Several hook handles removed as one (some registered later, by a hook)."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def remove(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
