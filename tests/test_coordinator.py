"""The coordinator end to end: a locked-down store under attack during a real run, and the coordinator's own
death (SIGKILL) followed by ``--resume``, which must reproduce the uninterrupted run bit for bit.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from runner import ROOT, TINY, final_params, in_process_coordinator, popen, reference_run, run_command
from torch.distributed import TCPStore

from unbroken.control.store.connect import exit_code_in, exit_reason, process_failure, raised_failure, raised_headline
from unbroken.control.store.gateway import MAGIC, NONCE_BYTES, Tunnel, TunnelError, new_token
from unbroken.core.records import read_records, step_losses
from unbroken.ft.checkpoint import schema as ckpt

pytestmark = pytest.mark.timeout(300)

STEPS = 24
COMMON = [f"--train.steps={STEPS}", "--checkpoint.every=0", "--recovery.reduction=exact"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data_cache_dir: Path) -> Path:
    return reference_run(tmp_path_factory, "coordinator", data_cache_dir, *COMMON, workers=2)


def _start(out: Path, cache: Path, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "unbroken", "train", TINY, "--workers", "2", "--out", str(out), "--quiet"]
    cmd += [f"--data.cache_dir={cache}", *COMMON, *extra]
    return popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(proc: subprocess.Popen[str], out: Path, step: int) -> None:
    deadline = time.monotonic() + 200
    while not any(r["step"] >= step for r in read_records(out, "step")):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended too early"
        time.sleep(0.02)


def test_attackers_cannot_join_or_disturb_a_run(tmp_path: Path, data_cache_dir: Path, reference: Path) -> None:
    out = tmp_path / "attacked"
    proc = _start(out, data_cache_dir)
    _wait_for_step(proc, out, 1)
    host, port = json.loads((out / "coordinator.json").read_text())["address"].rsplit(":", 1)
    results: dict[str, object] = {}

    def garbage() -> None:
        s = socket.create_connection((host, int(port)))
        s.recv(len(MAGIC) + NONCE_BYTES)
        s.sendall(os.urandom(4096))
        s.settimeout(10)
        try:
            results["garbage"] = s.recv(10)
        except OSError as e:
            results["garbage"] = e
        s.close()

    def silent() -> None:
        s = socket.create_connection((host, int(port)))
        s.settimeout(15)
        data = b""
        try:
            while chunk := s.recv(100):
                data += chunk
        except OSError:
            pass
        results["silent"] = data  # only the greeting, then the gateway (or the run's end) closes it
        s.close()

    def wrong_token() -> None:
        try:
            Tunnel(f"{host}:{port}", new_token(), 5.0)
            results["wrong_token"] = "admitted"
        except TunnelError as e:
            results["wrong_token"] = str(e)

    def raw_store() -> None:
        try:
            raw = TCPStore(
                host, int(port), is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=3)
            )
            raw.set("stop", "pwned")
            results["raw"] = "connected"
        except RuntimeError as e:
            results["raw"] = str(e)

    threads = [threading.Thread(target=f) for f in (garbage, silent, wrong_token, raw_store)]
    for t in threads:
        t.start()
    stdout, stderr = proc.communicate(timeout=240)
    for t in threads:
        t.join(timeout=30)
    assert proc.returncode == 0, stderr[-3000:]
    assert results["garbage"] in (b"",) or isinstance(results["garbage"], OSError)
    assert results["silent"].startswith(MAGIC) and len(results["silent"]) == len(MAGIC) + NONCE_BYTES
    assert "refused" in str(results["wrong_token"])
    assert results["raw"] != "connected"
    # Nobody joined, nobody left, nothing was stopped: one epoch, two workers, no failures.
    assert [tuple(m["members"]) for m in read_records(out, "membership")] == [(0, 1)]
    assert not read_records(out, "failure")
    gateway = read_records(out, "gateway")[-1]
    # The launcher, and per worker: a probe, its client, its two watchers (heartbeats, news) and one rendezvous
    # per epoch (here one), plus the spare connection opened ahead for the next rendezvous (if it was opened
    # before the end).
    assert gateway["rejected"] >= 2 and 1 + 2 * (4 + 1) <= gateway["admitted"] <= 1 + 2 * (4 + 2)
    final = read_records(out, "final")[0]
    assert final["identical"]
    ref_final = read_records(reference, "final")[0]
    assert set(final["checksums"].values()) == set(ref_final["checksums"].values())


def test_a_coordinator_that_never_comes_back_checkpoints_and_resume_reproduces(
    tmp_path: Path, data_cache_dir: Path, reference: Path
) -> None:
    """A coordinator started by hand (no launcher to replace it) is SIGKILLed: the workers keep training and
    hold on for ``coordinator.hold_s``; when no coordinator comes back they stop with one line, the leader
    having saved the last committed step; ``--resume`` then reproduces the uninterrupted run bit for bit."""
    out = tmp_path / "orphaned"
    env = {**os.environ, "UNBROKEN_TOKEN": new_token()}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # From step 8 each microbatch worker 0 computes takes 0.2 s more (timing only: the exact sum does not depend on
    # who computes what), so the steps left after the kill below take longer than hold_s however fast this
    # machine is (a factor of the compute time did not: on an idle machine the run finished within the hold).
    slow = f"--failures.schedule=slow:worker=0,seconds=0.2,steps=8-{STEPS - 1}"
    common = [f"--data.cache_dir={data_cache_dir}", *COMMON, "--coordinator.hold_s=2", slow]
    coordinator = popen(
        [sys.executable, "-m", "unbroken", "coordinator", TINY, "--workers", "2", "--port", str(port)]
        + ["--run-dir", str(out), *common],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    agent = popen(
        [sys.executable, "-m", "unbroken", "agent", "--coordinator", f"127.0.0.1:{port}", "--workers", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        _wait_for_step(agent, out, 8)
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait()
        agent.communicate(timeout=120)
    finally:
        for p in (coordinator, agent):
            if p.poll() is None:
                p.kill()
    assert agent.returncode != 0
    for wid in (0, 1):
        log = (out / "logs" / f"worker-{wid}.log").read_text()
        assert "no coordinator" in log and "answered within 2 s" in log and "Traceback" not in log, log[-2000:]
    lost = read_records(out, "coordinator_lost")[0]
    assert lost["step"] >= 9 and not read_records(out, "final")
    saved = ckpt.load_latest(out)
    assert saved is not None and saved.step == lost["step"]
    problems, leftovers = ckpt.verify_all(out)
    assert not problems and not leftovers
    # The steps committed before the death are all in the metrics (the leader wrote what was not drained).
    assert sorted(step_losses(out)) == list(range(lost["step"]))

    result = run_command(
        # Without the slowdown: the sum, so the run, does not depend on it.
        [sys.executable, "-m", "unbroken", "train", "--resume", str(out), "--workers", "2", "--quiet"]
        + ["--failures.schedule="],
        capture_output=True,
        text=True,
        timeout=200,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_records(out, "resume")[-1]["step"] == lost["step"]
    ref_losses, losses = step_losses(reference), step_losses(out)
    assert sorted(losses) == list(range(STEPS))
    assert all(losses[s] == ref_losses[s] for s in range(STEPS)), "losses differ from the uninterrupted run"
    ref_params, params = final_params(reference), final_params(out)
    assert all(torch.equal(params[k], ref_params[k]) for k in ref_params)


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_command([sys.executable, "-m", "unbroken", *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize(
    ("command", "token", "message"),
    [
        (["coordinator", "--workers", "2", "--host", "0.0.0.0", "--port", "0"], None, "UNBROKEN_TOKEN is not set"),
        (["coordinator", "--workers", "2", "--port", "0"], "short", "use at least 16"),
        (["worker", "--coordinator", "127.0.0.1:1"], None, "UNBROKEN_TOKEN is not set"),
    ],
)
def test_standalone_processes_need_the_token(
    tmp_path: Path, command: list[str], token: str | None, message: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "UNBROKEN_TOKEN"}
    if token is not None:
        env["UNBROKEN_TOKEN"] = token
    run_dir = tmp_path / "run"
    args = [*command, "--run-dir", str(run_dir)] if command[0] == "coordinator" else command
    result = _cli(*args, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not run_dir.exists()


def test_a_metrics_number_whose_writer_died_holds_back_no_later_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer killed between taking its metrics number and writing the record leaves a number that never
    fills (random-time chaos seed 5063: the leader killed mid-publish, after which no record reached
    metrics.jsonl, so the finished run looked unfinished and the launcher restarted its coordinator). The
    coordinator waits a moment for the number, then goes on without it, and still takes the record if it
    comes late (a writer that was only stopped)."""
    from unbroken.control.coordinator import drain as drain_module
    from unbroken.control.store import keys
    from unbroken.control.store.connect import publish_record
    from unbroken.core.records import RecordKind, encode, make

    run = tmp_path / "run"

    def record(n: int) -> dict[str, object]:
        return make(RecordKind.GATEWAY, time.time(), admitted=n, rejected=0, timed_out=0, dropped=0)

    with in_process_coordinator(tmp_path, new_token()) as coordinator:
        coordinator.store.add(keys.METRICS_SEQ, 1)  # number 1 taken; its writer is killed before its set
        publish_record(coordinator.store, record(2))
        publish_record(coordinator.store, record(3))
        # A grace past this test's timeout, however slow the machine: the hole holds the queue (the file's order).
        monkeypatch.setattr(drain_module, "METRIC_HOLE_GRACE_S", 3600.0)
        coordinator.drain.drain()
        assert read_records(run, "gateway") == []
        monkeypatch.setattr(drain_module, "METRIC_HOLE_GRACE_S", 0.0)  # the grace is over: passed over
        coordinator.drain.drain()
        assert [r["admitted"] for r in read_records(run, "gateway")] == [2, 3]
        coordinator.store.set(keys.metrics(1), encode(record(1)))  # a stopped writer, continued
        publish_record(coordinator.store, record(4))
        coordinator.drain.drain()
        assert [r["admitted"] for r in read_records(run, "gateway")] == [2, 3, 1, 4]


