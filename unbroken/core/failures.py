"""Failure schedules: what to break, where and when. Pure Python, no torch; the simulator reuses it.

Grammar (events separated by ``;``):

    kill:worker=2,step=10,phase=backward[,rejoin=5]   SIGKILL at that point; restart after 5 s to rejoin
    kill:coordinator,step=3                           SIGKILL of the coordinator once step 3 is committed (the
                                                      launcher starts a successor; the workers hold on)
    hang:worker=1,step=5[,phase=start][,rejoin=5]     SIGSTOP (the heartbeat timeout must catch it)
    pause:worker=1,step=5,seconds=0.5[,phase=..][,rejoin=5]
                                                      SIGSTOP, then SIGCONT 0.5 s later; if the pause
                                                      outlasted the heartbeat timeout the worker was
                                                      excluded, leaves, and (rejoin=) is restarted
    cut:worker=1,step=5[,phase=..][,rejoin=5]         the worker shuts down every TCP connection it has
                                                      (its store tunnel and its gloo sockets), as a cut
                                                      link would; it leaves, and (rejoin=) is restarted
    slow:worker=1,factor=3,steps=5-20                 the worker computes 3x slower during steps 5..20
    slow:worker=1,seconds=0.2,steps=5-20              each microbatch it computes takes 0.2 s more (a fixed
                                                      latency, whatever the machine's speed; with factor=, both)
    stall:worker=1,step=5,seconds=S[,rejoin=5]        the worker blocks S seconds inside the reduction while its
                                                      heartbeats go on (a stalled link); the others' collective
                                                      times out and the coordinator decides
    nan:worker=1,step=5    inf:worker=1,step=5        the first microbatch the worker computes in that step gets
                                                      a gradient with a NaN (an infinity) in one value
    scale:step=5,microbatch=2,factor=1e6              microbatch 2 of step 5 has its loss (so its gradient)
                                                      multiplied by 1e6, whoever computes it (a huge gradient:
                                                      forces the exact mode's fixed point to grow)
    dup:worker=1,step=5                               the worker reports one microbatch twice in its counts (an
                                                      accounting fault: the run must stop cleanly)

Phases of a step, in order: ``start`` (before any compute), ``forward`` (inside the first microbatch's
forward), ``backward`` (inside the last local microbatch's backward, with part of the reduction already
started), ``reduction`` (all collectives started, none finished), ``optimizer`` (after the reduction,
before the optimizer step). Two more phases are not part of every step and fire the first time they
happen at or after ``step``: ``receive`` (while the worker receives the training state to rejoin, between
the header and the tensors) and ``checkpoint`` (half-way through writing a checkpoint file, on the
leader). Kills and hangs are real signals sent by the launcher; a cut is done by the worker itself.

Schedules are validated against the run before anything starts. Random schedules from an MTBF/MTTR are
generated with a seeded RNG into the same type, and so are MeCeFO's failure scenarios (``SCENARIOS``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from enum import StrEnum


class FailureKind(StrEnum):
    KILL = "kill"
    HANG = "hang"
    PAUSE = "pause"
    CUT = "cut"
    SLOW = "slow"
    STALL = "stall"
    NAN = "nan"
    INF = "inf"
    SCALE = "scale"
    DUP = "dup"


IN_WORKER_KINDS = frozenset(
    {FailureKind.SLOW, FailureKind.STALL, FailureKind.NAN, FailureKind.INF, FailureKind.SCALE, FailureKind.DUP}
)
COORDINATOR_TARGET = -1  # the worker field of ``kill:coordinator,step=N`` (the launcher kills the coordinator)
FATAL_KINDS = frozenset({FailureKind.KILL, FailureKind.HANG, FailureKind.CUT})  # the worker leaves the group


class Phase(StrEnum):
    START = "start"
    FORWARD = "forward"
    BACKWARD = "backward"
    REDUCTION = "reduction"
    OPTIMIZER = "optimizer"
    RECEIVE = "receive"
    CHECKPOINT = "checkpoint"


STEP_PHASES = (Phase.START, Phase.FORWARD, Phase.BACKWARD, Phase.REDUCTION, Phase.OPTIMIZER)
AT_OR_AFTER = frozenset({Phase.RECEIVE, Phase.CHECKPOINT})  # fire at their first occurrence from `step` on


@dataclass(frozen=True)
class FailureEvent:
    kind: FailureKind
    worker: int
    step: int  # first step affected
    phase: Phase = Phase.START
    rejoin_after_s: float | None = None  # kill/hang: restart the worker this long after it was killed
    factor: float = 1.0  # slow: compute time multiplier
    last_step: int = -1  # slow: last step affected (inclusive)
    seconds: float = 0.0  # pause, stall: how long the worker stays stopped; slow: added to each microbatch
    microbatch: int = -1  # scale: the microbatch id

    @property
    def targets_coordinator(self) -> bool:
        """``kill:coordinator,step=N`` (a ``scale`` event also has no worker, but is not one)."""
        return self.kind is FailureKind.KILL and self.worker == COORDINATOR_TARGET

    def describe(self) -> str:
        if self.targets_coordinator:
            return f"kill:coordinator,step={self.step}"
        if self.kind is FailureKind.SLOW:
            added = f",seconds={self.seconds:g}" if self.seconds else ""
            return f"slow:worker={self.worker},factor={self.factor:g}{added},steps={self.step}-{self.last_step}"
        if self.kind is FailureKind.SCALE:
            return f"scale:step={self.step},microbatch={self.microbatch},factor={self.factor:g}"
        if self.kind in (FailureKind.NAN, FailureKind.INF, FailureKind.DUP):
            return f"{self.kind}:worker={self.worker},step={self.step}"
        if self.kind is FailureKind.STALL:
            text = f"stall:worker={self.worker},step={self.step},seconds={self.seconds:g}"
            return text + (f",rejoin={self.rejoin_after_s:g}" if self.rejoin_after_s is not None else "")
        text = f"{self.kind}:worker={self.worker},step={self.step},phase={self.phase}"
        if self.kind is FailureKind.PAUSE:
            text += f",seconds={self.seconds:g}"
        return text + (f",rejoin={self.rejoin_after_s:g}" if self.rejoin_after_s is not None else "")


_ALLOWED_KEYS = {
    FailureKind.KILL: {"worker", "step", "phase", "rejoin"},
    FailureKind.HANG: {"worker", "step", "phase", "rejoin"},
    FailureKind.PAUSE: {"worker", "step", "phase", "rejoin", "seconds"},
    FailureKind.CUT: {"worker", "step", "phase", "rejoin"},
    FailureKind.SLOW: {"worker", "factor", "seconds", "steps"},
    FailureKind.STALL: {"worker", "step", "seconds", "rejoin"},
    FailureKind.NAN: {"worker", "step"},
    FailureKind.INF: {"worker", "step"},
    FailureKind.SCALE: {"step", "microbatch", "factor"},
    FailureKind.DUP: {"worker", "step"},
}


def _int(text: str, key: str, event: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"failure event {event!r}: {key}={text!r} is not an integer") from None


def _float(text: str, key: str, event: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"failure event {event!r}: {key}={text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"failure event {event!r}: {key}={text!r} must be a finite number >= 0")
    return value


def parse_event(text: str, default_rejoin_s: float | None = None) -> FailureEvent:
    """Parse one event such as ``kill:worker=2,step=10,phase=backward``."""
    kind_text, sep, rest = text.strip().partition(":")
    kinds = ", ".join(k.value for k in FailureKind)
    if not sep:
        raise ValueError(f"failure event {text!r} is malformed; expected KIND:key=value,... with KIND one of {kinds}")
    try:
        kind = FailureKind(kind_text.strip())
    except ValueError:
        raise ValueError(f"failure event {text!r}: unknown kind {kind_text!r}; allowed: {kinds}") from None
    fields: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if item == "coordinator" and kind is FailureKind.KILL:
            fields["coordinator"] = ""
            continue
        if not eq or not key.strip():
            raise ValueError(f"failure event {text!r}: {item!r} is not key=value")
        key = key.strip()
        if key not in _ALLOWED_KEYS[kind]:
            allowed = ", ".join(sorted(_ALLOWED_KEYS[kind]))
            raise ValueError(f"failure event {text!r}: unknown key {key!r} for {kind}; allowed: {allowed}")
        fields[key] = value.strip()
    if kind is FailureKind.SCALE:
        for needed in ("step", "microbatch", "factor"):
            if needed not in fields:
                raise ValueError(f"failure event {text!r}: scale needs step=, microbatch= and factor=")
        factor = _float(fields["factor"], "factor", text)
        if factor == 0:
            raise ValueError(f"failure event {text!r}: factor must be > 0")
        step, microbatch = _int(fields["step"], "step", text), _int(fields["microbatch"], "microbatch", text)
        return FailureEvent(kind, -1, step, factor=factor, microbatch=microbatch)
    if kind is FailureKind.KILL and "coordinator" in fields and fields["coordinator"] == "":
        if set(fields) - {"coordinator", "step"} or "step" not in fields:
            raise ValueError(f"failure event {text!r}: expected kill:coordinator,step=N")
        return FailureEvent(kind, COORDINATOR_TARGET, _int(fields["step"], "step", text), Phase.START)
    if "worker" not in fields:
        raise ValueError(f"failure event {text!r} names no worker")
    worker = _int(fields["worker"], "worker", text)
    if kind is FailureKind.SLOW:
        if "steps" not in fields or not {"factor", "seconds"} & set(fields):
            raise ValueError(f"failure event {text!r}: slow needs steps=FIRST-LAST and factor= or seconds= (or both)")
        first, dash, last = fields["steps"].partition("-")
        start = _int(first, "steps", text)
        end = _int(last, "steps", text) if dash else start
        factor = _float(fields.get("factor", "1"), "factor", text)
        added = _float(fields.get("seconds", "0"), "seconds", text)
        if factor < 1.0 or added < 0.0 or end < start:
            raise ValueError(f"failure event {text!r}: needs factor >= 1, seconds >= 0 and steps FIRST <= LAST")
        return FailureEvent(kind, worker, start, factor=factor, last_step=end, seconds=added)
    if "step" not in fields:
        raise ValueError(f"failure event {text!r} names no step")
    if kind in (FailureKind.NAN, FailureKind.INF, FailureKind.DUP):
        return FailureEvent(kind, worker, _int(fields["step"], "step", text))
    if kind is FailureKind.STALL:
        if "seconds" not in fields:
            raise ValueError(f"failure event {text!r}: stall needs seconds= (how long the worker blocks)")
        seconds = _float(fields["seconds"], "seconds", text)
        if seconds <= 0:
            raise ValueError(f"failure event {text!r}: seconds must be > 0")
        rejoin = _float(fields["rejoin"], "rejoin", text) if "rejoin" in fields else default_rejoin_s
        return FailureEvent(kind, worker, _int(fields["step"], "step", text), Phase.REDUCTION, rejoin, seconds=seconds)
    phase_text = fields.get("phase", Phase.BACKWARD if kind is FailureKind.KILL else Phase.START)
    try:
        phase = Phase(phase_text)
    except ValueError:
        phases = ", ".join(p.value for p in Phase)
        raise ValueError(f"failure event {text!r}: unknown phase {phase_text!r}; allowed: {phases}") from None
    rejoin = _float(fields["rejoin"], "rejoin", text) if "rejoin" in fields else default_rejoin_s
    seconds = 0.0
    if kind is FailureKind.PAUSE:
        if "seconds" not in fields:
            raise ValueError(f"failure event {text!r}: pause needs seconds= (how long the worker stays stopped)")
        seconds = _float(fields["seconds"], "seconds", text)
        if seconds <= 0:
            raise ValueError(f"failure event {text!r}: seconds must be > 0")
    return FailureEvent(kind, worker, _int(fields["step"], "step", text), phase, rejoin, seconds=seconds)


@dataclass(frozen=True)
class FailureSchedule:
    """A validated list of events; empty means no failures (the null object every worker can hold)."""

    events: tuple[FailureEvent, ...] = ()

    @staticmethod
    def parse(text: str, default_rejoin_s: float | None = None) -> FailureSchedule:
        events = tuple(parse_event(part, default_rejoin_s) for part in text.split(";") if part.strip())
        return FailureSchedule(events)

    def describe(self) -> str:
        return "; ".join(e.describe() for e in self.events)

    def validate(self, num_workers: int, steps: int, microbatches: int | None = None) -> None:
        """Refuse a schedule that names nothing real or cannot be survived; ValueError, one line."""
        for e in self.events:
            if e.kind is FailureKind.SCALE:
                if microbatches is not None and not 0 <= e.microbatch < microbatches:
                    raise ValueError(
                        f"failure event {e.describe()!r}: microbatch {e.microbatch} does not exist "
                        f"(microbatches 0..{microbatches - 1})"
                    )
            elif e.targets_coordinator:
                pass
            elif not 0 <= e.worker < num_workers:
                raise ValueError(
                    f"failure event {e.describe()!r}: worker {e.worker} does not exist (workers 0..{num_workers - 1})"
                )
            if not 0 <= e.step < steps or (e.kind is FailureKind.SLOW and e.last_step >= steps):
                raise ValueError(f"failure event {e.describe()!r}: step past the end of the run (steps 0..{steps - 1})")
        fatal = [e for e in self.events if e.kind in FATAL_KINDS and not e.targets_coordinator]
        never_back = {e.worker for e in fatal if e.rejoin_after_s is None}
        if fatal and never_back >= set(range(num_workers)):
            raise ValueError(
                f"the failure schedule kills every worker ({num_workers}) and none rejoins; "
                "leave at least one alive or add rejoin=SECONDS"
            )
        by_step: dict[int, set[int]] = {}
        for e in fatal:
            if e.phase not in AT_OR_AFTER:
                by_step.setdefault(e.step, set()).add(e.worker)
        for step, workers in by_step.items():
            if len(workers) >= num_workers:
                raise ValueError(f"the failure schedule kills every worker at step {step}; nobody would hold the state")

    def injections(self, worker: int, step: int, phase: Phase) -> list[FailureEvent]:
        """The events (not ``slow``) that match ``worker`` at (step, phase), in schedule order. Events of
        the ``receive`` and ``checkpoint`` phases match from their step on; the caller fires each once."""
        return [
            e
            for e in self.events
            if e.kind not in IN_WORKER_KINDS
            and e.worker == worker
            and e.phase == phase
            and (e.step == step or (phase in AT_OR_AFTER and e.step <= step))
        ]

    def injection(self, worker: int, step: int, phase: Phase) -> FailureEvent | None:
        """The first event that matches ``worker`` at (step, phase), if any."""
        matching = self.injections(worker, step, phase)
        return matching[0] if matching else None

    def slow_factor(self, worker: int, step: int) -> float:
        factor = 1.0
        for e in self._slow(worker, step):
            factor = max(factor, e.factor)
        return factor

    def slow_seconds(self, worker: int, step: int) -> float:
        """What ``slow`` events add to each microbatch ``worker`` computes in ``step`` (``seconds=``)."""
        return max((e.seconds for e in self._slow(worker, step)), default=0.0)

    def _slow(self, worker: int, step: int) -> list[FailureEvent]:
        return [
            e
            for e in self.events
            if e.kind is FailureKind.SLOW and e.worker == worker and e.step <= step <= e.last_step
        ]

    def poison(self, worker: int, step: int) -> FailureEvent | None:
        """The ``nan`` / ``inf`` event of ``worker`` at ``step``, if any."""
        return next(
            (
                e
                for e in self.events
                if e.kind in (FailureKind.NAN, FailureKind.INF) and (e.worker, e.step) == (worker, step)
            ),
            None,
        )

    def scale_factor(self, step: int, microbatch: int) -> float:
        """The product of the ``scale`` factors of microbatch ``microbatch`` of ``step`` (1 if none)."""
        factor = 1.0
        for e in self.events:
            if e.kind is FailureKind.SCALE and (e.step, e.microbatch) == (step, microbatch):
                factor *= e.factor
        return factor

    def stall(self, worker: int, step: int) -> FailureEvent | None:
        return next(
            (e for e in self.events if e.kind is FailureKind.STALL and (e.worker, e.step) == (worker, step)), None
        )

    def duplicate(self, worker: int, step: int) -> bool:
        return any(e.kind is FailureKind.DUP and (e.worker, e.step) == (worker, step) for e in self.events)

    def merged(self, other: FailureSchedule) -> FailureSchedule:
        return FailureSchedule(self.events + other.events)


def random_schedule(
    num_workers: int, steps: int, mtbf_s: float, mttr_s: float, step_time_s: float, seed: int
) -> FailureSchedule:
    """Seeded kills: exponential inter-failure times (mean ``mtbf_s``), a random alive victim and phase,
    a restart ``mttr_s`` later (none if 0). Never kills the last alive worker."""
    assert mtbf_s > 0 and step_time_s > 0
    rng = random.Random(seed)
    events: list[FailureEvent] = []
    down_until: dict[int, float] = {}
    t = 0.0
    phases = list(STEP_PHASES)
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        step = int(t / step_time_s)
        if step >= steps:
            break
        alive = [w for w in range(num_workers) if down_until.get(w, -1.0) <= t]
        if len(alive) <= 1:
            continue
        victim = rng.choice(alive)
        down_until[victim] = t + mttr_s if mttr_s > 0 else math.inf
        events.append(FailureEvent(FailureKind.KILL, victim, step, rng.choice(phases), mttr_s if mttr_s > 0 else None))
    # Two events for the same worker in one step cannot both fire; keep the first.
    seen: set[tuple[int, int]] = set()
    unique = []
    for e in events:
        if (e.worker, e.step) not in seen:
            seen.add((e.worker, e.step))
            unique.append(e)
    return FailureSchedule(tuple(unique))


# MeCeFO's Table 1: (hours between failures, hours until a failed node is back) in the cluster.
SCENARIOS: dict[str, tuple[float, float]] = {"low": (2.0, 4.0), "mid": (1.0, 3.0), "high": (0.5, 2.0)}
# The paper's cluster: 32 A100s, one data-parallel rank each.
PAPER_RANKS = 32


def scenario_timing(name: str, steps: int, run_hours: float, step_time_s: float, workers: int) -> tuple[float, float]:
    """Cluster-wide MTBF and per-failure MTTR in this run's seconds for scenario ``name``.

    The rule: Table 1's rates are for the paper's whole cluster of ``PAPER_RANKS`` ranks, so each rank fails
    on average every ``PAPER_RANKS * X`` hours and is back ``Y`` hours later. Each of our ``workers`` stands for
    one rank (so a run of 4 workers sees a failure every ``32 * X / 4`` hours, and the share of workers down,
    about ``Y / (32 X)``, is the paper's), and the run's ``steps`` stand for ``run_hours`` of cluster time
    (converted to seconds with the expected ``step_time_s``, since the launcher places kills on steps and
    restarts a worker after a delay in seconds)."""
    if name not in SCENARIOS:
        raise ValueError(f"failures.scenario = {name!r} is unknown; allowed: {', '.join(SCENARIOS)}")
    between_h, repair_h = SCENARIOS[name]
    seconds_per_hour = steps * step_time_s / run_hours
    return between_h * PAPER_RANKS / workers * seconds_per_hour, repair_h * seconds_per_hour


def build_schedule(
    schedule: str,
    mttr_s: float,
    mtbf_s: float,
    seed: int,
    step_time_s: float,
    num_workers: int,
    steps: int,
    scenario: str = "",
    scenario_hours: float = 64.0,
    microbatches: int | None = None,
) -> FailureSchedule:
    """The run's schedule from its ``[failures]`` settings, validated; ValueError before anything starts."""
    parsed = FailureSchedule.parse(schedule, mttr_s if mttr_s > 0 else None)
    if mtbf_s > 0:
        parsed = parsed.merged(random_schedule(num_workers, steps, mtbf_s, mttr_s, step_time_s, seed))
    if scenario:
        between_s, repair_s = scenario_timing(scenario, steps, scenario_hours, step_time_s, num_workers)
        parsed = parsed.merged(random_schedule(num_workers, steps, between_s, repair_s, step_time_s, seed))
    parsed.validate(num_workers, steps, microbatches)
    return parsed


def cut_connections() -> int:
    """Shut down every connected TCP socket of this process (its store tunnel and its gloo connections), as a cut
    network link would; returns how many. Linux only (/proc); elsewhere nothing is cut."""
    import os
    import socket

    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    num_cut = 0
    for name in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.getpeername()  # connected sockets only: a listener shut down makes gloo abort the process
                sock.shutdown(socket.SHUT_RDWR)
                num_cut += 1
        except OSError:
            pass  # a listening or never-connected socket
        finally:
            sock.close()
    return num_cut
