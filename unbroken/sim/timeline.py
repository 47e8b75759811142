"""The failure timeline of a simulated cluster (``unbroken.sim.simulate``): which replica goes down or comes
back when, the same for every policy. Pure Python + numpy.

Owns turning the scenario's [failures] into GPU events (per-GPU exponential MTBF with repairs after a fixed
or an exponential time, MeCeFO's scenarios from ``failures.SCENARIOS``, ReCoVer's evenly spread losses, a CSV
trace) and those into replica events through the spare pool: a replica is down while any of its GPUs is.
Each random process draws from its own seeded stream, the same numbers whatever the horizon, so a longer
horizon only adds events.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from unbroken.core.failures import SCENARIOS
from unbroken.sim.scenario import HOUR, Scenario, read_trace


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class Timeline:
    """Replica up/down events of one scenario, the same for every policy (sorted by time)."""

    times: np.ndarray
    replicas: np.ndarray
    up: np.ndarray  # True: the replica is whole again; False: it lost a GPU
    count_times: np.ndarray  # when the number of the job's working GPUs changed
    counts: np.ndarray  # that number from then on
    horizon_s: float  # events are complete up to here
    gpus: int
    gpu_failures: int

    @property
    def replica_failures(self) -> int:
        """Replicas taken down in the timeline: a GPU failure in a replica none of whose GPUs was down (a
        failure in a replica already down takes nothing more down)."""
        return int(np.count_nonzero(~self.up))

    def gpu_failures_until(self, t: float) -> int:
        """GPU failures at or before ``t``: each lowers the number of working GPUs by one."""
        drops = np.diff(self.counts, prepend=self.gpus) < 0
        return int(np.count_nonzero(drops & (self.count_times <= t)))

    def gpu_hours(self, t: np.ndarray | float) -> np.ndarray:
        """GPU-hours the job has held at time(s) ``t``: its working GPUs (the idle ones of a replica that
        lost one included; failed ones not, until repaired or replaced by a spare)."""
        starts = np.concatenate(([0.0], self.count_times))
        counts = np.concatenate(([self.gpus], self.counts)).astype(float)
        cumulative = np.concatenate(([0.0], np.cumsum(np.diff(starts) * counts[:-1])))
        i = np.searchsorted(starts, t, side="right") - 1
        return (cumulative[i] + counts[i] * (np.asarray(t) - starts[i])) / HOUR


def _gpu_events(sc: Scenario, horizon_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(times, gpus, is_fail) of every random and traced GPU event before ``horizon_s``. Each process has its
    own seeded stream and draws the same numbers whatever the horizon, so a longer horizon only adds events."""
    f, c = sc.failures, sc.cluster
    k, replicas = c.replica_gpus, c.replicas
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    mttr_s = f.repaired_after_s
    if f.mtbf_h > 0:
        rng = np.random.default_rng([f.seed, 1])
        repair_rng = np.random.default_rng([f.seed, 4])
        t = np.zeros(c.gpus)
        while True:
            t = t + rng.exponential(f.mtbf_h * HOUR, c.gpus)
            hit = np.flatnonzero(t < horizon_s)
            if hit.size == 0:
                break
            parts.append((t[hit], hit, np.ones(hit.size, dtype=bool)))
            if math.isinf(mttr_s):
                break
            # one draw per GPU and round, used or not, so that the draws do not depend on the horizon
            repair_s = repair_rng.exponential(mttr_s, c.gpus) if f.random_repair else np.full(c.gpus, mttr_s)
            parts.append((t[hit] + repair_s[hit], hit, np.zeros(hit.size, dtype=bool)))
            t = t + repair_s
    if f.scenario:
        between_h, repair_h = SCENARIOS[f.scenario]
        rng = np.random.default_rng([f.seed, 2])
        down_until = np.full(replicas, -math.inf)
        rows: list[tuple[float, int, bool]] = []
        t_s = 0.0
        while True:
            t_s += rng.exponential(between_h * HOUR)
            if t_s >= horizon_s:
                break
            alive = np.flatnonzero(down_until <= t_s)
            if alive.size <= 1:  # as failures.random_schedule: never the last replica standing
                continue
            victim = int(alive[rng.integers(alive.size)])
            down_until[victim] = t_s + repair_h * HOUR
            rows += [(t_s, victim * k, True), (t_s + repair_h * HOUR, victim * k, False)]
        if rows:
            times, gpus, fails = zip(*rows, strict=True)
            parts.append((np.array(times), np.array(gpus, dtype=np.int64), np.array(fails)))
    if f.lost_gpus:
        n = f.lost_gpus // k
        rng = np.random.default_rng([f.seed, 3])
        victims = rng.choice(replicas, n, replace=False)
        times = np.repeat(sc.run.hours * HOUR * np.arange(1, n + 1) / (n + 1), k)
        gpus = (victims[:, None] * k + np.arange(k)[None, :]).reshape(-1)
        parts.append((times, gpus, np.ones(gpus.size, dtype=bool)))
    if f.trace:
        parts.append(read_trace(f.trace, c.gpus))
    if not parts:
        return np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    times = np.concatenate([p[0] for p in parts])
    gpus = np.concatenate([p[1] for p in parts]).astype(np.int64)
    fails = np.concatenate([p[2] for p in parts]).astype(bool)
    keep = times < horizon_s
    order = np.lexsort((fails[keep], times[keep]))  # at equal times, repairs first
    return times[keep][order], gpus[keep][order], fails[keep][order]