def test_after_a_stop_the_members_records_are_taken_until_their_heartbeats_end(tmp_path: Path) -> None:
    """A stop reaches the members while they work: one may commit a step after it and publish its record, and its
    sender delivers what it queued before it ends. The coordinator takes records until every member's heartbeats
    have stopped (r60: the records of a step committed and a checkpoint written after a Ctrl-C were lost, and the
    run's records lacked a step). Here member 0 beats and publishes for a while after the stop; member 1 is quiet
    from the start. The limit is far past this test's bound: only the heartbeats' end can end the wait."""
    from unbroken.control.store import keys
    from unbroken.control.store.connect import connect_store, publish_record
    from unbroken.core.records import RecordKind, make

    token = new_token()
    with in_process_coordinator(tmp_path, token) as coordinator:
        coordinator.epochs.members = (0, 1)
        for wid in coordinator.members:
            coordinator.store.add(keys.heartbeat(wid), 0)  # as at admission
        worker = connect_store(coordinator.address, token=token)
        published: list[int] = []

        def member_0() -> None:
            for _ in range(10):  # 10 beats at 4 times the interval's pace, then its last records, then silence
                worker.add(keys.heartbeat(0), 1)
                time.sleep(coordinator.cfg.comm.heartbeat_interval_s / 4)
            for n in range(3):
                record = make(RecordKind.GATEWAY, time.time(), admitted=n, rejected=0, timed_out=0, dropped=0)
                publish_record(worker, record)
                published.append(n)

        beating = threading.Thread(target=member_0)
        beating.start()
        coordinator.drain_until_members_quiet(limit_s=600.0)
        beating.join()
        assert published == [0, 1, 2]
        assert [r["admitted"] for r in read_records(tmp_path / "run", "gateway")] == [0, 1, 2]


