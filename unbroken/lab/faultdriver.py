"""The outside fault driver of ``unbroken chaos --mode random-time``: faults at random instants, not at named points.

A separate process, seeded, that watches a running ``unbroken train`` from outside and, at uniformly random
wall-clock moments, sends ``SIGKILL`` to a worker, or ``SIGSTOP`` and ``SIGCONT`` some seconds later, to a
random worker (worker 0, the usual leader, included), sometimes to two at once. It knows nothing of the
run's code: it finds the worker processes among the launcher's children (their environment names their
worker id) and reads the latest membership from the run's metrics, only to spare one running member of the
newest epoch (a cluster never loses every copy of the training state at once); a fault due before the first
epoch is delivered as soon as there is one. Every fault delivered is
appended to a JSON-lines log the campaign counts.

    python -m unbroken.lab.faultdriver --launcher-pid PID --run-dir DIR --seed S --duration 40 --faults 5 --log F
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from unbroken.core.records import RecordKind, read_records

WORKER_ID_ENV = b"UNBROKEN_WORKER_ID="
STOP_RANGE_S = (0.2, 4.0)  # SIGSTOP lengths: below and beyond the default heartbeat timeout (2 s)
BOTH_AT_ONCE = 0.25  # share of faults that hit two workers at the same moment
KILL_SHARE = 0.6


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


def _state(pid: int) -> str:
    """The process state letter (R, S, T for stopped, Z for zombie), or "" if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def worker_processes(launcher_pid: int) -> dict[int, int]:
    """Worker id -> pid of the launcher's worker children that are running (not stopped, not exited)."""
    out: dict[int, int] = {}
    for pid in _children(launcher_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ids = [e[len(WORKER_ID_ENV) :] for e in env if e.startswith(WORKER_ID_ENV)]
        if ids and _state(pid) in ("R", "S", "D"):
            out[int(ids[0])] = pid
    return out


def latest_members(run_dir: Path) -> list[int]:
    memberships = read_records(run_dir, RecordKind.MEMBERSHIP)
    return list(memberships[-1]["members"]) if memberships else []


def choose_victims(rng: random.Random, running: dict[int, int], members: list[int], wanted: int) -> list[int]:
    """Up to ``wanted`` running workers, leaving at least one running member of the newest epoch untouched."""
    keepers = [w for w in members if w in running]
    if not keepers:
        return []  # nobody holding the state is running right now: wait for the next fault
    spared = rng.choice(keepers)
    candidates = [w for w in running if w != spared]
    rng.shuffle(candidates)
    return sorted(candidates[:wanted])


def drive(launcher_pid: int, run_dir: Path, seed: int, duration_s: float, count: int, log_path: Path) -> int:
    """Deliver the planned faults while the launcher lives; returns how many workers were hit."""
    rng = random.Random(seed + 1_000_003)
    faults = plan_faults(seed, duration_s, count)
    resume: list[tuple[float, int]] = []  # (when, pid) to SIGCONT
    t0 = time.monotonic()
    delivered = 0
    hit: set[int] = set()  # pids killed
    with open(log_path, "a", buffering=1) as log:
        for fault in faults:
            while time.monotonic() < t0 + fault.at_s:
                resume = _continue_due(resume)
                time.sleep(0.01)
            # A fault due before the job formed its first group waits for it: until then nobody holds the
            # training state to spare, and on a loaded machine start-up can take most of the window.
            members = latest_members(run_dir)
            while not members and _state(launcher_pid) not in ("", "Z"):
                resume = _continue_due(resume)
                time.sleep(0.05)
                members = latest_members(run_dir)
            if _state(launcher_pid) in ("", "Z"):
                break
            # Processes killed already are not running, whatever /proc says yet, and the membership record may
            # lag behind: faults delivered back to back must not take the last copy of the state.
            running = {w: p for w, p in worker_processes(launcher_pid).items() if p not in hit}
            for w in choose_victims(rng, running, members, fault.victims):
                pid = running[w]
                os.kill(pid, signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
                if fault.kind == "kill":
                    hit.add(pid)
                if fault.kind == "stop":
                    resume.append((time.monotonic() + fault.stop_s, pid))
                delivered += 1
                entry = {"time": time.time(), "kind": fault.kind, "worker": w, "pid": pid, "at_s": fault.at_s}
                log.write(json.dumps({**entry, "stop_s": fault.stop_s if fault.kind == "stop" else 0.0}) + "\n")
        while resume:
            resume = _continue_due(resume)
            time.sleep(0.01)
    return delivered


def _continue_due(resume: list[tuple[float, int]]) -> list[tuple[float, int]]:
    now, left = time.monotonic(), []
    for when, pid in resume:
        if when <= now:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        else:
            left.append((when, pid))
    return left


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
