"""The chaos campaign behind ``unbroken chaos``: many short real runs with seeded random faults, each checked
against the invariants a fault-tolerant run must keep; and the churn run that measures leaks.

Two modes. ``named`` (the default): each trial's faults are failure-schedule events at the code's named
points (a phase of a step, while receiving the state, during a checkpoint). ``random-time``: an outside
process (``lab.faultdriver``) sends SIGKILL, or SIGSTOP then SIGCONT, to random workers (worker 0 included,
sometimes two at once) at uniformly random instants, so faults land anywhere: inside a gloo send, a store
write, between two parameter updates; killed and excluded workers are restarted after ``RANDOM_MTTR_S``.

Owns fault campaigns, not fault mechanics: every fault goes through the failure-schedule grammar and the
launcher's injection (``failures``, ``launcher``), on real processes with real signals. A trial is fully
determined by its seed (``unbroken chaos --seed S --trials 1`` reproduces trial S). Each run is compared
with one failure-free reference run of the same configuration in exact-reduction mode.

Invariants checked after every run (a violation names the trial's seed); none depends on the machine's speed:
  finished      the run exited 0 and published its final record, and never went longer without committing a step
                than its configured timeouts allow (``hang_bound_s``: past it the run is hung, and stopped)
  no crash      every failure was one the campaign caused (a SIGKILL, a lost heartbeat, a worker that left when
                it was cut off or excluded), never a worker ending by itself: an abort (gloo's on a collective
                mismatch), another signal, an exception raised; nor a warm spare while it waited
  counted once  every step 0..N-1 was committed, and each committed step counted each of its M microbatches
                exactly once and dropped none (the reduced count vector, recorded in the step's metrics)
  identical     every live worker ended with the same parameters (the final checksum record)
  reference     the final parameters, every step's loss and the final checkpoint (parameters, optimizer state, the
                exact mode's scale) equal the failure-free run's, bit for bit
  checkpoints   every checkpoint with a manifest verifies (size, sha256, loads); partial files are ignored

Measured, not checked (they depend on the machine and its load): each failure's detection, from the fault to the
coordinator's decision (a named fault: from the launcher's delivery to the failure record; an outside one: from the
driver's signal to the epoch record that removed the worker, ``outside_detections``), and the longest wait between
two commits; the summary prints the slowest of each, ``chaos.json`` holds every detection.

With replicas of several ranks (``--parallel.shard`` / ``--parallel.pipeline`` among the overrides) the faults
hit ranks, the last replica is never touched, a double kill may take a whole replica, and each worker's
final checksum is compared with the reference's rank of the same index (a rank holds its shard).

With warm spares (``--spares N``, every run of the campaign, the reference too) a dead worker's place is taken by
a spare rather than by a restart; in ``random-time`` the driver also hits the promoted spares (they are workers
now) and the spares still waiting. The invariants are the same.

``--dry-run`` (both kinds) checks the arguments, plans a named campaign's trials and says in one line what would
run, starting nothing.

The churn run (``unbroken chaos --churn 50``) makes workers die and rejoin, in three rounds, until the membership
changed that many times, and samples, from /proc, the memory (RSS), threads, open file descriptors and sockets of
the coordinator and of a worker that lives through all of it, at rest after each round (``Churn``); it fails if a
resource grew with each round (``leaks``).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.control.host.spares import check_spares
from unbroken.control.host.zygote import worker_of
from unbroken.control.member.news import NEWS_WAIT_S
from unbroken.control.store.connect import exit_code_in, raised_headline
from unbroken.core.config import CommConfig, load_config
from unbroken.core.exits import EXIT_STOPPED
from unbroken.core.failures import STEP_PHASES, FailureSchedule
from unbroken.core.layout import ReplicaLayout
from unbroken.core.records import RecordKind, SpareState, read_records
from unbroken.ft.checkpoint import schema as ckpt
from unbroken.lab.faultdriver import worker_processes

KINDS = (
    "kill",
    "double-kill",
    "pause",
    "hang",
    "slow",
    "cut",
    "kill-while-receiving",
    "kill-during-checkpoint",
    "kill-during-optimizer",
)
CHECKPOINT_EVERY = 5
HEARTBEAT_TIMEOUT_S = 2.0
# How a worker's process may end in a trial: killed (by the schedule, the fault driver, or the launcher after its
# hang), or leaving by itself when it was cut off or excluded (a paused worker declared dead).
CAUSED_EXITS = frozenset({-signal.SIGKILL, EXIT_STOPPED})


@dataclass
class Trial:
    """One run's faults: the schedule, and which campaign fault each event belongs to."""

    seed: int
    events: list[str]
    labels: dict[str, str]  # event text -> fault kind (KINDS)
    primary: str

    @property
    def schedule(self) -> str:
        return "; ".join(self.events)


