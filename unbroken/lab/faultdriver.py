"""The outside fault driver of ``unbroken chaos --mode random-time``: faults at random instants, not at named points.

A separate process, seeded, that watches a running ``unbroken train`` from outside and, at uniformly random
wall-clock moments, sends ``SIGKILL`` to a worker, or ``SIGSTOP`` and ``SIGCONT`` some seconds later, to a
random worker (worker 0, the usual leader, included), sometimes to two at once. It knows nothing of the
run's code: it finds the worker processes among the launcher's children (their environment names their
worker id) and reads the memberships and commits from the run's metrics, only to spare one running worker that
holds the training state (a cluster never loses every copy of the training state at once); a fault due before
the first epoch is delivered as soon as there is one. With replicas of several ranks (the run's config.toml,
``[parallel]``) a whole replica is spared: a replica holds the state only while every one of its ranks runs.
With warm spares (``unbroken train --spares``) a spare that took a dead worker's place is that worker (the
agent's ``spare`` records name its process), and a fault may hit a spare still waiting instead (``SPARE_SHARE``).
Every fault delivered is appended to a JSON-lines log (with the wall-clock time its signal was sent) that the campaign
counts and measures each detection from.

    python -m unbroken.lab.faultdriver --launcher-pid PID --run-dir DIR --seed S --duration 40 --faults 5 --log F
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.control.host.zygote import worker_of
from unbroken.core.config import load_config
from unbroken.core.layout import ReplicaLayout
from unbroken.core.records import RecordKind, SpareState, read_records

STOP_RANGE_S = (0.2, 4.0)  # SIGSTOP lengths: below and beyond the default heartbeat timeout (2 s)
BOTH_AT_ONCE = 0.25  # share of faults that hit two workers at the same moment
KILL_SHARE = 0.6
# A worker stopped this long may be declared dead (the campaign runs with the default heartbeat timeout, 2 s, and
# a loaded machine adds delays of its own): once continued it may no longer hold the training state, so it is
# never the worker a fault spares.
MAY_BE_EVICTED_S = 1.0
SPARE_SHARE = 0.25  # share of faults that hit a waiting spare, while one waits


@dataclass(frozen=True)
class Fault:
    at_s: float  # seconds after the driver starts
    kind: str  # "kill" or "stop"
    victims: int  # how many workers at once
    stop_s: float  # for "stop": how long before SIGCONT


def plan_faults(seed: int, duration_s: float, count: int) -> list[Fault]:
    """``count`` faults at uniformly random instants of ``[0, duration_s]``, a pure function of ``seed``."""
    rng = random.Random(seed)
    faults = [
        Fault(
            rng.uniform(0.0, duration_s),
            "kill" if rng.random() < KILL_SHARE else "stop",
            2 if rng.random() < BOTH_AT_ONCE else 1,
            rng.uniform(*STOP_RANGE_S),
        )
        for _ in range(count)
    ]
    return sorted(faults, key=lambda f: f.at_s)


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def process_state(pid: int) -> str:
    """The process state letter (R, S, T for stopped, Z for zombie), or "" if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def worker_processes(launcher_pid: int, promoted: dict[int, Promotion] | None = None) -> dict[int, int]:
    """Worker id -> pid of the launcher's worker children that are running (not stopped, not exited);
    ``promoted`` (``spare_processes``): the spares that took a worker's place."""
    out: dict[int, int] = {}
    for pid in _children(launcher_pid):
        worker = worker_of(pid)
        if worker is None and promoted is not None and pid in promoted:
            worker = promoted[pid].worker
        if worker is not None and process_state(pid) in ("R", "S", "D"):
            out[worker] = pid
    return out


@dataclass(frozen=True)
class Promotion:
    """A spare's process that took a dead worker's place (the agent's ``spare`` record)."""

    worker: int
    time: float  # when the agent gave it the worker's id (wall clock)


def spare_processes(records: list[dict[str, Any]]) -> tuple[dict[int, Promotion], dict[int, int]]:
    """From the agent's ``spare`` records among the run's ``records``: the spares promoted (pid -> its promotion)
    and those still waiting (pid -> spare index; some may have exited since)."""
    started: dict[int, int] = {}
    promoted: dict[int, Promotion] = {}
    for record in records:
        if record["type"] != RecordKind.SPARE:
            continue
        if record["state"] == SpareState.STARTED:
            started[record["pid"]] = record["spare"]
        elif record["state"] == SpareState.PROMOTED:
            promoted[record["pid"]] = Promotion(record["worker"], record["time"])
    return promoted, {pid: k for pid, k in started.items() if pid not in promoted}