def build_timeline(sc: Scenario, horizon_s: float) -> Timeline:
    """Replica events from the GPU events: a replica is down while any of its GPUs is. A failed GPU's place
    is taken by a spare, when one is free, ``spare_swap_s`` later; a repaired GPU whose place a spare took
    becomes a spare (and goes to the longest-waiting failed place, if any)."""
    c = sc.cluster
    times, gpus, fails = _gpu_events(sc, horizon_s)
    swap_s = sc.cost.spare_swap_s
    slot_down = np.zeros(c.gpus, dtype=bool)
    swapping: dict[int, float] = {}  # place -> when its spare is in
    waiting: list[int] = []  # failed places with no spare yet, oldest first
    down_count = np.zeros(c.replicas, dtype=np.int64)
    pool = c.spares
    num_down = failures = 0
    replica_events: list[tuple[float, int, bool]] = []
    count_events: list[tuple[float, int]] = []
    swaps: list[tuple[float, int]] = []  # heap of (time, place)

    def change(t: float, g: int, up: bool) -> None:
        nonlocal num_down
        r = g // c.replica_gpus
        slot_down[g] = not up
        num_down += -1 if up else 1
        down_count[r] += -1 if up else 1
        count_events.append((t, c.gpus - num_down))
        if down_count[r] == (0 if up else 1):
            replica_events.append((t, r, up))

    def use_spare(t: float) -> None:
        nonlocal pool
        while pool > 0 and waiting:
            g = waiting.pop(0)
            pool -= 1
            swapping[g] = t + swap_s
            heapq.heappush(swaps, (t + swap_s, g))

    i = 0
    while i < len(times) or swaps:
        if swaps and (i == len(times) or swaps[0][0] <= times[i]):
            t, g = heapq.heappop(swaps)
            if swapping.get(g) == t:
                del swapping[g]
                change(t, g, up=True)
            continue
        t, g, fail = float(times[i]), int(gpus[i]), bool(fails[i])
        i += 1
        if fail and not slot_down[g]:
            failures += 1
            change(t, g, up=False)
            waiting.append(g)
            use_spare(t)
        elif not fail and slot_down[g]:
            if g in swapping:  # repaired before its spare was in: the spare goes back to the pool
                del swapping[g]
                pool += 1
            if g in waiting:
                waiting.remove(g)
            change(t, g, up=True)
            use_spare(t)
        elif not fail and c.spares:
            pool = min(c.spares, pool + 1)  # a spare took its place: the repaired GPU is a spare now
            use_spare(t)
    ordered = sorted(replica_events, key=lambda e: e[0])  # swaps and repairs interleave in time
    return Timeline(
        np.array([e[0] for e in ordered], dtype=float),
        np.array([e[1] for e in ordered], dtype=np.int64),
        np.array([e[2] for e in ordered], dtype=bool),
        np.array([e[0] for e in count_events], dtype=float),
        np.array([e[1] for e in count_events], dtype=np.int64),
        horizon_s,
        c.gpus,
        failures,
    )


def failure_rate_per_s(sc: Scenario) -> float:
    """The cluster's mean rate of random failures (upper bound: every GPU up)."""
    rate = sc.cluster.gpus / (sc.failures.mtbf_h * HOUR) if sc.failures.mtbf_h > 0 else 0.0
    if sc.failures.scenario:
        rate += 1.0 / (SCENARIOS[sc.failures.scenario][0] * HOUR)
    return rate
