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

Invariants checked after every run (a violation names the trial's seed):
  finished      the run exited 0 and published its final record, within the trial timeout (no hang)
  detection     every failure was detected within ``comm.heartbeat_timeout_s`` + ``DETECTION_SLACK_S``
  no crash      every failure was one the campaign caused (a SIGKILL, a lost heartbeat, a worker that left when
                it was cut off or excluded), never a worker ending by itself: an abort (gloo's on a collective
                mismatch), another signal, an exception raised; nor a warm spare while it waited
  progress      no gap between consecutive committed steps longer than the heartbeat timeout + ``STALL_SLACK_S``
  counted once  every step 0..N-1 was committed, and each committed step counted each of its M microbatches
                exactly once (the reduced count vector, recorded in the step's metrics)
  identical     every live worker ended with the same parameters (the final checksum record)
  reference     the final parameters and every step's loss equal the failure-free run's, bit for bit
  checkpoints   every checkpoint with a manifest verifies (size, sha256, loads); partial files are ignored

With replicas of several ranks (``--parallel.shard`` / ``--parallel.pipeline`` among the overrides) the faults
hit ranks, the last replica is never touched, a double kill may take a whole replica, and each worker's
final checksum is compared with the reference's rank of the same index (a rank holds its shard).

With warm spares (``--spares N``, every run of the campaign, the reference too) a dead worker's place is taken by
a spare rather than by a restart; in ``random-time`` the driver also hits the promoted spares (they are workers
now) and the spares still waiting. The invariants are the same.

The churn run (``unbroken chaos --churn 50``) makes workers die and rejoin until the membership changed
that many times and samples, from /proc, the memory (RSS), threads, open file descriptors and sockets of
the coordinator and of a worker that lives through all of it; it stops the run once every worker is back.
"""

from __future__ import annotations

import json
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

from unbroken.control.agent import check_spares
from unbroken.control.store import exit_code_in, raised_headline
from unbroken.control.zygote import worker_of
from unbroken.core.config import load_config
from unbroken.core.failures import STEP_PHASES, FailureSchedule
from unbroken.core.layout import ReplicaLayout
from unbroken.core.records import SpareState, read_records
from unbroken.ft import checkpoint as ckpt
from unbroken.ft.protocoldefs import EXIT_STOPPED

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
DETECTION_SLACK_S = 1.5  # the coordinator's tick, the launcher's poll and a loaded 2-core machine
STALL_SLACK_S = 10.0  # a step of 4 workers on 2 shared cores takes up to ~1-2 s under load
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


@dataclass
class Outcome:
    trial: Trial
    code: int | None
    wall_s: float
    injected: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    max_detection_s: float = 0.0
    max_stall_s: float = 0.0
    leftovers: int = 0
    promoted: int = 0  # warm spares that took a dead worker's place


def pace_event(workers: int, steps: int, seconds: float) -> str:
    """The schedule event that paces a run (empty for 0): the last worker computes each microbatch ``seconds``
    slower at every step, and in exact mode every step waits for it. A named campaign never faults that worker;
    a random-time one may (its outside driver picks any worker), and a restarted last worker is paced again. A restart
    takes seconds whatever the machine (the rejoin delay, then a process start), while steps take less the faster
    the machine: unpaced, an idle machine can finish the run before a killed worker is back, and the faults
    planned after its return never fire."""
    return f"slow:worker={workers - 1},seconds={seconds:g},steps=0-{steps - 1}" if seconds > 0 else ""


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
    cmd += [
        "--quiet",
        "--recovery.reduction=exact",
        f"--train.steps={steps}",
        f"--checkpoint.every={CHECKPOINT_EVERY}",
        f"--comm.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}",
        *overrides,
    ]
    if schedule:
        cmd.append(f"--failures.schedule={schedule}")
    return cmd


def _run(cmd: list[str], timeout_s: float) -> tuple[int | None, float]:
    """Run ``cmd``; on timeout, Ctrl-C it (the launcher stops what it started), then kill it. None: hung."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        proc.communicate(timeout=timeout_s)
        return proc.returncode, time.monotonic() - t0
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        return None, time.monotonic() - t0


def reference_run(
    config: str, out: Path, workers: int, steps: int, overrides: list[str], pace_s: float = 0.0, spares: int = 0
) -> Reference:
    """The failure-free run every trial is compared with, paced as its trials are (``pace_event``) and with their
    spares."""
    code, wall = _run(_train_cmd(config, out, workers, steps, overrides, "", pace_s, spares), 600)
    final = read_records(out, "final")
    if code != 0 or not final:
        raise RuntimeError(f"the failure-free reference run failed (exit {code}); see {out / 'logs'}")
    losses = {r["step"]: r["loss"] for r in read_records(out, "step")}
    layout = _layout(config, overrides)
    checksums = {layout.rank_of(int(w)): digest for w, digest in final[-1]["checksums"].items()}
    return Reference(losses, checksums, wall, out, layout, pace_s, spares)


def check_run(run_dir: Path, outcome: Outcome, ref: Reference, steps: int, microbatches: int) -> None:
    """Fill ``outcome`` with what was injected and every invariant the run broke (see the module doc)."""
    v = outcome.violations
    if outcome.code is None:
        v.append(f"hang: no exit within the trial timeout ({outcome.wall_s:.0f} s)")
    elif outcome.code != 0:
        v.append(f"exit status {outcome.code}")
    records = read_records(run_dir)
    by_type: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_type.setdefault(str(r.get("type")), []).append(r)
    for r in by_type.get("injected", []):
        outcome.injected[outcome.trial.labels.get(r["event"], "other")] += 1
    committed = {r["step"] for r in by_type.get("step", [])}
    for text, label in outcome.trial.labels.items():
        if label == "slow":
            first, last = (int(x) for x in text.rsplit("=", 1)[1].split("-"))
            if any(first <= s <= last for s in committed):
                outcome.injected[label] += 1
    final = by_type.get("final", [])
    if not final:
        v.append("the run did not finish (no final record)")
    else:
        checksums = final[-1]["checksums"]
        if not final[-1]["identical"]:
            v.append(f"live workers hold different parameters: {checksums}")
        if any(digest != ref.checksums.get(ref.layout.rank_of(int(w))) for w, digest in checksums.items()):
            v.append("final parameters differ from the failure-free reference")
    bound = HEARTBEAT_TIMEOUT_S + DETECTION_SLACK_S
    for f in by_type.get("failure", []):
        why = str(f["why"])
        code = exit_code_in(why)
        if raised_headline(why) is not None or (code is not None and code not in CAUSED_EXITS):
            v.append(f"worker {f['worker']} crashed: {why}")
        if "detection_s" in f:
            outcome.max_detection_s = max(outcome.max_detection_s, f["detection_s"])
            if f["detection_s"] > bound:
                v.append(f"worker {f['worker']}: detected after {f['detection_s']:.2f} s (bound {bound:.1f} s)")
    outcome.promoted = sum(r["state"] == SpareState.PROMOTED for r in by_type.get("spare", []))
    for r in by_type.get("spare", []):
        if r["state"] == SpareState.EXITED and exit_code_in(str(r["why"])) not in CAUSED_EXITS:
            v.append(f"spare {r['spare']} crashed while it waited: {r['why']}")
    missing = sorted(set(range(steps)) - committed)
    if missing:
        v.append(f"steps never committed: {missing[:10]}")
    times = sorted(r["time"] for r in by_type.get("step", []) if not r.get("republished"))
    stalls = [b - a for a, b in zip(times, times[1:], strict=False)]
    outcome.max_stall_s = max(stalls, default=0.0)
    if outcome.max_stall_s > HEARTBEAT_TIMEOUT_S + STALL_SLACK_S:
        v.append(f"no step committed for {outcome.max_stall_s:.1f} s")
    for r in by_type.get("step", []):
        if "counted" in r and (r["counted"] != microbatches or not r["counted_once"] or r["dropped"]):
            v.append(f"step {r['step']}: microbatches counted {r['counted']} (once each: {r['counted_once']})")
        if r["step"] in ref.losses and r["loss"] != ref.losses[r["step"]]:
            v.append(f"step {r['step']}: loss {r['loss']!r} != failure-free {ref.losses[r['step']]!r}")
    problems, leftovers = ckpt.verify_all(run_dir)
    v += [f"damaged checkpoint {p}" for p in problems]
    outcome.leftovers = len(leftovers)
    if final:
        v += _final_checkpoint_differences(run_dir, ref.run_dir, steps)


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
    timeout = 3 * ref.wall_s + 90
    cmd = _train_cmd(config, run_dir, workers, steps, overrides, trial.schedule, ref.pace_s, ref.spares)
    code, wall = _run(cmd, timeout)
    outcome = Outcome(trial, code, wall)
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
    cmd = _train_cmd(
        config,
        run_dir,
        workers,
        steps,
        [*overrides, f"--failures.mttr_s={RANDOM_MTTR_S}"],
        "",
        ref.pace_s,
        ref.spares,
    )
    t0 = time.monotonic()
    launcher_log = open(out / f"random-{seed}.launcher.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=launcher_log, text=True)
    driver = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "unbroken.lab.faultdriver",
            "--launcher-pid",
            str(proc.pid),
            "--run-dir",
            str(run_dir),
            "--seed",
            str(seed),
            "--duration",
            f"{0.8 * ref.wall_s:.2f}",
            "--faults",
            str(count),
            "--log",
            str(log_path),
        ]
    )
    timeout = 3 * ref.wall_s + 90
    try:
        proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        code = None
    wall = time.monotonic() - t0
    launcher_log.close()
    try:
        driver.wait(timeout=10)
    except subprocess.TimeoutExpired:
        driver.kill()
        driver.wait()
    trial = Trial(seed, [], {}, "random-time")
    outcome = Outcome(trial, code, wall)
    if log_path.exists():
        for line in log_path.read_text().splitlines():
            entry = json.loads(line)
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
    print(
        f"runs: {len(outcomes)}, with a violation: {len(bad)}; slowest detection {detection:.2f} s; "
        f"longest wait between two commits {stall:.2f} s; partial checkpoint files left (ignored): {leftovers}"
        + (f"; spares promoted: {promoted}" if promoted else "")
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
) -> int:
    """Run ``trials`` trials (seeds ``seed`` .. ``seed + trials - 1``); 0 if no invariant was broken. ``mode``:
    ``named`` faults at the code's named points (the failure schedule), or ``random-time`` faults from outside
    at random instants (``lab.faultdriver``). ``pace_s``: ``pace_event``; ``spares``: warm spares in every run."""
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


def churn_schedule(changes: int, workers: int) -> str:
    """Workers 1..W-1 are killed at step 2, then again each time they receive the state to rejoin, until the
    membership changed about ``changes`` times; worker 0 lives through all of it. Each kill while receiving
    is two changes (joined, died)."""
    victims = list(range(1, workers))
    per_victim = -(-changes // len(victims))  # first death and last join, then 2 per kill while rejoining
    rekills = max(0, -(-(per_victim - 2) // 2)) + 1  # +1: two joins in one epoch are one change
    events = [f"kill:worker={w},step=2,phase=start,rejoin=0.2" for w in victims]
    for k in range(rekills):
        events += [f"kill:worker={w},step={k},phase=receive,rejoin=0.2" for w in victims]
    return "; ".join(events)


def run_churn(config: str, changes: int, workers: int, steps: int, out: Path | None, overrides: list[str]) -> int:
    """One run with about ``changes`` membership changes; samples the coordinator and worker 0 every 0.5 s
    and stops the run (Ctrl-C) once every worker is back after the last change."""
    base = Path(tempfile.mkdtemp(prefix="unbroken-churn-")) if out is None else out
    run_dir = base / "churn"
    schedule = churn_schedule(changes, workers)
    cmd = _train_cmd(config, run_dir, workers, steps, overrides, schedule, 0.0)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples: dict[str, list[tuple[float, int, dict[str, int]]]] = {"coordinator": [], "worker 0": []}
    t0 = time.monotonic()
    settled_at: float | None = None
    while proc.poll() is None:
        time.sleep(0.5)
        memberships = read_records(run_dir, "membership")
        for child in _children(proc.pid):
            # Forked by the launcher's zygote, both have the zygote's command line: the coordinator is named by its
            # address file, a worker by its process name (``worker_of``).
            name = "coordinator" if child == _coordinator_pid(run_dir) else "worker 0" if worker_of(child) == 0 else ""
            if name:
                sample = proc_sample(child)
                if sample is not None:
                    samples[name].append((time.monotonic() - t0, len(memberships), sample))
        if memberships and len(memberships[-1]["members"]) == workers and len(memberships) > 1:
            quiet = time.time() - memberships[-1]["time"]
            if settled_at is None and (len(memberships) > changes or quiet > 30.0):
                settled_at = time.monotonic()
        if settled_at is not None and time.monotonic() > settled_at + 10.0:
            proc.send_signal(signal.SIGINT)  # enough: every worker is back, 10 s of samples after the last change
            break
    proc.communicate(timeout=120)
    memberships = read_records(run_dir, "membership")
    steps_done = len({r["step"] for r in read_records(run_dir, "step")})
    print(
        f"churn run: {len(memberships) - 1} membership changes, {steps_done} steps, "
        f"{time.monotonic() - t0:.0f} s (exit {proc.returncode})"
    )
    report: dict[str, Any] = {"changes": len(memberships) - 1, "steps": steps_done, "schedule": schedule}
    for name, rows in samples.items():
        if not rows:
            continue
        warm = [r for r in rows if r[1] >= 5] or rows  # after the first changes, when everything is loaded
        first, last = warm[0][2], rows[-1][2]
        peak = {k: max(r[2][k] for r in rows) for k in first}
        report[name] = {"after_first_changes": first, "peak": peak, "at_end": last, "samples": rows}
        print(f"{name:<12} " + "; ".join(f"{k} {first[k]} -> {last[k]} (peak {peak[k]})" for k in first))
    (base / "churn.json").write_text(json.dumps(report, indent=1))
    print(f"samples in {base / 'churn.json'}")
    return 0 if settled_at is not None else 1