def state_holders(records: list[dict[str, Any]]) -> dict[int, float]:
    """The members of the newest recorded epoch that hold the training state, from the run's ``records``, each
    with the time of the epoch's membership record that gave it the state.

    Every member of a ``start`` epoch builds the same initial state, and every member of an epoch in which a
    step was committed took part in that step. A worker that joined since is receiving the state, or about
    to: until a step commits with it, the state lives only in the members it joined (seeds 12031 and 12032:
    the one worker holding the state was hit while a joiner was still receiving it from that worker). A worker
    id names a process only since it became that worker (``became_worker_at``): the metrics lag behind, and a
    process that took a dead worker's id holds nothing of an epoch formed before it had the id."""
    holders: dict[int, float] = {}
    newest: tuple[int, list[int], float] | None = None  # (epoch, members, its record's time)
    for record in records:
        if record["type"] == RecordKind.MEMBERSHIP:
            members = list(record["members"])
            if newest is None or record["reason"] == "start":
                holders = dict.fromkeys(members, record["time"])
            else:
                holders = {w: t for w, t in holders.items() if w in members}
            newest = (record["epoch"], members, record["time"])
        elif record["type"] == RecordKind.STEP and newest is not None and record["epoch"] == newest[0]:
            if record["committed"]:
                holders = dict.fromkeys(newest[1], newest[2])
    return holders


def started_at(pid: int) -> float | None:
    """When process ``pid`` started (wall clock, to about 10 ms), or None if it is gone."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def became_worker_at(pid: int, promoted: dict[int, Promotion]) -> float:
    """When process ``pid`` became the worker it is: its promotion for a spare, else its start (inf if gone)."""
    if pid in promoted:
        return promoted[pid].time
    start = started_at(pid)
    return math.inf if start is None else start


def holders_running(holders: dict[int, float], running: dict[int, int], promoted: dict[int, Promotion]) -> list[int]:
    """Of ``holders`` (``state_holders``), the workers whose running process is the one the state was given to:
    it had the worker's id before the epoch that gave it the state was formed."""
    return sorted(w for w, t in holders.items() if w in running and became_worker_at(running[w], promoted) < t)


def run_layout(run_dir: Path) -> ReplicaLayout:
    """The run's replicas (its resolved config.toml's ``[parallel]``)."""
    cfg = load_config(run_dir / "config.toml")
    return ReplicaLayout.of(cfg.parallel)


def choose_victims(
    rng: random.Random,
    running: dict[int, int],
    keepers: list[int],
    wanted: int,
    layout: ReplicaLayout | None = None,
) -> list[int]:
    """Up to ``wanted`` running workers, leaving one of ``keepers`` (running members holding the state) untouched,
    and with replicas of several ranks every rank of its replica (only a whole replica holds the state)."""
    layout = layout or ReplicaLayout()
    whole = [w for w in keepers if all(m in keepers for m in layout.workers_of(layout.replica_of(w)))]
    if not whole:
        return []  # nobody holding the state is running right now: wait for the next fault
    spared = layout.replica_of(rng.choice(whole))
    candidates = [w for w in running if layout.replica_of(w) != spared]
    rng.shuffle(candidates)
    return sorted(candidates[:wanted])