def make_trial(seed: int, workers: int, steps: int, layout: ReplicaLayout | None = None) -> Trial:
    """The faults of trial ``seed``: its primary kind is ``KINDS[seed % len(KINDS)]``, plus 0-2 random
    others. The last worker (the last replica) is never touched, so someone always holds the state; every fault
    rejoins."""
    layout = layout or ReplicaLayout()
    assert steps >= 12 and (workers >= 3 if layout.size == 1 else layout.replicas_in(workers) >= 2)
    rng = random.Random(seed)
    primary = KINDS[seed % len(KINDS)]
    kinds = [primary] + [rng.choice(KINDS) for _ in range(rng.randint(0, 2))]
    victims = list(range(workers - layout.size))
    busy: dict[int, list[int]] = {}  # worker -> steps it has faults at (kept apart so each can fire)
    events: list[str] = []
    labels: dict[str, str] = {}

    def free(worker: int, step: int) -> bool:
        return all(abs(step - s) >= 6 for s in busy.get(worker, []))

    def add(text: str, label: str, worker: int, step: int) -> None:
        events.append(text)
        labels[text] = label
        busy.setdefault(worker, []).append(step)

    # Early enough that a killed worker (about 3-5 s to restart here) can rejoin before the run ends (on a fast
    # machine with a pace: ``pace_event``).
    last = max(3, int(steps * 0.5))
    for kind in kinds:
        for _attempt in range(20):
            step = rng.randint(2, last // 2 if kind == "kill-while-receiving" else last)
            worker = 0 if kind == "kill-during-checkpoint" else rng.choice(victims)
            if free(worker, step):
                break
        else:
            continue
        phase = rng.choice(STEP_PHASES)
        rejoin = f"rejoin={rng.uniform(0.2, 2.0):.1f}"
        if kind == "kill":
            add(f"kill:worker={worker},step={step},phase={phase},{rejoin}", kind, worker, step)
        elif kind == "kill-during-optimizer":
            add(f"kill:worker={worker},step={step},phase=optimizer,{rejoin}", kind, worker, step)
        elif kind == "kill-during-checkpoint":
            add(f"kill:worker={worker},step={step},phase=checkpoint,{rejoin}", kind, worker, step)
        elif kind == "double-kill":
            others = [w for w in victims if w != worker and free(w, step)]
            if not others:
                continue
            second = rng.choice(others)
            for w in (worker, second):
                add(f"kill:worker={w},step={step},phase={phase},{rejoin}", kind, w, step)
        elif kind == "kill-while-receiving":
            add(f"kill:worker={worker},step={step},phase={phase},{rejoin}", "kill", worker, step)
            add(f"kill:worker={worker},step={step},phase=receive,{rejoin}", kind, worker, step)
        elif kind == "pause":
            seconds = rng.uniform(0.2, 2.0 * HEARTBEAT_TIMEOUT_S)
            add(f"pause:worker={worker},step={step},phase={phase},seconds={seconds:.1f},{rejoin}", kind, worker, step)
        elif kind == "hang":
            add(f"hang:worker={worker},step={step},phase={phase},{rejoin}", kind, worker, step)
        elif kind == "cut":
            add(f"cut:worker={worker},step={step},phase={phase},{rejoin}", kind, worker, step)
        elif kind == "slow":
            end = min(steps - 1, step + rng.randint(3, 10))
            add(f"slow:worker={worker},factor={rng.randint(2, 6)},steps={step}-{end}", kind, worker, step)
    # Normalise the texts the way the launcher reports them (describe()), so injections map to labels.
    schedule = FailureSchedule.parse("; ".join(events))
    schedule.validate(workers, steps)
    normalised = [e.describe() for e in schedule.events]
    return Trial(seed, normalised, {n: labels[t] for n, t in zip(normalised, events, strict=True)}, primary)


@dataclass
class Reference:
    losses: dict[int, float]
    checksums: dict[int, str]  # rank index in a replica -> its final checksum (index 0 only for one-rank replicas)
    wall_s: float
    run_dir: Path
    layout: ReplicaLayout = field(default_factory=ReplicaLayout)
    pace_s: float = 0.0  # the pace of the reference and of every trial compared with it (``pace_event``)
    spares: int = 0  # warm spares beside the workers, in the reference and in every trial compared with it

    @classmethod
    def of_run(
        cls, run_dir: Path, layout: ReplicaLayout, wall_s: float, pace_s: float = 0.0, spares: int = 0
    ) -> Reference:
        """The reference a finished failure-free run in ``run_dir`` makes (its losses and final checksums)."""
        final = read_records(run_dir, RecordKind.FINAL)
        losses = {r["step"]: r["loss"] for r in read_records(run_dir, RecordKind.STEP)}
        checksums = {layout.rank_of(int(w)): digest for w, digest in final[-1]["checksums"].items()}
        return cls(losses, checksums, wall_s, run_dir, layout, pace_s, spares)


@dataclass
class Outcome:
    trial: Trial
    code: int | None  # None: hung (``hang_bound_s``), and stopped
    wall_s: float
    injected: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    max_detection_s: float = 0.0
    max_stall_s: float = 0.0
    leftovers: int = 0
    promoted: int = 0  # warm spares that took a dead worker's place
    hang_bound_s: float = 0.0  # the run was hung had it gone this long without committing a step
    outside: list[dict[str, Any]] = field(default_factory=list)  # the faults the outside driver delivered (its log)
    detections: list[dict[str, Any]] = field(default_factory=list)  # each failure detected: worker, fault, seconds


def pace_event(workers: int, steps: int, seconds: float) -> str:
    """The schedule event that paces a run (empty for 0): the last worker computes each microbatch ``seconds``
    slower at every step, and in exact mode every step waits for it. A named campaign never faults that worker;
    a random-time one may (its outside driver picks any worker), and a restarted last worker is paced again. A restart
    takes seconds whatever the machine (the rejoin delay, then a process start), while steps take less the faster
    the machine: unpaced, an idle machine can finish the run before a killed worker is back, and the faults
    planned after its return never fire."""
    return f"slow:worker={workers - 1},seconds={seconds:g},steps=0-{steps - 1}" if seconds > 0 else ""


def _fixed_overrides(steps: int) -> list[str]:
    """The settings every run of a campaign has (the user's overrides come after them)."""
    return [
        "--recovery.reduction=exact",
        f"--train.steps={steps}",
        f"--checkpoint.every={CHECKPOINT_EVERY}",
        f"--comm.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}",
    ]


def _train_cmd(
    config: str,
    out: Path,
    workers: int,
    steps: int,
    overrides: list[str],
    schedule: str,
    pace_s: float,
    spares: int = 0,
) -> list[str]:
    schedule = "; ".join(e for e in (schedule, pace_event(workers, steps, pace_s)) if e)
    cmd = [sys.executable, "-m", "unbroken", "train", config, "--workers", str(workers), "--out", str(out)]
    if spares:
        cmd += ["--spares", str(spares)]
    cmd += ["--quiet", *_fixed_overrides(steps), *overrides]
    if schedule:
        cmd.append(f"--failures.schedule={schedule}")
    return cmd


def hang_bound_s(comm: CommConfig) -> float:
    """How long a run may go without committing a step (from its start, between two steps, from its last step to its
    exit) before it is hung, from its configured timeouts alone: every wait of the protocol ends within its timeout
    (the coordinator waits ``join_timeout_s`` for the workers at the start, a collective ``op_timeout_s`` before the
    coordinator decides), and a worker that fell silent is declared dead within ``heartbeat_timeout_s``. There is no
    slack for computing: a run whose steps alone took longer would be reported hung."""
    return max(comm.join_timeout_s, comm.op_timeout_s) + comm.heartbeat_timeout_s


def _bound(config: str, steps: int, overrides: list[str]) -> float:
    return hang_bound_s(load_config(config, [*_fixed_overrides(steps), *overrides]).comm)


WATCH_POLL_S = 0.5  # how often a run's metrics are read for a new commit


def _progress(run_dir: Path) -> tuple[int, int]:
    """What a run has done so far: its step records and its final records."""
    records = read_records(run_dir)
    return sum(r["type"] == RecordKind.STEP for r in records), sum(r["type"] == RecordKind.FINAL for r in records)


def watch(proc: subprocess.Popen[Any], run_dir: Path, bound_s: float) -> int | None:
    """Wait for the run ``proc`` writes into ``run_dir``: its exit status, or None once it has gone ``bound_s``
    (``hang_bound_s``) without a new step record (or, after the last, its final record or its exit): it is hung,
    and stopped (Ctrl-C, so the launcher stops what it started; then SIGKILL)."""
    seen, since = _progress(run_dir), time.monotonic()
    while proc.poll() is None:
        time.sleep(WATCH_POLL_S)
        now = _progress(run_dir)
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since > bound_s:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return None
    return proc.returncode


def _run(cmd: list[str], run_dir: Path, bound_s: float) -> tuple[int | None, float]:
    """Run ``cmd`` (a run into ``run_dir``) to its end, or until it is hung (``watch``): (its exit status or None,
    seconds)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return watch(proc, run_dir, bound_s), time.monotonic() - t0


def reference_run(
    config: str, out: Path, workers: int, steps: int, overrides: list[str], pace_s: float = 0.0, spares: int = 0
) -> Reference:
    """The failure-free run every trial is compared with, paced as its trials are (``pace_event``) and with their
    spares."""
    cmd = _train_cmd(config, out, workers, steps, overrides, "", pace_s, spares)
    code, wall = _run(cmd, out, _bound(config, steps, overrides))
    if code != 0 or not read_records(out, RecordKind.FINAL):
        raise RuntimeError(f"the failure-free reference run failed (exit {code}); see {out / 'logs'}")
    return Reference.of_run(out, _layout(config, overrides), wall, pace_s, spares)


def check_run(run_dir: Path, outcome: Outcome, ref: Reference, steps: int, microbatches: int) -> None:
    """Fill ``outcome`` with what was injected, what was measured (detections, waits between commits) and every
    invariant the run broke (see the module doc)."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for r in read_records(run_dir):
        by_kind.setdefault(str(r.get("type")), []).append(r)
    v = outcome.violations
    if outcome.code is None:
        v.append(f"hang: no step committed for {outcome.hang_bound_s:.0f} s (the longest wait its timeouts allow)")
    elif outcome.code != 0:
        v.append(f"exit status {outcome.code}")
    _count_injected(outcome, by_kind)
    final = by_kind.get(RecordKind.FINAL, [])
    v += _final_violations(final, ref)
    v += _crashes(by_kind)
    v += _step_violations(by_kind.get(RecordKind.STEP, []), ref, steps, microbatches)
    problems, leftovers = ckpt.verify_all(run_dir)
    v += [f"damaged checkpoint {p}" for p in problems]
    outcome.leftovers = len(leftovers)
    if final:
        v += _final_checkpoint_differences(run_dir, ref.run_dir, steps)
    _measure(outcome, by_kind)


def _count_injected(outcome: Outcome, by_kind: dict[str, list[dict[str, Any]]]) -> None:
    """The faults that fired, by kind (a slow fault fired if a step it slows was committed); spares promoted."""
    for r in by_kind.get(RecordKind.INJECTED, []):
        outcome.injected[outcome.trial.labels.get(r["event"], "other")] += 1
    committed = {r["step"] for r in by_kind.get(RecordKind.STEP, [])}
    for text, label in outcome.trial.labels.items():
        if label == "slow":
            first, last = (int(x) for x in text.rsplit("=", 1)[1].split("-"))
            if any(first <= s <= last for s in committed):
                outcome.injected[label] += 1
    outcome.promoted = sum(r["state"] == SpareState.PROMOTED for r in by_kind.get(RecordKind.SPARE, []))


def _final_violations(final: list[dict[str, Any]], ref: Reference) -> list[str]:
    if not final:
        return ["the run did not finish (no final record)"]
    v = []
    checksums = final[-1]["checksums"]
    if not final[-1]["identical"]:
        v.append(f"live workers hold different parameters: {checksums}")
    if any(digest != ref.checksums.get(ref.layout.rank_of(int(w))) for w, digest in checksums.items()):
        v.append("final parameters differ from the failure-free reference")
    return v


def _crashes(by_kind: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Workers, and spares while they waited, that ended by themselves (not by a fault the campaign caused)."""
    v = []
    for f in by_kind.get(RecordKind.FAILURE, []):
        why = str(f["why"])
        code = exit_code_in(why)
        if raised_headline(why) is not None or (code is not None and code not in CAUSED_EXITS):
            v.append(f"worker {f['worker']} crashed: {why}")
    for r in by_kind.get(RecordKind.SPARE, []):
        if r["state"] == SpareState.EXITED and exit_code_in(str(r["why"])) not in CAUSED_EXITS:
            v.append(f"spare {r['spare']} crashed while it waited: {r['why']}")
    return v


def _step_violations(records: list[dict[str, Any]], ref: Reference, steps: int, microbatches: int) -> list[str]:
    """Steps never committed, microbatches not counted exactly once (or dropped), losses not the reference's."""
    v = []
    missing = sorted(set(range(steps)) - {r["step"] for r in records})
    if missing:
        v.append(f"steps never committed: {missing[:10]}")
    for r in records:
        if "counted" in r and (r["counted"] != microbatches or not r["counted_once"] or r["dropped"]):
            v.append(
                f"step {r['step']}: microbatches counted {r['counted']} of {microbatches} "
                f"(once each: {r['counted_once']}, dropped: {r['dropped']})"
            )
        if r["step"] in ref.losses and r["loss"] != ref.losses[r["step"]]:
            v.append(f"step {r['step']}: loss {r['loss']!r} != failure-free {ref.losses[r['step']]!r}")
    return v


def _measure(outcome: Outcome, by_kind: dict[str, list[dict[str, Any]]]) -> None:
    """Each failure's detection (a named fault's from its record, an outside one's from the driver's log) and the
    longest wait between two commits: measurements, which depend on the machine's speed and load."""
    failures = by_kind.get(RecordKind.FAILURE, [])
    outcome.detections = [
        {"worker": f["worker"], "fault": f["event"], "detection_s": f["detection_s"]}
        for f in failures
        if "detection_s" in f
    ] + outside_detections(outcome.outside, failures, by_kind.get(RecordKind.MEMBERSHIP, []))
    outcome.max_detection_s = max((d["detection_s"] for d in outcome.detections), default=0.0)
    times = sorted(r["time"] for r in by_kind.get(RecordKind.STEP, []) if not r.get("republished"))
    outcome.max_stall_s = max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def outside_detections(
    faults: list[dict[str, Any]], failures: list[dict[str, Any]], memberships: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The detection of each outside fault that hit a worker (``faults``: the driver's log, in the order it sent
    them): from its signal to the coordinator's decision that the worker failed, whose first trace is the epoch
    record that removed it (the coordinator publishes that epoch, then writes the failure record, which names the
    epoch). The failure is the worker's first after the signal and before the driver's next signal to the same
    worker; a stop too short to be noticed has none."""
    removed_at = {m["epoch"]: m["time"] for m in memberships}
    out = []
    for i, fault in enumerate(faults):
        if "worker" not in fault:
            continue  # a waiting spare: not a member, no failure record
        worker, sent = fault["worker"], fault["time"]
        until = min((f["time"] for f in faults[i + 1 :] if f.get("worker") == worker), default=math.inf)
        found = [f for f in failures if f["worker"] == worker and sent <= f["time"] < until]
        if found:
            first = min(found, key=lambda f: f["time"])
            detected = min(first["time"], removed_at.get(first["epoch"], math.inf))
            out.append(
                {"worker": worker, "fault": f"outside {fault['kind']}", "sent": sent, "detection_s": detected - sent}
            )
    return out


def _final_checkpoint_differences(run_dir: Path, reference: Path, steps: int) -> list[str]:
    """The final checkpoint must be the failure-free run's, tensor by tensor (model and optimizer)."""
    import torch

    try:
        mine, theirs = ckpt.verify(run_dir, steps), ckpt.verify(reference, steps)
    except ValueError as e:
        return [f"final checkpoint: {e}"]
    differ = [k for k in theirs["model"] if not torch.equal(mine["model"][k], theirs["model"][k])]
    moments = [
        k for k, tensor in _tensors_of(theirs["optimizer"]) if not _same(_tensors_of(mine["optimizer"]), k, tensor)
    ]
    out = [f"final checkpoint: parameter {k} differs from the failure-free run's" for k in differ[:3]]
    out += [f"final checkpoint: optimizer state {k} differs" for k in moments[:3]]
    if mine["ft"]["scale"] != theirs["ft"]["scale"]:
        out.append("final checkpoint: the exact mode's fixed-point scale differs")
    return out


def _tensors_of(state: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Every tensor in a nested state (an optimizer's, by index or flattened by name), with its path."""
    import torch

    if isinstance(state, torch.Tensor):
        return [(prefix, state)]
    if isinstance(state, dict):
        return [item for k, v in state.items() for item in _tensors_of(v, f"{prefix}/{k}")]
    if isinstance(state, list | tuple):
        return [item for i, v in enumerate(state) for item in _tensors_of(v, f"{prefix}/{i}")]
    return []


def _same(tensors: list[tuple[str, Any]], key: str, tensor: Any) -> bool:
    import torch

    found = dict(tensors).get(key)
    return found is not None and torch.equal(found, tensor)


def run_trial(
    config: str, out: Path, seed: int, workers: int, steps: int, overrides: list[str], ref: Reference
) -> Outcome:
    trial = make_trial(seed, workers, steps, ref.layout)
    run_dir = out / f"trial-{seed}"
    cmd = _train_cmd(config, run_dir, workers, steps, overrides, trial.schedule, ref.pace_s, ref.spares)
    bound = _bound(config, steps, overrides)
    code, wall = _run(cmd, run_dir, bound)
    outcome = Outcome(trial, code, wall, hang_bound_s=bound)
    check_run(run_dir, outcome, ref, steps, _microbatches(config, overrides))
    return outcome


RANDOM_MTTR_S = 0.5  # a killed worker is restarted this long after its exit (a cluster scheduler's replacement)


def run_random_trial(
    config: str, out: Path, seed: int, workers: int, steps: int, overrides: list[str], ref: Reference
) -> Outcome:
    """One run attacked from outside (``lab.faultdriver``): 3 to 6 SIGKILLs or SIGSTOP+SIGCONTs of random
    workers at uniformly random instants of the run, sometimes two at once; killed or excluded workers are
    restarted by the launcher and rejoin."""
    rng = random.Random(seed)
    count = rng.randint(3, 6)
    run_dir = out / f"random-{seed}"
    log_path = out / f"random-{seed}.faults.jsonl"
    log_path.unlink(missing_ok=True)
    overrides = [*overrides, f"--failures.mttr_s={RANDOM_MTTR_S}"]
    cmd = _train_cmd(config, run_dir, workers, steps, overrides, "", ref.pace_s, ref.spares)
    bound = _bound(config, steps, overrides)
    t0 = time.monotonic()
    with open(out / f"random-{seed}.launcher.log", "w") as launcher_log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=launcher_log)
        driver = subprocess.Popen(
            [sys.executable, "-m", "unbroken.lab.faultdriver", "--launcher-pid", str(proc.pid)]
            + ["--run-dir", str(run_dir), "--seed", str(seed), "--duration", f"{0.8 * ref.wall_s:.2f}"]
            + ["--faults", str(count), "--log", str(log_path)]
        )
        code = watch(proc, run_dir, bound)
    wall = time.monotonic() - t0
    try:
        driver.wait(timeout=10)
    except subprocess.TimeoutExpired:
        driver.kill()
        driver.wait()
    outcome = Outcome(Trial(seed, [], {}, "random-time"), code, wall, hang_bound_s=bound)
    if log_path.exists():
        outcome.outside = [json.loads(line) for line in log_path.read_text().splitlines()]
    for entry in outcome.outside:
        outcome.injected[f"random {entry['kind']}" + (" of a spare" if entry.get("spare") is not None else "")] += 1
    check_run(run_dir, outcome, ref, steps, _microbatches(config, overrides))
    return outcome


def _microbatches(config: str, overrides: list[str]) -> int:
    return load_config(config, overrides).train.microbatches


def _layout(config: str, overrides: list[str]) -> ReplicaLayout:
    parallel = load_config(config, overrides).parallel
    return ReplicaLayout.of(parallel)


def print_table(outcomes: list[Outcome], header: str) -> None:
    injected: Counter[str] = Counter()
    survived: Counter[str] = Counter()
    broken: Counter[str] = Counter()
    for o in outcomes:
        injected.update(o.injected)
        (broken if o.violations else survived).update(o.injected)
    print(header)
    print(f"{'fault':<24} {'injected':>9} {'survived':>9} {'in runs with a violation':>25}")
    named = any(kind in injected for kind in KINDS)
    for kind in (*(KINDS if named else ()), *sorted(set(injected) - set(KINDS))):
        print(f"{kind:<24} {injected[kind]:>9} {survived[kind]:>9} {broken[kind]:>25}")
    total, ok = sum(injected.values()), sum(survived.values())
    print(f"{'total':<24} {total:>9} {ok:>9} {total - ok:>25}")
    bad = [o for o in outcomes if o.violations]
    detection = max((o.max_detection_s for o in outcomes), default=0.0)
    stall = max((o.max_stall_s for o in outcomes), default=0.0)
    leftovers = sum(o.leftovers for o in outcomes)
    promoted = sum(o.promoted for o in outcomes)
    detected = sum(len(o.detections) for o in outcomes)
    print(
        f"runs: {len(outcomes)}, with a violation: {len(bad)}; measured: slowest detection {detection:.2f} s "
        f"(of {detected} failures detected), longest wait between two commits {stall:.2f} s; "
        f"partial checkpoint files left (ignored): {leftovers}" + (f"; spares promoted: {promoted}" if promoted else "")
    )
    for o in bad:
        print(f"VIOLATION seed {o.trial.seed} (schedule: {o.trial.schedule}):")
        for line in o.violations[:8]:
            print(f"    {line}")


def _write_summary(path: Path, outcomes: list[Outcome], workers: int, steps: int) -> None:
    summary = {
        "workers": workers,
        "steps": steps,
        "outcomes": [
            {
                "seed": o.trial.seed,
                "schedule": o.trial.schedule,
                "injected": dict(o.injected),
                "violations": o.violations,
                "wall_s": o.wall_s,
                "max_detection_s": o.max_detection_s,
                "max_stall_s": o.max_stall_s,
                "detections": o.detections,
                "hang_bound_s": o.hang_bound_s,
                "leftovers": o.leftovers,
                "promoted": o.promoted,
            }
            for o in outcomes
        ],
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, path)


MODES = ("named", "random-time")


def run_campaign(
    config: str,
    trials: int,
    seed: int,
    workers: int,
    steps: int,
    out: Path | None,
    keep: bool,
    overrides: list[str],
    mode: str = "named",
    pace_s: float = 0.0,
    spares: int = 0,
    dry_run: bool = False,
) -> int:
    """Run ``trials`` trials (seeds ``seed`` .. ``seed + trials - 1``); 0 if no invariant was broken. ``mode``:
    ``named`` faults at the code's named points (the failure schedule), or ``random-time`` faults from outside
    at random instants (``lab.faultdriver``). ``pace_s``: ``pace_event``; ``spares``: warm spares in every run.
    ``dry_run``: the arguments checked and a named campaign's trials planned, one line said, nothing run."""
    if mode not in MODES:
        raise ValueError(f"--mode {mode!r} is unknown; allowed: {', '.join(MODES)}")
    if not pace_s >= 0:
        raise ValueError(f"--pace {pace_s} is not allowed; expected seconds >= 0 (added to each microbatch)")
    if pace_s > 0 and any(o.startswith("--failures.schedule=") for o in overrides):
        raise ValueError("--pace adds to every run's failure schedule: give it without --failures.schedule")
    if trials < 1 or workers < 3 or steps < 12:
        raise ValueError(
            f"chaos needs --trials >= 1, --workers >= 3 and --steps >= 12 (got {trials}, {workers}, {steps})"
        )
    layout = _layout(config, overrides)
    if layout.size > 1 and layout.replicas_in(workers) < 2:
        raise ValueError(f"chaos with replicas of {layout.size} ranks needs --workers >= {2 * layout.size}")
    check_spares(spares, layout)
    if dry_run:
        print(_campaign_plan(config, trials, seed, workers, steps, out, mode, spares, layout))
        return 0
    base = Path(tempfile.mkdtemp(prefix="unbroken-chaos-")) if out is None else out
    base.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ref = reference_run(config, base / "reference", workers, steps, overrides, pace_s, spares)
    print(f"reference run: {steps} steps in {ref.wall_s:.1f} s", flush=True)
    outcomes = []
    for s in range(seed, seed + trials):
        trial = run_trial if mode == "named" else run_random_trial
        o = trial(config, base, s, workers, steps, overrides, ref)
        outcomes.append(o)
        status = "ok" if not o.violations else f"{len(o.violations)} VIOLATION(S)"
        faults = ", ".join(f"{k} x{n}" for k, n in sorted(o.injected.items())) or "none fired"
        print(
            f"trial seed {s}: {o.wall_s:.1f} s, injected {faults}; slowest detection {o.max_detection_s:.2f} s, "
            f"longest wait between commits {o.max_stall_s:.2f} s: {status}",
            flush=True,
        )
        if not o.violations and not keep:
            shutil.rmtree(base / (f"trial-{s}" if mode == "named" else f"random-{s}"), ignore_errors=True)
        _write_summary(base / "chaos.json", outcomes, workers, steps)  # after each trial, for a stopped campaign
    header = (
        f"chaos campaign ({mode}): {trials} runs (seeds {seed}..{seed + trials - 1}), {workers} workers, "
        f"{steps} steps, exact reduction, {time.monotonic() - t0:.0f} s"
        + (f", {spares} warm spare{'s' * (spares > 1)}" if spares else "")
    )
    print_table(outcomes, header)
    if any(o.violations for o in outcomes):
        print(f"reproduce one: unbroken chaos --mode {mode} --seed SEED --trials 1 (runs kept in {base})")
        return 1
    if out is None and not keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


def _campaign_plan(
    config: str,
    trials: int,
    seed: int,
    workers: int,
    steps: int,
    out: Path | None,
    mode: str,
    spares: int,
    layout: ReplicaLayout,
) -> str:
    """``unbroken chaos --dry-run``: one line of the campaign (a named one's trials planned: their schedules made
    and checked as each trial makes them)."""
    faults = ""
    if mode == "named":
        planned = sum(len(make_trial(s, workers, steps, layout).events) for s in range(seed, seed + trials))
        faults = f", {planned} faults planned at named points"
    with_spares = f" and {spares} warm spare{'s' * (spares > 1)}" if spares else ""
    kept = f"kept in {out}" if out is not None else "in a temporary folder (kept on a violation)"
    what = "the packaged tiny config" if config == default_config() else config
    return (
        f"dry run: would run a chaos campaign ({mode}) of {trials} run{'s' * (trials > 1)} (seeds {seed}.."
        f"{seed + trials - 1}) of {what} on {workers} workers{with_spares} for {steps} steps, after a "
        f"failure-free reference run{faults}; runs {kept}; nothing started or written"
    )


# ---------------------------------------------------------------------------------------------------------
# Churn: leaks under many membership changes


def proc_sample(pid: int) -> dict[str, int] | None:
    """RSS (KiB), threads, open file descriptors and sockets of ``pid`` from /proc; None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            continue
    return {
        "rss_kib": int(fields["VmRSS"].split()[0]),
        "threads": int(fields["Threads"]),
        "fds": len(fds),
        "sockets": sockets,
    }


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _coordinator_pid(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / "coordinator.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def default_config() -> str:
    """The packaged ``tiny`` config (chaos runs many short runs)."""
    from unbroken.core.config import preset_path

    return str(preset_path("tiny"))


CHURN_ROUNDS = 3  # a leak is a resource higher after each round of changes than after the one before
CHURN_RESTART_S = 0.2  # a killed victim is restarted this long after its exit (the launcher's ``failures.mttr_s``)


def leaks(quiet: list[dict[str, int]], state_kib: int) -> list[str]:
    """The resources of one process that grew with the membership changes, from its samples at the quiet point after
    each round of changes (``run_churn``: every worker back, and every wait a change abandoned timed out). A bounded
    resource comes back to the same level after each round; a leaked one is higher after every round than after the
    one before: a count (threads, descriptors, sockets) by any amount, the resident memory by more than ``state_kib``
    (one training state: caches filling, a buffer kept, are no leak). It takes two rises: something created once and
    kept (a pool, a lazily built group) rises once."""
    found = []
    for key in ("rss_kib", "threads", "fds", "sockets"):
        margin = state_kib if key == "rss_kib" else 0
        values = [q[key] for q in quiet]
        if len(values) >= 3 and all(b > a + margin for a, b in itertools.pairwise(values)):
            found.append(f"{key} grew with each round of changes: {' -> '.join(map(str, values))}")
    return found


def _state_kib(run_dir: Path) -> int:
    """The size of the run's newest checkpoint, in KiB: one training state."""
    steps = ckpt.list_checkpoints(run_dir)
    return ckpt.checkpoint_path(run_dir, max(steps)).stat().st_size // 1024 if steps else 0


Row = tuple[float, int, int, dict[str, int]]  # seconds, membership changes so far, members, ``proc_sample``


class Churn:
    """The rounds of a churn run, driven from outside by ``tick`` (every half second): in a round, workers 1..W-1 are
    killed (SIGKILL) as soon as the newest epoch lists them, so most die while they receive the state to rejoin, and
    the launcher restarts them; once the round made its changes the victims come back, and when every worker is a
    member and nothing changed for ``settle_s`` (every wait a change abandoned has timed out) the coordinator and
    worker 0 (which lives through all of it) are sampled at rest. Then the next round. Stuck: a worker still not back
    when nothing changed for ``stuck_s``."""

    def __init__(
        self, launcher_pid: int, run_dir: Path, workers: int, per_round: int, settle_s: float, stuck_s: float
    ) -> None:
        self.launcher_pid, self.run_dir, self.workers = launcher_pid, run_dir, workers
        self.per_round, self.settle_s, self.stuck_s = per_round, settle_s, stuck_s
        self.rows: dict[str, list[Row]] = {"coordinator": [], "worker 0": []}
        self.quiet: dict[str, list[dict[str, int]]] = {"coordinator": [], "worker 0": []}
        self.round_start = 1  # memberships recorded when the round began
        self.killed: set[int] = set()
        self.t0 = time.monotonic()

    @property
    def rounds(self) -> int:
        return min(len(q) for q in self.quiet.values())

    def tick(self) -> bool:
        """Sample, kill or wait; False once stuck."""
        memberships = read_records(self.run_dir, RecordKind.MEMBERSHIP)
        if not memberships:
            return True
        newest = memberships[-1]
        for child in _children(self.launcher_pid):
            # Forked by the launcher's zygote, both have the zygote's command line: the coordinator is named by its
            # address file, a worker by its process name (``worker_of``).
            coordinator = child == _coordinator_pid(self.run_dir)
            name = "coordinator" if coordinator else "worker 0" if worker_of(child) == 0 else ""
            sample = proc_sample(child) if name else None
            if sample is not None:
                row = (time.monotonic() - self.t0, len(memberships) - 1, len(newest["members"]), sample)
                self.rows[name].append(row)
        still, back = time.time() - newest["time"], len(newest["members"]) == self.workers
        if len(memberships) - self.round_start < self.per_round:
            for worker, pid in worker_processes(self.launcher_pid).items():
                if worker != 0 and worker in newest["members"] and pid not in self.killed:
                    os.kill(pid, signal.SIGKILL)
                    self.killed.add(pid)
        elif back and still > self.settle_s and all(self.rows.values()):
            for name, rows in self.rows.items():
                self.quiet[name].append(rows[-1][3])
            self.round_start = len(memberships)
        return back or still <= self.stuck_s


def run_churn(
    config: str, changes: int, workers: int, steps: int, out: Path | None, overrides: list[str], dry_run: bool = False
) -> int:
    """One run with about ``changes`` membership changes in ``CHURN_ROUNDS`` rounds (``Churn``), sampled every 0.5 s;
    stopped (Ctrl-C) after the last round. 1 if a round never came to rest (a worker still not back when the
    membership had not changed for the run's ``hang_bound_s``) or a resource leaked (``leaks``). ``dry_run``: the
    run's config resolved, one line said, nothing run."""
    overrides = [f"--failures.mttr_s={CHURN_RESTART_S}", *overrides]
    comm = load_config(config, [*_fixed_overrides(steps), *overrides]).comm
    # Every wait a change abandoned has ended by then: the protocol's longest (``hang_bound_s``), a wait for news.
    settle_s = max(hang_bound_s(comm), NEWS_WAIT_S + comm.heartbeat_timeout_s)
    if dry_run:
        kept = f"into {out}" if out is not None else "into a temporary folder"
        what = "the packaged tiny config" if config == default_config() else config
        print(
            f"dry run: would run one churn run of {what} on {workers} workers with about {changes} membership "
            f"changes in {CHURN_ROUNDS} rounds, resources read at rest {settle_s:g} s after each round, {kept}; "
            "nothing started or written"
        )
        return 0
    base = Path(tempfile.mkdtemp(prefix="unbroken-churn-")) if out is None else out
    run_dir = base / "churn"
    cmd = _train_cmd(config, run_dir, workers, steps, overrides, "", 0.0)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    churn = Churn(proc.pid, run_dir, workers, -(-changes // CHURN_ROUNDS), settle_s, hang_bound_s(comm))
    going = True
    try:
        while proc.poll() is None and churn.rounds < CHURN_ROUNDS and going:
            time.sleep(0.5)
            going = churn.tick()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    memberships = read_records(run_dir, RecordKind.MEMBERSHIP)
    steps_done = len({r["step"] for r in read_records(run_dir, RecordKind.STEP)})
    print(
        f"churn run: {len(memberships) - 1} membership changes in {churn.rounds} of {CHURN_ROUNDS} rounds, "
        f"{steps_done} steps, {time.monotonic() - churn.t0:.0f} s (exit {proc.returncode})"
    )
    report: dict[str, Any] = {"changes": len(memberships) - 1, "steps": steps_done, "rounds": churn.rounds}
    found = []
    for name, quiet in churn.quiet.items():
        leaked = leaks(quiet, _state_kib(run_dir))
        found += [f"{name}: {line}" for line in leaked]
        rows = churn.rows[name]
        peak = {k: max(r[3][k] for r in rows) for k in rows[0][3]} if rows else {}
        report[name] = {"at_rest_after_each_round": quiet, "peak": peak, "leaks": leaked, "samples": rows}
        at_rest = "; ".join(f"{k} {' -> '.join(str(q[k]) for q in quiet)} (peak {peak[k]})" for k in peak)
        print(f"{name:<12} at rest after each round: {at_rest}")
    print("leaks: " + ("; ".join(found) if found else "none (no resource grew with each round of changes)"))
    (base / "churn.json").write_text(json.dumps(report, indent=1))
    print(f"samples in {base / 'churn.json'}")
    return 0 if churn.rounds == CHURN_ROUNDS and not found else 1