def test_a_ring_whose_key_never_came_holds_no_watcher(tmp_path: Path) -> None:
    """A ring of the workers' doorbell is two calls: the count, then its key. A ringer gone between them (a
    worker's close as it was excluded, when workers still rang it) left a count without a key, and a watcher
    that had read the count before it waited on that key for NEWS_WAIT_S while epochs were published: the
    survivors of a cut-off host never took its restarted workers in (tests/test_netns.py). The coordinator's
    next ring gives every count since its last one its key."""
    from unbroken.control.store import keys
    from unbroken.control.store.connect import connect_store, get_int, wait_key

    token = new_token()
    with in_process_coordinator(tmp_path, token) as coordinator:
        watching, ringer = (connect_store(coordinator.address, token=token) for _ in range(2))
        seen = get_int(watching, keys.doorbell_seq(keys.NEWS))  # a watcher reads the count ...
        ringer.add(keys.doorbell_seq(keys.NEWS), 1)  # ... someone takes the next number and never sets its key
        woken: list[bool] = []
        key = keys.doorbell(keys.NEWS, seen + 1)
        watcher = threading.Thread(target=lambda: woken.append(wait_key(watching, key, 30)))
        watcher.start()
        coordinator.publish((0,), "start")  # an epoch published
        watcher.join(timeout=60)
        assert woken == [True]