class Victims:
    """Which workers a fault may hit, given what the driver has done already.

    ``/proc`` and the membership record both lag behind the driver's own signals: a process just sent
    ``SIGKILL`` or ``SIGSTOP`` can still read as running, and a dead member stays in the newest membership
    until the group re-forms. Faults delivered back to back (those that waited for the first epoch all fire at
    once) would then take the last running copy of the state, so the driver counts every worker it killed, and
    every one it stopped until it sends ``SIGCONT``, as not running, whatever ``/proc`` says yet; and so every spare
    it hit (a spare killed twice, or stopped again while stopped, was counted as two faults)."""

    def __init__(self) -> None:
        self.killed: set[int] = set()  # pids
        self.stopped: dict[int, float] = {}  # pid -> monotonic time of its SIGCONT
        self.maybe_evicted: set[int] = set()  # pids stopped for MAY_BE_EVICTED_S or longer

    def untouched(self, pid: int) -> bool:
        """Neither killed by this driver nor held stopped by it, whatever ``/proc`` says yet."""
        return pid not in self.killed and pid not in self.stopped

    def running(self, seen: dict[int, int]) -> dict[int, int]:
        """``seen`` (worker id -> pid, from ``/proc``) less the workers this driver has killed or holds stopped."""
        return {w: p for w, p in seen.items() if self.untouched(p)}

    def waiting(self, spares: dict[int, int]) -> dict[int, int]:
        """Of ``spares`` (pid -> spare index, from the records), those a fault may hit: running, and not hit by this
        driver already (a spare just killed can still read as running; it was hit again and counted twice)."""
        return {pid: k for pid, k in spares.items() if process_state(pid) in ("R", "S", "D") and self.untouched(pid)}

    def holding_state(self, holders: list[int], running: dict[int, int]) -> list[int]:
        """Of the workers that held the training state when last recorded, those that still may."""
        return [w for w in holders if w in running and running[w] not in self.maybe_evicted]

    def hit(self, pid: int, kind: str, stop_s: float, now: float) -> None:
        if kind == "kill":
            self.killed.add(pid)
            return
        self.stopped[pid] = now + stop_s
        if stop_s >= MAY_BE_EVICTED_S:
            self.maybe_evicted.add(pid)

    def resume_due(self, now: float) -> list[int]:
        """The stopped pids whose ``SIGCONT`` is due at ``now`` (and forgets them)."""
        due = [pid for pid, when in self.stopped.items() if when <= now]
        for pid in due:
            del self.stopped[pid]
        return due


def drive(launcher_pid: int, run_dir: Path, seed: int, duration_s: float, count: int, log_path: Path) -> int:
    """Deliver the planned faults while the launcher lives; returns how many workers were hit."""
    rng = random.Random(seed + 1_000_003)
    faults = plan_faults(seed, duration_s, count)
    layout: ReplicaLayout | None = None  # read once the run has a membership (its config.toml is written)
    victims = Victims()
    t0 = time.monotonic()
    delivered = 0
    with open(log_path, "a", buffering=1) as log:
        for fault in faults:
            while time.monotonic() < t0 + fault.at_s:
                _continue(victims.resume_due(time.monotonic()))
                time.sleep(0.01)
            # A fault due before the job formed its first group waits for it: until then nobody holds the
            # training state to spare, and on a loaded machine start-up can take most of the window.
            records = read_records(run_dir)
            holders = state_holders(records)
            while not holders and process_state(launcher_pid) not in ("", "Z"):
                _continue(victims.resume_due(time.monotonic()))
                time.sleep(0.05)
                records = read_records(run_dir)
                holders = state_holders(records)
            if process_state(launcher_pid) in ("", "Z"):
                break
            layout = layout or run_layout(run_dir)
            promoted, waiting = spare_processes(records)
            waiting = victims.waiting(waiting)
            if waiting and rng.random() < SPARE_SHARE:
                pid = rng.choice(sorted(waiting))
                targets = [(pid, {"spare": waiting[pid]})]
            else:
                running = victims.running(worker_processes(launcher_pid, promoted))
                keepers = victims.holding_state(holders_running(holders, running, promoted), running)
                chosen = choose_victims(rng, running, keepers, fault.victims, layout)
                targets = [(running[w], {"worker": w}) for w in chosen]
            for pid, target in targets:
                sent = time.time()  # taken before the signal: whatever notices it comes after
                os.kill(pid, signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
                victims.hit(pid, fault.kind, fault.stop_s, time.monotonic())
                delivered += 1
                entry = {"time": sent, "kind": fault.kind, **target, "pid": pid, "at_s": fault.at_s}
                log.write(json.dumps({**entry, "stop_s": fault.stop_s if fault.kind == "stop" else 0.0}) + "\n")
        while victims.stopped:
            _continue(victims.resume_due(time.monotonic()))
            time.sleep(0.01)
    return delivered


def _continue(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m unbroken.lab.faultdriver", description=__doc__.split("\n")[0])
    parser.add_argument("--launcher-pid", type=int, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--duration", type=float, required=True, help="seconds over which the faults are spread")
    parser.add_argument("--faults", type=int, required=True)
    parser.add_argument("--log", type=Path, required=True)
    a = parser.parse_args()
    drive(a.launcher_pid, a.run_dir, a.seed, a.duration, a.faults, a.log)


if __name__ == "__main__":
    main()
