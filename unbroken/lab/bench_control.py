"""``unbroken bench control``: the control plane for many hosts under real ``kill -9`` from outside.

- **worker**: two agents of 2 workers each (two "hosts" on this machine) and a coordinator started by hand,
  as on a cluster; a worker is killed at a random moment: ``kill -9`` -> the group re-formed without it
  (the recovery record's ``time_reformed``; the survivors form it on a thread of their own while their
  training threads finish the microbatches they were computing), -> the survivors recovered (the lost ids
  re-planned: ``time_recovered``), -> the interrupted step committed. Its agent restarts it, it rejoins,
  the next kill follows.
- **host**: then one whole agent is killed with its workers (``kill -9`` of its process group): -> the
  group re-formed without them; the coordinator sees the loss only by the heartbeats stopping, so the
  bound is the heartbeat timeout.
- **coordinator** (journal): ``unbroken train --workers 4`` with ``kill:coordinator,step=N`` at several N:
  the kill -> the successor serving at the same address, -> every worker registered with it again, and
  -> the next committed step (the workers keep training while no coordinator runs, so a step may commit
  before a successor serves).
- **coordinator** (etcd): two coordinators sharing a 3-member etcd; the leader is killed from outside at a
  random moment; the same three figures, the standby taking over when the leader's lease expires.

Times come from records written by different processes of one machine (one clock).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.control.host.zygote import worker_of
from unbroken.control.store.gateway import TOKEN_ENV, new_token
from unbroken.control.store.netif import free_port
from unbroken.core.records import read_records
from unbroken.lab.harness import stats
from unbroken.lab.netns import Network, unavailable

COMMON = [
    "--train.microbatches=8",
    "--data.microbatch_size=4",
    "--recovery.reduction=exact",
    "--checkpoint.every=0",
    "--train.eval_every=0",
    "--train.eval_microbatches=1",
    "--failures.mttr_s=0.5",
]


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [sys.executable, "-m", "unbroken", *args], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def _wait(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench control: timed out waiting for {what}")
        time.sleep(0.01)


def _committed(run: Path) -> int:
    return max((r["step"] for r in read_records(run, "step")), default=-1)


def _members(run: Path) -> tuple[int, ...]:
    epochs = read_records(run, "membership")
    return tuple(epochs[-1]["members"]) if epochs else ()


def _children_by_worker(agent: subprocess.Popen[bytes]) -> dict[int, int]:
    found = {}
    for pid in Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split():
        worker = worker_of(int(pid))
        if worker is not None:
            found[worker] = int(pid)
    return found


def _reformed(run: Path, victims: set[int], t_kill: float) -> bool:
    """Whether an epoch that removed every one of ``victims`` (killed at ``t_kill``) has been re-formed."""
    failures = [f for f in read_records(run, "failure") if f["worker"] in victims and f["time"] >= t_kill]
    if {f["worker"] for f in failures} != victims:
        return False
    epoch = max(f["epoch"] for f in failures)
    return any(r["epoch"] == epoch for r in read_records(run, "recovery"))


def _interrupted_step_committed(run: Path, victims: set[int], t_kill: float) -> bool:
    """Whether the step that the re-formation without ``victims`` recovered has been committed."""
    failures = [f for f in read_records(run, "failure") if f["worker"] in victims and f["time"] >= t_kill]
    epoch = max(f["epoch"] for f in failures)
    recovery = next(r for r in read_records(run, "recovery") if r["epoch"] == epoch)
    return any(r["step"] == recovery["step"] and r["time"] > t_kill for r in read_records(run, "step"))


def _reformed_after(run: Path, victims: set[int], t_kill: float) -> dict[str, float]:
    """Seconds from ``t_kill`` to the re-formation of the first epoch that removed all of ``victims``, to the
    survivors' recovery in it, and to the commit of the step it interrupted."""
    failures = [f for f in read_records(run, "failure") if f["worker"] in victims and f["time"] >= t_kill]
    epoch = max(f["epoch"] for f in failures)
    recovery = next(r for r in read_records(run, "recovery") if r["epoch"] == epoch)
    commits = [r["time"] for r in read_records(run, "step") if r["step"] == recovery["step"] and r["time"] > t_kill]
    return {
        "reformed": float(recovery["time_reformed"]) - t_kill,
        "recovered": float(recovery["time_recovered"]) - t_kill,
        "committed": min(commits, default=float("nan")) - t_kill,  # nan: not waited for (the host kill)
    }


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