def test_the_ring_of_an_epoch_holds_its_record_and_every_other_ring_nothing(tmp_path: Path) -> None:
    """A watcher's get of the next ring waits for it and takes the ring's value for the epoch's record
    (``newsrelay.next_news``): it must be the published record itself. A stop's ring, and a count whose key the
    coordinator fills in, hold nothing, so a watcher woken by one looks at the store and reads the stop flag."""
    from unbroken.control.store import keys
    from unbroken.control.store.connect import connect_store, get_int

    token = new_token()
    with in_process_coordinator(tmp_path, token) as coordinator:
        store = connect_store(coordinator.address, token=token)
        coordinator.publish((0,), "start")
        rung = get_int(store, keys.doorbell_seq(keys.NEWS))
        assert store.get(keys.doorbell(keys.NEWS, rung)) == store.get(keys.epoch(coordinator.epoch))
        assert json.loads(store.get(keys.doorbell(keys.NEWS, rung)))["members"] == [0]
        store.add(keys.doorbell_seq(keys.NEWS), 1)  # a number taken whose key never came
        coordinator.stop("enough")
        rung_after = get_int(store, keys.doorbell_seq(keys.NEWS))
        assert rung_after == rung + 2
        assert [store.get(keys.doorbell(keys.NEWS, k)) for k in (rung + 1, rung + 2)] == [b"", b""]


def test_a_promoted_spare_is_taken_in_at_once_and_a_joiner_at_the_last_call(tmp_path: Path) -> None:
    """Joiners are taken in at a last call (registrations quiet for JOIN_QUIET_S), so that a burst of them makes
    one epoch change; a warm spare promoted to a dead worker's place is not one of a burst and is taken in at
    once. A joiner and a promoted spare register in the same look of the coordinator's loop (both requests are
    written before the count that announces them): the spare's epoch must not wait for the joiner's last call,
    and the joiner is taken in at its own, in a later epoch."""
    from unbroken.control.store import keys
    from unbroken.control.store.connect import connect_store, get_int, ring, wait_key

    def request(worker_id: int, **extra: object) -> str:
        return json.dumps({"worker_id": worker_id, "host": "h", "pid": 1, "returning": False, **extra})

    token = new_token()
    with in_process_coordinator(tmp_path, token) as coordinator:
        loop = threading.Thread(target=coordinator.run)
        loop.start()
        store, beats = (connect_store(coordinator.address, token=token) for _ in range(2))
        done = threading.Event()

        def beat() -> None:  # every worker's heartbeats, so that none is declared dead meanwhile
            while not done.wait(0.05):
                for wid in (0, 1, 5):
                    beats.add(keys.heartbeat(wid), 1)

        beater = threading.Thread(target=beat)
        beater.start()
        try:
            store.set(keys.register(store.add(keys.REGISTER_SEQ, 1)), request(0))  # the run's one expected worker
            ring(store)
            assert wait_key(store, keys.epoch(1), 60)
            seq = get_int(store, keys.REGISTER_SEQ)
            store.set(keys.register(seq + 1), request(-1))  # a joiner: it is given id 1
            store.set(keys.register(seq + 2), request(5, spare=0))  # spare 0, promoted to dead worker 5's place
            store.add(keys.REGISTER_SEQ, 2)
            ring(store)
            assert wait_key(store, keys.epoch(2), 60)
            assert json.loads(store.get(keys.epoch(2)))["members"] == [0, 5]  # the spare alone, at once
            assert wait_key(store, keys.epoch(3), 60)
        finally:
            store.set(keys.DONE, "1")
            ring(store)
            loop.join(timeout=60)
            done.set()
            beater.join()
    joins = [(m["members"], m["reason"]) for m in read_records(tmp_path / "run", "membership")][1:]
    assert joins == [([0, 5], "joined: 5"), ([0, 1, 5], "joined: 1")]