def agents_round(
    config: str, work: Path, rng: random.Random, kills: int, overrides: list[str], net: Network | None = None
) -> dict[str, Any]:
    """One job of 2 agents x 2 workers: ``kills`` worker kills (each victim back before the next), then the
    loss of agent 1 and its workers. Returns the seconds kill -> re-formed of each. With ``net`` (hosts
    ``coordinator``, ``host0``, ``host1``), each runs in its host's network namespace, over the veth."""
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, TOKEN_ENV: new_token()}
    run = work / "run"
    args = [*COMMON, "--train.steps=100000", *overrides]
    host = net.address["coordinator"] if net is not None else "127.0.0.1"
    port = free_port() if net is None else 29400  # a namespace of its own: nothing else holds its ports

    def spawn(where: str, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        if net is None:
            return _spawn(argv, env, log)
        return net.popen(where, [sys.executable, "-m", "unbroken", *argv], log, env)

    coordinator = ["coordinator", config, "--workers", "4", "--host", host, "--port", str(port), "--run-dir", str(run)]
    procs = [spawn("coordinator", [*coordinator, *args], work / "coordinator.log")]
    address = f"{host}:{port}"
    for rank in (0, 1):
        procs.append(
            spawn(
                f"host{rank}",
                ["agent", "--coordinator", address, "--workers", "2", "--node-rank", str(rank)],
                work / f"agent-{rank}.log",
            )
        )
    worker_s: list[dict[str, float]] = []
    host_s: list[float] = []
    try:
        _wait(lambda: _committed(run) >= 2, 180, "the first steps")
        for _ in range(kills):
            time.sleep(rng.uniform(0.0, 1.0))  # a random moment of a step
            victim = rng.randrange(4)
            pid = _children_by_worker(procs[1 + victim // 2])[victim]
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            _wait(lambda v=victim, t=t_kill: _reformed(run, {v}, t), 60, "the re-formation")
            _wait(lambda v=victim, t=t_kill: _interrupted_step_committed(run, {v}, t), 60, "the interrupted step")
            worker_s.append(_reformed_after(run, {victim}, t_kill))
            _wait(lambda: _members(run) == (0, 1, 2, 3), 60, "the victim's rejoin")
            start = _committed(run)
            _wait(lambda s=start: _committed(run) >= s + 2, 60, "steps after the rejoin")
        time.sleep(rng.uniform(0.0, 1.0))
        t_kill = time.time()
        os.killpg(procs[2].pid, signal.SIGKILL)  # agent 1 and its workers 2, 3: a host that dies
        _wait(lambda: _reformed(run, {2, 3}, t_kill), 60, "the re-formation without host 1")
        host_s.append(_reformed_after(run, {2, 3}, t_kill)["reformed"])
    finally:
        _stop(procs)
    return {"worker": worker_s, "host": host_s}


def coordinator_journal(config: str, work: Path, kill_steps: list[int], overrides: list[str]) -> list[dict[str, float]]:
    """``unbroken train --workers 4`` with ``kill:coordinator,step=N`` for each N (the launcher kills it)."""
    schedule = "; ".join(f"kill:coordinator,step={n}" for n in kill_steps)
    run = work / "run"
    cmd = [sys.executable, "-m", "unbroken", "train", config, "--workers", "4", "--out", str(run), "--quiet"]
    cmd += [*COMMON, f"--train.steps={max(kill_steps) + 20}", f"--failures.schedule={schedule}", *overrides]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"bench control: the journal run failed: {result.stderr[-2000:]}")
    kills = [r["time"] for r in read_records(run, "injected") if r["event"].startswith("kill:coordinator")]
    return [_after_coordinator_kill(run, t) for t in kills]


def _after_coordinator_kill(run: Path, t_kill: float) -> dict[str, float]:
    serving = min(r["time"] for r in read_records(run, "coordinator") if r["time"] > t_kill)
    back = min(m["time"] for m in read_records(run, "membership") if m["time"] > t_kill and "restarted" in m["reason"])
    step = min(r["time"] for r in read_records(run, "step") if r["time"] > t_kill)
    return {"serving": serving - t_kill, "registered": back - t_kill, "commit": step - t_kill}


def coordinator_etcd(config: str, work: Path, rng: random.Random, overrides: list[str]) -> dict[str, float]:
    """Two coordinators on a 3-member etcd; the leader killed from outside at a random moment."""
    from unbroken.control.store.etcd import LocalEtcdCluster

    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, TOKEN_ENV: new_token()}
    run = work / "run"
    with LocalEtcdCluster(work / "etcd", size=3) as cluster:
        args = [*COMMON, "--train.steps=100000", f"--coordinator.state={cluster.url}", "--coordinator.lease_s=2"]
        args += overrides
        ports = [free_port(), free_port()]
        procs = []
        try:
            for i, port in enumerate(ports):
                procs.append(_spawn(["coordinator", config, "--workers", "4", "--port", str(port), "--run-dir",
                                     str(run), *args], env, work / f"coordinator-{i}.log"))  # fmt: skip
                if i == 0:
                    _wait(lambda: (run / "config.toml").exists(), 60, "the first coordinator")
            addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
            procs.append(_spawn(["agent", "--coordinator", addresses, "--workers", "4"], env, work / "agent.log"))
            _wait(lambda: _committed(run) >= 3, 180, "the first steps")
            time.sleep(rng.uniform(0.0, 1.0))
            t_kill = time.time()
            os.kill(procs[0].pid, signal.SIGKILL)
            _wait(lambda: any(r["time"] > t_kill for r in read_records(run, "coordinator")), 60, "the standby")
            _wait(lambda: any(m["time"] > t_kill and "restarted" in m["reason"]
                              for m in read_records(run, "membership")), 60, "the workers' return")  # fmt: skip
            _wait(lambda: any(r["time"] > t_kill for r in read_records(run, "step")), 60, "a commit")
            return _after_coordinator_kill(run, t_kill)
        finally:
            _stop(procs)


def _stats(values: list[float]) -> str:
    s = stats(values)
    return f"{s['median']:.3f} | {s['q1']:.3f} | {s['q3']:.3f} | {s['min']:.3f} | {s['max']:.3f} | {len(values)}"


def bench_control_netns(config: str, repeats: int, overrides: list[str], seed: int = 0) -> str:
    """The agent rounds of ``bench_control`` twice, alternating: the three processes on loopback, and each in a
    network namespace of its own (a coordinator host and two worker hosts joined by a bridge). The markdown
    table; a line saying why where this machine cannot make namespaces."""
    from unbroken.core.config import load_config

    why = unavailable()
    if why is not None:
        return f"bench control-netns not run: {why}."
    rng = random.Random(seed)
    hb = load_config(config, overrides).comm.heartbeat_timeout_s
    root = Path(tempfile.mkdtemp(prefix="unbroken-bench-control-netns-"))
    got: dict[str, dict[str, list[Any]]] = {"loopback": {"worker": [], "host": []}, "veth": {"worker": [], "host": []}}
    try:
        for i in range(repeats):
            for where in ("loopback", "veth"):
                if where == "loopback":
                    one = agents_round(config, root / f"{where}-{i}", rng, 3, overrides)
                else:
                    with Network(["coordinator", "host0", "host1"]) as net:
                        one = agents_round(config, root / f"{where}-{i}", rng, 3, overrides, net)
                got[where]["worker"] += one["worker"]
                got[where]["host"] += one["host"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    head = "| kill -9 of | to | hosts | median | q1 | q3 | min | max | n |\n|---|---|---|---|---|---|---|---|---|"
    rows = []
    for where, label in (("loopback", "processes on loopback"), ("veth", "network namespaces (veth + bridge)")):
        for key, what in (("reformed", "group re-formed without it"), ("committed", "the interrupted step committed")):
            rows.append(f"| one worker | {what} | {label} | {_stats([k[key] for k in got[where]['worker']])} |")
        rows.append(f"| one agent with its 2 workers | group re-formed | {label} | {_stats(got[where]['host'])} |")
    ratio = stats([k["reformed"] for k in got["veth"]["worker"]])["median"] / max(
        1e-9, stats([k["reformed"] for k in got["loopback"]["worker"]])["median"]
    )
    lines = [f"seconds; heartbeat timeout {hb:g} s; seed {seed}; veth / loopback (worker re-formed, medians): "
             f"{ratio:.2f}", "", head, *rows]  # fmt: skip
    return "\n".join(lines)


def bench_control(config: str, repeats: int, overrides: list[str], seed: int = 0) -> str:
    """The markdown figures: ``repeats`` agent rounds (3 worker kills + 1 host kill each), a journal run with
    ``repeats`` coordinator kills, and ``repeats`` etcd failovers (skipped, said so, without etcd)."""
    from unbroken.core.config import load_config

    rng = random.Random(seed)
    hb = load_config(config, overrides).comm.heartbeat_timeout_s
    root = Path(tempfile.mkdtemp(prefix="unbroken-bench-control-"))
    try:
        worker_s: list[dict[str, float]] = []
        host_s: list[float] = []
        for i in range(repeats):
            got = agents_round(config, root / f"agents-{i}", rng, 3, overrides)
            worker_s += got["worker"]
            host_s += got["host"]
        journal = coordinator_journal(config, root / "journal", [4 + 12 * k for k in range(repeats)], overrides)
        etcd: list[dict[str, float]] = []
        etcd_note = ""
        try:
            from unbroken.control.store.etcd import find_etcd

            if find_etcd() is None:
                etcd_note = "no etcd server binary here (scripts/install_etcd.sh installs one)"
        except ImportError:
            etcd_note = "the etcd client etcd3gw is not installed (pip install unbroken[etcd])"
        if not etcd_note:
            etcd = [coordinator_etcd(config, root / f"etcd-{i}", rng, overrides) for i in range(repeats)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    head = "| kill -9 of | to | median | q1 | q3 | min | max | n |\n|---|---|---|---|---|---|---|---|"
    rows = [
        f"| one worker (2 agents x 2 workers) | {what} | {_stats([k[key] for k in worker_s])} |"
        for key, what in (
            ("reformed", "group re-formed without it"),
            ("recovered", "survivors recovered (lost ids re-planned)"),
            ("committed", "the interrupted step committed"),
        )
    ]
    rows.append(f"| one agent with its 2 workers | group re-formed without them | {_stats(host_s)} |")
    for name, runs in (("journal", journal), ("etcd", etcd)):
        if not runs:
            continue
        for key, what in (("serving", "a coordinator serving again"), ("registered", "every worker registered"),
                          ("commit", "the next committed step")):  # fmt: skip
            rows.append(f"| the coordinator ({name}) | {what} | {_stats([r[key] for r in runs])} |")
    lines = [f"seconds; heartbeat timeout {hb:g} s; seed {seed}", "", head, *rows]
    if etcd_note:
        lines += ["", f"etcd failover not measured: {etcd_note}."]
    return "\n".join(lines)