def _stop_every_thread(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every one of its threads is stopped (Linux /proc). ``kill`` returns once
    the signal is queued and one thread woken to start the group stop; on a loaded machine that thread can wait
    on the run queue for milliseconds while the others go on serving (clean run r26: a store call sent after
    the kill was answered)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30.0
    while True:
        states = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue  # a thread that ended meanwhile
        if states and all(state in ("T", "t") for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped 30 s after SIGSTOP: {states}"
        time.sleep(0.001)


def test_a_store_call_that_is_not_answered_is_cut_by_its_guard(tmp_path: Path) -> None:
    """A store call whose peer does not answer (here a coordinator stopped with SIGSTOP; a host cut off from
    the network is the same to the caller) waits for as long as the peer is silent, whatever the store's
    timeout: the agent's ``CallGuard`` cuts its tunnel past the limit, and the call fails instead."""
    from unbroken.control.coordinator.loop import spawn_coordinator
    from unbroken.control.store.connect import CallGuard, bind_listen_socket, open_store
    from unbroken.core.config import dump_config, load_config

    run = tmp_path / "run"
    run.mkdir()
    dump_config(load_config(TINY), run)
    token = new_token()
    sock = bind_listen_socket("127.0.0.1", 0)
    proc, address = spawn_coordinator(sock, run, 1, False, {**os.environ, "UNBROKEN_TOKEN": token})
    sock.close()
    try:
        store, tunnel = open_store(address, token=token)
        guard = CallGuard(limit_s=1.0)
        assert guard.call(tunnel, lambda: store.add("answered", 1)) == 1
        _stop_every_thread(proc.pid)
        with pytest.raises(RuntimeError):
            guard.call(tunnel, lambda: store.add("answered", 1))  # without the guard: until SIGCONT
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def _listening_fds(port: int) -> list[int]:
    """This process's descriptors of TCP sockets listening on ``port`` (Linux /proc)."""
    inodes = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # 0A: LISTEN
                    inodes.add(fields[9])
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            fds.append(int(fd))
    return fds


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.timeout(60)
def test_the_store_alone_owns_its_listening_descriptor(tmp_path: Path) -> None:
    """torch's store closes the listening descriptor it is handed when it is destroyed; a Python socket still
    holding the number would close it a second time, by then perhaps another socket of this process (in a
    thread job: a tunnel's store connection cut during its validation, a selector left with a stale entry)."""
    import gc

    from unbroken.control.coordinator import loop as coordinator_module
    from unbroken.control.store.connect import bind_listen_socket
    from unbroken.core.config import dump_config, load_config

    cfg = load_config(TINY)
    dump_config(cfg, tmp_path)
    coordinator = coordinator_module.Coordinator(
        bind_listen_socket("127.0.0.1", 0), cfg, tmp_path, 1, False, token=new_token()
    )
    try:
        (fd,) = _listening_fds(coordinator.gateway.internal[1])
        holders = [o for o in gc.get_objects() if type(o) is socket.socket and o.fileno() == fd]
        assert holders == [], holders
    finally:
        coordinator.gateway.close()
        coordinator.metrics.close()
        if coordinator.status is not None:
            coordinator.status.close()


@pytest.mark.timeout(60)
def test_the_first_reason_to_stop_is_the_one_kept() -> None:
    """Every worker stops for one reason (an op without a deterministic implementation) and exits; the launcher,
    seeing nobody left, asks for a stop too before the coordinator read the first: the run's line must stay the
    workers' reason (CI: "every worker exited and none is due to restart" replaced it)."""
    from unbroken.control.host.agent import Agent
    from unbroken.control.host.command import WorkerCommand
    from unbroken.control.store import keys

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    agent = Agent([0], WorkerCommand(("true",)), {}, Path("."))
    agent.link.store = store
    agent.stop_job("the first reason")
    agent.stop_job("every worker exited and none is due to restart")
    assert store.get(keys.STOP).decode() == "the first reason"


@pytest.mark.timeout(60)
def test_a_worker_stopped_after_the_run_finished_is_no_failure_of_its_agent(tmp_path: Path) -> None:
    """Real processes, no coordinator. Once the run finished (its last members known), a worker that has not
    ended within the grace (one cut off from the coordinator as the run ended cannot learn that it did) is
    stopped and counted with the latecomers, not as a failure; after a stop (no finished run) it still counts."""
    from unbroken.control.host.agent import Agent
    from unbroken.control.host.command import WorkerCommand

    sleeper = WorkerCommand((sys.executable, "-c", "import time; time.sleep(60)"))
    for finished in (True, False):
        agent = Agent([0, 1], sleeper, dict(os.environ), tmp_path)
        agent.start_all()
        if finished:
            assert agent.stop_latecomers([0]) == [1]  # worker 1 was not in the last membership
        agent.stop_workers(grace_s=0.1)
        assert all(p.returncode == -signal.SIGKILL for p in agent.workers.values())
        assert agent.supervisor.late == ({0, 1} if finished else set())


def test_the_agents_wait_ends_when_a_restart_or_the_end_of_a_pause_falls_due() -> None:
    """Between looks the launcher and the agent sleep ``Agent.wait_s`` (unless an exit wakes them). A restart due
    sooner than the idle wait must shorten it: a worker killed with ``rejoin=0.1`` was restarted up to 0.25 s
    late, after a short run had ended without it (CI: its "restarted too late" line missing)."""
    from unbroken.control.host.agent import Agent
    from unbroken.control.host.command import WorkerCommand
    from unbroken.control.host.supervisor import IDLE_WAIT_S, POLL_S

    agent = Agent([0, 1], WorkerCommand(("true",)), {}, Path("."))
    workers = agent.supervisor
    assert agent.wait_s() == IDLE_WAIT_S
    now = time.monotonic()
    workers.down[1] = {"rejoin": None, "at": now, "hung": True}  # restarted by nobody: no deadline
    assert agent.wait_s() == IDLE_WAIT_S
    workers.down[0] = {"rejoin": 0.1, "at": now, "hung": False}
    assert POLL_S <= agent.wait_s() <= 0.1
    workers.down[0]["at"] = now - 5  # overdue (its replica not ended yet): looks at the fast pace, no busy loop
    assert agent.wait_s() == POLL_S
    workers.down.clear()
    workers.pauses[1] = time.monotonic() + 0.05
    assert POLL_S <= agent.wait_s() <= 0.05
    workers.pauses.clear()
    # A failure schedule does not shorten it: a worker at an injection point wakes the wait (its pipe).
    scheduled = Agent([0, 1], WorkerCommand(("true",)), {}, Path("."), injections=True)
    assert scheduled.wait_s() == IDLE_WAIT_S and scheduled.wake_fds()
    scheduled.close()
    assert not scheduled.wake_fds()


@pytest.mark.timeout(60)
def test_waiting_for_workers_wakes_once_at_an_exit_then_sleeps_on_the_rest() -> None:
    """The launcher's and the agent's loops sleep in ``wait_for_exit`` between looks. A worker that exited wakes
    the wait once (it is reaped then); after that the wait sleeps its full timeout on the workers still running.
    It used to wake at once on every call for as long as an exited worker was not reaped (its pidfd stays
    readable): after a run's final record, when the agent stops reaping, the launcher's loop spun through
    thousands of looks a second until the coordinator exited."""
    from unbroken.control.host.processes import wait_for_exit

    done = subprocess.Popen([sys.executable, "-c", "pass"])
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wait_for_exit([done, running], 60.0)  # returns at done's exit
        assert done.returncode == 0 and running.returncode is None
        timeout_s = 0.2
        for _ in range(3):
            started = time.monotonic()
            wait_for_exit([done, running], timeout_s)
            # No process exited: only the timeout may end the sleep, so it lasts at least that (a loaded machine
            # can only make it longer).
            assert time.monotonic() >= started + timeout_s
    finally:
        running.kill()
        running.wait()


def test_a_stop_is_asked_for_once_whoever_asks() -> None:
    """Workers, agents and the coordinator all stop the job through ``request_stop``: the first caller is told its
    reason is kept, a later one with another reason that it is not (the same reason again is still the one kept: two
    workers that saw the same thing), and the stored reason never changes."""
    from unbroken.control.store import keys
    from unbroken.control.store.connect import request_stop

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    assert request_stop(store, "worker 1: the loss is not finite")
    assert not request_stop(store, "coordinator: every worker exited")
    assert request_stop(store, "worker 1: the loss is not finite")
    assert store.get(keys.STOP).decode() == "worker 1: the loss is not finite"


def test_a_late_heartbeat_s_stacks_show_each_thread_innermost_call_first() -> None:
    """What a worker logs when its heartbeat is late (``thread_stacks``, read under the GIL): one block per thread,
    named, its innermost call on the line after the name and the thread's start on the last."""
    from unbroken.control.member.client import thread_stacks

    release = threading.Event()

    def parked_in_a_known_function() -> None:
        release.wait(60)

    thread = threading.Thread(target=parked_in_a_known_function, name="parked")
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while "parked_in_a_known_function" not in (text := thread_stacks()) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        release.set()
        thread.join(timeout=10)
    block = next(b for b in text.split("\n\n") if b.startswith("Thread parked (most recent call first):"))
    lines = block.splitlines()
    assert lines[1].startswith('  File "') and lines[1].endswith(" in wait"), block  # Condition.wait, in Event.wait
    assert any(line.endswith(" in parked_in_a_known_function") for line in lines), block
    assert lines[-1].endswith(" in _bootstrap"), block
    assert "Thread MainThread (most recent call first):" in text


def test_a_failure_s_why_reads_back_as_its_exit_code_or_its_exception() -> None:
    """``keys.dead``'s text for a process's end (and the failure record's, ``process_failure`` of it) gives back
    its exit code; a reported exception's failure text gives back its headline; neither reads as the other, and a
    lost heartbeat or an exclusion reads as neither."""
    for code in (-signal.SIGKILL, -signal.SIGABRT, -signal.SIGSEGV, 1, 3, 7, 255):
        assert exit_code_in(exit_reason(code)) == code
        assert exit_code_in(process_failure(exit_reason(code))) == code
        assert raised_headline(process_failure(exit_reason(code))) is None
    assert exit_reason(-signal.SIGKILL) == "killed by SIGKILL"
    for headline in ("ValueError: exited with status 1 in the data", "RuntimeError at loop.py:12 in step"):
        why = raised_failure(headline)
        assert raised_headline(why) == headline
        assert exit_code_in(why) is None, why
    for why in ("no heartbeat for 2.10 s", "excluded"):
        assert exit_code_in(why) is None and raised_headline(why) is None, why
