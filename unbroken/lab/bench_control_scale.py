"""``unbroken bench control-scale``: the real coordinator and gateway against hundreds of members (issue 33).

The coordinator is a child process started as the launcher starts one (``spawn_coordinator``: its gateway in
front of its store, the job's token). Every member is a ``control.member.client.CoordinatorClient``, the code path of a
worker for everything the coordinator sees: admission with the token, a heartbeat every interval, the epoch
watch on the workers' doorbell, the metrics records (the leader's step record every ``STEP_S``, with every
member's speed and quota, as ``ft.commit`` writes it). There is no model, no data and no collective. The
members live in processes of their own as a cluster's do on hosts of their own: one leader member in the driver
process, V victims of one member each (so that a death is a real ``kill -9`` and a hang a real ``SIGSTOP``),
and the rest in "crowd" processes of at most ``CROWD`` members each (threads), whose own client side (one tunnel
loop, one GIL per process) is then shared by ``CROWD`` members, not by all of them. A crowd stands for a host:
with ``--news relay`` its members take the coordinator's news from a relay in a process of its own, as a host's
workers take it from their agent's (``control.member.news``); with ``direct`` each watches the coordinator. The
joiners are a crowd started with the others that opens its members only when told to. Each crowd tells the
driver, on its stdout, its members' ids and, for each epoch, when each of its members read it. Every run of the
driver is a child process (``bench_control_scale``), so its processes, threads and sockets end with it.

Measured at each N:

- **death**: a victim killed, its death reported as an agent reports a process exit (``report_death``) at
  ``t``; -> the epoch without it published (the time in its record), -> each member's watcher has read it
  (its ``on_epoch``): p50 and p99 over members and deaths, and the last; the coordinator's CPU from ``t`` to
  that last read, beside what its rate at rest gives over as long (heartbeats go on meanwhile: the difference
  is what the fan-out itself cost it, if the machine let it run);
- **silence**: a victim stopped (``SIGSTOP``) with nobody reporting: -> the epoch without it (the heartbeat
  timeout, then the coordinator's check);
- **joins**: ``JOINS`` new members, connected beforehand, registering at once: how many epochs took them in,
  seconds from their start to the epoch holding the last of them (its record's time), and each one's wait from
  its admission to the first epoch holding it (the coordinator's own records);
- the coordinator's CPU (cores: its user + system time over the wall time, from /proc) and RSS, at rest and
  over the churn (the deaths and the joins);
- metrics.jsonl's growth per hour at rest.

One machine, one clock: the members and the coordinator compare ``time.time()``. ``CROWD`` members share a
process and its tunnel loop, where real workers each have their own, and every process shares the machine's two
cores with the coordinator: the "every member has read it" figures include that crowded client side, so they
overstate what a real member waits.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import faulthandler
import itertools
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from unbroken.control.coordinator.loop import spawn_coordinator
from unbroken.control.member.client import CoordinatorClient
from unbroken.control.member.hostbeat import HOST_BEAT_ENV, BeatBoard, HostBeats, WorkerBeat
from unbroken.control.member.news import RELAY_ENV, NewsRelay
from unbroken.control.store import keys
from unbroken.control.store.connect import bind_listen_socket, connect_store, read_json, report_death
from unbroken.control.store.gateway import TOKEN_ENV, new_token
from unbroken.core.config import dump_config, load_config, preset_path
from unbroken.core.plan import agreed_speed
from unbroken.core.records import METRICS_FILE, RecordKind, make, read_records
from unbroken.ft.sidevec import WORKER_SLOTS

DEFAULT_MEMBERS = (64, 256, 512, 1024)
# How the crowds' members take the coordinator's news: from a relay process per crowd (as an agent runs one per
# host, ``control.member.news``), or each from the coordinator itself.
NEWS_MODES = ("relay", "direct")
# Who sends the members' heartbeats: each member (``comm.heartbeats = "worker"``), or a process per crowd, and one
# for the victims, as an agent sends its host's (``"host"``, ``control.member.hostbeat``).
BEATS_MODES = ("worker", "host")
BOARD_ENV = "UNBROKEN_BENCH_BOARD"  # a crowd's board: member k beats on slot k
VICTIMS = 4  # V: V - 1 deaths, then one silence
JOINS = 64
REST_S = 10.0  # the window of the at-rest figures
STEP_S = 1.0  # the leader's step records at rest: one a second
SETTLE_S = 1.0  # between two faults
CONNECTORS = 16  # members of a crowd started at a time
CROWD = 128  # members per crowd process at most
# The crowds yield the CPU to the coordinator, which a cluster gives a host of its own; they share what is left.
CROWD_NICE = 10
WAIT_S = 120.0  # for anything the bench waits on


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class _Usage:
    """The coordinator's CPU (cores) between ``__init__`` and ``cores()``."""

    def __init__(self, pid: int) -> None:
        self.pid, self.t0, self.cpu0 = pid, time.monotonic(), _cpu_seconds(pid)

    def cores(self) -> float:
        return (_cpu_seconds(self.pid) - self.cpu0) / max(1e-9, time.monotonic() - self.t0)


def _wait(condition: Any, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench control-scale: timed out waiting for {what}")
        time.sleep(0.002)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class _Crowd:
    """A crowd process as the driver sees it: its members' ids (once each has an epoch), and when each read each
    later epoch (its reports)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.ids: list[int] = []
        self.relayed = 0  # members whose news came from a relay when they were admitted
        self.ready = threading.Event()
        self.connected = threading.Event()  # a held crowd: every member connected, waiting to register
        self.reads: dict[int, list[float]] = {}  # epoch -> when each member read it (once all of them had)
        self.lock = threading.Lock()
        threading.Thread(target=self._listen, name="crowd-reports", daemon=True).start()

    def _listen(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            report = json.loads(line)
            if "connected" in report:
                self.connected.set()
            elif "ids" in report:
                self.ids = report["ids"]
                self.relayed = report["relayed"]
                self.ready.set()
            else:
                with self.lock:
                    self.reads[report["epoch"]] = report["times"]

    def read(self, epoch: int) -> list[float] | None:
        with self.lock:
            return self.reads.get(epoch)

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()


class Driver:
    """One coordinator and ``members`` members; the figures of one N (``run``)."""

    def __init__(
        self,
        members: int,
        work: Path,
        news: str = NEWS_MODES[0],
        joins: int = JOINS,
        rest_s: float = REST_S,
        beats: str = BEATS_MODES[0],
    ) -> None:
        if members < VICTIMS + 2:
            raise ValueError(f"--members {members}: each count must be at least {VICTIMS + 2}")
        if news not in NEWS_MODES:
            raise ValueError(f"--news {news}: allowed: {', '.join(NEWS_MODES)}")
        if beats not in BEATS_MODES:
            raise ValueError(f"--beats {beats}: allowed: {', '.join(BEATS_MODES)}")
        self.n, self.work, self.news, self.joins, self.rest_s = members, work, news, joins, rest_s
        self.beats = beats
        self.token = new_token()
        self.cfg = load_config(str(preset_path("tiny")), ["--comm.join_timeout_s=600"])
        self.run_dir = work / "run"
        self.run_dir.mkdir(parents=True)
        dump_config(self.cfg, self.run_dir)
        self.leader: CoordinatorClient | None = None  # the one member of the driver process
        self.seen: dict[int, list[float]] = {}  # epoch -> when the leader read it
        self.crowds: list[_Crowd] = []
        self.joiners: _Crowd | None = None
        self.joiner_ids: set[int] = set()
        self.victims: dict[int, subprocess.Popen[bytes]] = {}  # worker id -> its process
        self.processes: list[subprocess.Popen[Any]] = []  # every child started: ``close`` ends them

    def _on_epoch(self, epoch: int, _members: tuple[int, ...]) -> None:
        self.seen.setdefault(epoch, []).append(time.time())

    def _env(self) -> dict[str, str]:
        return {**os.environ, TOKEN_ENV: self.token, "TORCH_CPP_LOG_LEVEL": "ERROR"}

    def _start_victims(self) -> list[subprocess.Popen[bytes]]:
        """``VICTIMS`` processes of one member each; each prints its id once admitted (``_take_victims``)."""
        cmd = [sys.executable, "-m", "unbroken.lab.bench_control_scale", "--victim", self.address]
        envs = [self._env() for _ in range(VICTIMS)]
        if self.beats == "host":  # the victims' "host": victim k beats on slot k of its board
            board = self._start_host_beats()
            for k, env in enumerate(envs):
                env[HOST_BEAT_ENV] = f"{k}:{board}"
        started = [subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env) for env in envs]
        self.processes += started
        return started

    def _take_victims(self, started: list[subprocess.Popen[bytes]]) -> None:
        for proc in started:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.strip():
                raise RuntimeError("bench control-scale: a victim process did not join")
            self.victims[int(line)] = proc

    def _start_host_beats(self) -> str:
        """A process that passes the beats of a board's members on, as an agent does its host's; its board's
        path."""
        comm = self.cfg.comm
        cmd = [sys.executable, "-m", "unbroken.lab.bench_control_scale", "--host-beats", self.address]
        cmd += ["--interval", str(comm.heartbeat_interval_s), "--timeout", str(comm.heartbeat_timeout_s)]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self._env())
        self.processes.append(proc)
        assert proc.stdout is not None
        path = proc.stdout.readline().strip()
        if not path:
            raise RuntimeError("bench control-scale: a host-beats process did not start")
        return path

    def _start_crowd(self, count: int, hold: bool) -> _Crowd:
        """A crowd process of ``count`` members; with news by relay, its "host's" relay first, in a process of
        its own as an agent's is."""
        comm = self.cfg.comm
        env = self._env()
        if self.news == "relay":
            cmd = [sys.executable, "-m", "unbroken.lab.bench_control_scale", "--relay", self.address]
            cmd += ["--timeout", str(comm.heartbeat_timeout_s)]
            relay = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            self.processes.append(relay)
            assert relay.stdout is not None
            path = relay.stdout.readline().strip()
            if not path:
                raise RuntimeError("bench control-scale: a relay process did not start")
            env[RELAY_ENV] = path
        if self.beats == "host":
            env[BOARD_ENV] = self._start_host_beats()
        cmd = [sys.executable, "-m", "unbroken.lab.bench_control_scale", "--crowd", self.address]
        cmd += ["--count", str(count), "--interval", str(comm.heartbeat_interval_s)]
        cmd += ["--timeout", str(comm.heartbeat_timeout_s), *(["--hold"] if hold else [])]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.processes.append(proc)
        return _Crowd(proc)

    @staticmethod
    def _wait_crowd(event: threading.Event, what: str) -> None:
        """Wait for a crowd's ``event`` (its ``ready`` or ``connected``); ``what`` names it in the error."""
        if not event.wait(WAIT_S * 5):
            raise RuntimeError(f"bench control-scale: a crowd process is not {what}")

    def _epoch_without(self, wid: int) -> dict[str, Any]:
        """The first epoch published that no longer holds ``wid`` (waited for)."""
        found: dict[str, Any] = {}

        def published() -> bool:
            newest = int(self.store.get(keys.EPOCH))
            for epoch in range(self.last_epoch + 1, newest + 1):
                record = read_json(self.store, keys.epoch(epoch))
                if wid not in record["members"]:
                    found.update(record)
                    return True
            return False

        _wait(published, f"an epoch without worker {wid}")
        self.last_epoch = found["epoch"]
        return found

    def _read_by_all(self, epoch: int) -> list[float]:
        """When each member (the leader and every crowd's) read ``epoch``, once all of them have."""
        _wait(
            lambda: bool(self.seen.get(epoch)) and all(c.read(epoch) is not None for c in self.crowds),
            f"every member reading epoch {epoch}",
        )
        return [*self.seen[epoch], *(t for c in self.crowds for t in c.read(epoch) or [])]

    def _wait_records(self, kind: str, holds: Any, what: str) -> list[dict[str, Any]]:
        """The run's ``kind`` records once ``holds(records)``: the coordinator writes them at its next drain."""
        found: list[dict[str, Any]] = []

        def written() -> bool:
            found[:] = read_records(self.run_dir, kind)
            return bool(holds(found))

        _wait(written, what)
        return found

    def run(self) -> dict[str, Any]:
        """Start the coordinator and the members, then measure; ``close`` ends them (call it whatever happens)."""
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the coordinator and the crowds inherit it
        sock = bind_listen_socket("127.0.0.1", 0)
        self.coordinator, self.address = spawn_coordinator(sock, self.run_dir, self.n, False, self._env())
        self.processes.append(self.coordinator)
        sock.close()
        return self._measure()

    def close(self, members: bool) -> None:
        """End the crowds, the victims and the coordinator; with ``members``, first close the leader member."""
        if members and self.leader is not None:
            self.leader.close()
        for proc in reversed(self.processes):  # the coordinator last: its relays, which follow it, first
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def _measure(self) -> dict[str, Any]:
        """The bench's phases in order, each adding its figures: start, rest, deaths, a hang, joins."""
        self.store = connect_store(self.address, token=self.token)
        result: dict[str, Any] = {"members": self.n, "news": self.news, "beats": self.beats}
        result |= self._start_members()
        result |= self._at_rest()
        churn = _Usage(self.coordinator.pid)  # the coordinator's use over the deaths, the hang and the joins
        result |= self._deaths(result["rest_cores"])
        result |= self._joins(churn)
        result["relayed"] = sum(c.relayed for c in self.crowds)
        return result

    def _start_members(self) -> dict[str, Any]:
        """The victims, the crowds, the held joiners and the leader member; until the first epoch."""
        t_start = time.monotonic()
        crowded = self.n - 1 - VICTIMS
        count = -(-crowded // CROWD)  # crowds, of sizes as equal as can be
        sizes = [crowded // count + (i < crowded % count) for i in range(count)]
        victims = self._start_victims()
        self.crowds = [self._start_crowd(size, hold=False) for size in sizes]
        self.joiners = self._start_crowd(self.joins, hold=True)
        comm = self.cfg.comm
        self.leader = CoordinatorClient(
            self.address, None, comm.heartbeat_interval_s, comm.heartbeat_timeout_s, token=self.token
        )
        self.leader.on_epoch = self._on_epoch
        self._take_victims(victims)
        for crowd in self.crowds:
            self._wait_crowd(crowd.ready, "ready")
        _wait(lambda: self.leader is not None and self.leader.latest_epoch >= 1, "the first epoch")
        self.last_epoch = int(self.store.get(keys.EPOCH))
        return {"crowds": len(self.crowds), "started_s": time.monotonic() - t_start}

    def _at_rest(self) -> dict[str, Any]:
        """At rest: heartbeats, the epoch watch, and the leader's step record every STEP_S, for ``rest_s``."""
        assert self.leader is not None
        metrics = self.run_dir / METRICS_FILE
        size0, t0, usage = metrics.stat().st_size, time.monotonic(), _Usage(self.coordinator.pid)
        everyone = [self.leader.worker_id, *(w for c in self.crowds for w in c.ids), *self.victims]
        step = 0
        while time.monotonic() - t0 < self.rest_s:
            self.leader.publish_metrics(_step_record(step, everyone))
            step += 1
            time.sleep(STEP_S)
        self.leader.flush_metrics()
        last = step - 1
        self._wait_records("step", lambda found: any(r["step"] == last for r in found), f"step record {last}")
        return {
            "rest_cores": usage.cores(),
            "rest_rss_mib": _rss_mib(self.coordinator.pid),
            "metrics_bytes_per_hour": (metrics.stat().st_size - size0) / (time.monotonic() - t0) * 3600,
        }

    def _deaths(self, rest_cores: float) -> dict[str, Any]:
        """Deaths reported as an agent reports them, then a silent hang: when each epoch was published and read
        by every member, and what each cost the coordinator beside its at-rest rate ``rest_cores``."""
        deaths: list[dict[str, float]] = []
        read_after: list[float] = []
        victim_ids = list(self.victims)
        for wid in victim_ids[:-1]:
            time.sleep(SETTLE_S)
            proc = self.victims[wid]
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            t_report, cpu0 = time.time(), _cpu_seconds(self.coordinator.pid)
            report_death(self.store, wid, "killed by SIGKILL")
            record = self._epoch_without(wid)
            reads = self._read_by_all(record["epoch"])
            cpu = _cpu_seconds(self.coordinator.pid) - cpu0
            read_after += [t - t_report for t in reads]
            deaths.append({"published": record["time"] - t_report, "last_read": max(reads) - t_report, "cpu": cpu})
            deaths[-1]["cpu_at_rest"] = rest_cores * deaths[-1]["last_read"]  # its at-rest rate over the same time
        time.sleep(SETTLE_S)
        hung = victim_ids[-1]
        self.victims[hung].send_signal(signal.SIGSTOP)
        t_stop = time.time()
        silence_s = self._epoch_without(hung)["time"] - t_stop
        self.victims[hung].kill()
        time.sleep(SETTLE_S)
        return {
            "death_published_s": [d["published"] for d in deaths],
            "death_last_read_s": [d["last_read"] for d in deaths],
            "death_coordinator_cpu_s": [d["cpu"] for d in deaths],
            "death_coordinator_cpu_at_rest_s": [d["cpu_at_rest"] for d in deaths],
            "read_p50_s": statistics.median(read_after),
            "read_p99_s": _percentile(read_after, 0.99),
            "silence_s": silence_s,
            "heartbeat_timeout_s": self.cfg.comm.heartbeat_timeout_s,
        }

    def _joins(self, churn: _Usage) -> dict[str, Any]:
        """The held joiners let go at once: the epochs that took them in, and how long each waited after its
        admission; members declared dead that nobody killed; the coordinator's use over the churn (``churn``)."""
        first_new_epoch = int(self.store.get(keys.EPOCH)) + 1
        self._wait_crowd(self.joiners.connected, "connected")
        t_joins = time.time()
        self.joiners.go()
        self._wait_crowd(self.joiners.ready, "ready")
        ids = self.joiner_ids = set(self.joiners.ids)
        taken_in: dict[int, float] = {}  # joiner -> the time of the first epoch holding it
        joined_epochs: set[int] = set()
        looked = first_new_epoch - 1

        def all_in() -> bool:
            nonlocal looked
            newest = int(self.store.get(keys.EPOCH))
            for epoch in range(looked + 1, newest + 1):
                record = read_json(self.store, keys.epoch(epoch))
                for wid in ids & set(record["members"]) - set(taken_in):
                    taken_in[wid] = record["time"]
                    joined_epochs.add(epoch)
            looked = newest
            return set(taken_in) == ids

        _wait(all_in, "an epoch holding each joiner")
        admitted_records = self._wait_records(
            "admitted", lambda found: ids <= {r["worker"] for r in found}, "the joiners' admitted records"
        )
        admitted = {r["worker"]: r["time"] for r in admitted_records if r["worker"] in ids}
        waits = [taken_in[w] - admitted[w] for w in ids]
        # Members declared dead that nobody killed or stopped: heartbeats their process could not send in time.
        false_deaths = [f for f in read_records(self.run_dir, "failure") if f["worker"] not in self.victims]
        return {
            "joins": self.joins,
            "join_epochs": len(joined_epochs),
            "false_deaths": len(false_deaths),
            "join_s": max(taken_in.values()) - t_joins,
            "join_admitted_spread_s": max(admitted.values()) - min(admitted.values()),
            "join_wait_median_s": statistics.median(waits),
            "join_wait_max_s": max(waits),
            "churn_cores": churn.cores(),
            "churn_rss_mib": _rss_mib(self.coordinator.pid),
        }


def _step_record(step: int, members: list[int]) -> dict[str, Any]:
    """A step record as the leader publishes one (``ft.commit``): every member's quota, and the speed of each
    member with a slot in the side vector, as the group agrees it (``plan.agreed_speed``)."""
    quotas = {str(w): 1 for w in members}
    jitter = random.Random(step)
    speeds = {str(w): agreed_speed(0.1 + jitter.uniform(-0.01, 0.01)) for w in members if w < WORKER_SLOTS}
    fields = {"loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 1.0, "tokens": 512 * len(members)}
    fields |= {"alive": len(members), "epoch": 1, "microbatches": len(members), "committed": True}
    fields |= {"recomputed": 0, "dropped": 0, "recoveries": 0, "efficient": 0}
    return make(RecordKind.STEP, time.time(), step=step, quotas=quotas, speeds=speeds, **fields)


def _victim_main(address: str) -> None:
    """A victim: one member in a process of its own; prints its id, then lives until it is killed."""
    client = CoordinatorClient(address, None)
    print(client.worker_id, flush=True)
    while True:
        signal.pause()


def _relay_main(address: str, timeout_s: float) -> None:
    """A crowd's "host's" relay (``control.member.news``): prints its socket's path once it follows the
    coordinator, then relays until its stdin closes (the driver ended). At the crowds' priority: it is the hosts'
    side of the fan-out, as an agent is."""
    os.nice(CROWD_NICE)
    relay = NewsRelay(max(1.0, timeout_s))
    relay.follow(address, os.environ[TOKEN_ENV])
    _wait(lambda: relay.following, "the relay following the coordinator")
    print(relay.path, flush=True)
    sys.stdin.read()
    relay.close()
    os._exit(0)


def _host_beats_main(address: str, interval_s: float, timeout_s: float) -> None:
    """A crowd's (or the victims') "host's" heartbeats (``control.member.hostbeat``): prints its board's path, then
    passes the beats on until its stdin closes (the driver ended). At the crowds' priority, as the relay."""
    os.nice(CROWD_NICE)
    beats = HostBeats(interval_s, max(1.0, timeout_s))
    beats.follow(address, os.environ[TOKEN_ENV])
    print(beats.board.path, flush=True)
    sys.stdin.read()
    beats.close()
    os._exit(0)


class _GatedClient(CoordinatorClient):
    """A member that opens its connections, then waits for ``gate`` before it registers: the joiners' registrations
    arrive together, as replacements started ahead of need would send theirs, instead of spread over the seconds
    that opening hundreds of connections takes on this machine."""

    def __init__(self, gate: threading.Event, arrived: threading.Semaphore, *args: Any, **kwargs: Any) -> None:
        self._gate, self._arrived = gate, arrived
        super().__init__(*args, **kwargs)

    def _register(self, worker_id: int | None, returning: bool) -> tuple[int, bool]:
        self._arrived.release()
        self._gate.wait()
        return super()._register(worker_id, returning)


def _crowd_main(address: str, count: int, interval_s: float, timeout_s: float, hold: bool) -> None:
    """A crowd: ``count`` members in this process. With ``hold``, they open their connections, print
    ``{"connected": count}``, and register together after a ``go`` line on stdin. Prints ``{"ids": [...]}`` once
    every member is admitted (and, without ``hold``, has the first epoch), then ``{"epoch": e, "times": [...]}``
    for each later epoch once all its members have read it; exits when its stdin closes (the driver ended)."""
    os.nice(CROWD_NICE)
    seen: dict[int, list[float]] = collections.defaultdict(list)
    lock = threading.Lock()
    out: IO[str] = sys.stdout

    def tell(report: dict[str, Any]) -> None:
        with lock:
            out.write(json.dumps(report) + "\n")
            out.flush()

    def on_epoch(epoch: int, _members: tuple[int, ...]) -> None:
        times = seen[epoch]
        times.append(time.time())  # list.append is atomic
        if len(times) == count:  # the last of this crowd to read it: one report, from its watcher
            tell({"epoch": epoch, "times": list(times)})

    gate, arrived = threading.Event(), threading.Semaphore(0)
    if not hold:
        gate.set()

    board = BeatBoard.attach(os.environ[BOARD_ENV]) if os.environ.get(BOARD_ENV) else None
    slots = iter(range(count))
    slot_lock = threading.Lock()

    def member() -> CoordinatorClient:
        beat = None
        if board is not None:
            with slot_lock:
                beat = WorkerBeat(board, next(slots))
        client = _GatedClient(gate, arrived, address, None, interval_s, timeout_s, host_beat=beat)
        client.on_epoch = on_epoch
        return client

    with concurrent.futures.ThreadPoolExecutor(count if hold else CONNECTORS) as pool:
        made = [pool.submit(member) for _ in range(count)]
        if hold:
            for _ in range(count):
                arrived.acquire()
            tell({"connected": count})
            if sys.stdin.readline().strip() != "go":
                os._exit(0)
            gate.set()
        clients = [m.result() for m in made]
    # The first epoch can come before a member's watcher starts (it then reads it at its start, not as news).
    _wait(lambda: all(c.latest_epoch >= 1 for c in clients), "the first epoch")
    if os.environ.get(RELAY_ENV):  # every member reading its relay before the faults (it connects at its start)
        _wait(lambda: all(c.relayed for c in clients), "every member on the relay")
    tell({"ids": [c.worker_id for c in clients], "relayed": sum(c.relayed for c in clients)})
    sys.stdin.read()  # EOF: the driver is gone
    os._exit(0)  # members' threads in store calls: no interpreter shutdown under them


def bench_control_scale(
    member_counts: list[int], news_modes: tuple[str, ...] = NEWS_MODES, beats_modes: tuple[str, ...] = BEATS_MODES[:1]
) -> list[dict[str, Any]]:
    """The driver once per N, way of taking the news and sender of the heartbeats, each in a fresh process; their
    figures in order (a failed one: ``failed``)."""
    results = []
    for n, news, beats in itertools.product(member_counts, news_modes, beats_modes):
        with tempfile.TemporaryDirectory(prefix="control-scale-") as tmp:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, "-m", "unbroken.lab.bench_control_scale", "--members", str(n), "--work", tmp]
            env = {k: v for k, v in os.environ.items() if k != RELAY_ENV} | {"TORCH_CPP_LOG_LEVEL": "ERROR"}
            cmd += ["--news", news, "--beats", beats, "--out", str(out)]
            done = subprocess.run(cmd, env=env, timeout=20 * 60, check=False)
            if done.returncode != 0 or not out.exists():  # a row that says so; the others still run
                failed = f"the driver exited {done.returncode} (its stderr above)"
                results.append({"members": n, "news": news, "beats": beats, "failed": failed})
                continue
            results.append(json.loads(out.read_text()))
    return results


def format_control_scale(results: list[dict[str, Any]]) -> str:
    def s(x: float) -> str:
        return f"{x:.3f}"

    out = [
        f"the real coordinator (a child process) and N members: 1 in the driver, {VICTIMS} processes of one member "
        f"each, the rest in processes of at most {CROWD}; {VICTIMS - 1} deaths reported (kill -9), "
        f"1 hang (SIGSTOP), {JOINS} joins (a process of their own); news: the crowds' members read the coordinator's "
        "news from a relay per crowd (a process of its own, as a host's agent runs one) or each from the coordinator",
        "",
        "| members | news | death -> epoch published (s) | death -> every member read it: p50 / p99 / last (s) "
        "| coordinator CPU from a death's report to its last read, and at its rest rate over as long (s) "
        "| hang -> epoch (s) | joins: how many, in how many epoch changes, over the admissions' spread; "
        "admission -> epoch, median / max (s) | coordinator at rest: cores, RSS MiB | churn: cores, RSS MiB "
        "| metrics MB/h | start (s) | false deaths |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        beats = "; heartbeats by host (a process a crowd, one for the victims)" if r.get("beats") == "host" else ""
        if "failed" in r:
            out.append(f"| {r['members']} | {r['news']}{beats} | did not finish: {r['failed']} |" + " |" * 9)
            continue
        published = statistics.median(r["death_published_s"])
        last = max(r["death_last_read_s"])
        news = r["news"]
        if news == "relay":
            relays = f"{r['crowds']} relay" + ("s" if r["crowds"] > 1 else "")
            news = f"relay: {r['relayed']} members on {relays} (the joiners on 1 more)"
        news += beats
        out.append(
            f"| {r['members']} | {news} | {s(published)} (max {s(max(r['death_published_s']))}) "
            f"| {s(r['read_p50_s'])} / {s(r['read_p99_s'])} / {s(last)} "
            f"| {s(statistics.median(r['death_coordinator_cpu_s']))} "
            f"({s(statistics.median(r['death_coordinator_cpu_at_rest_s']))} at rest) "
            f"| {s(r['silence_s'])} (timeout {r['heartbeat_timeout_s']:g}) "
            f"| {r['joins']} in {r['join_epochs']} over {r['join_admitted_spread_s']:.1f} s; "
            f"{s(r['join_wait_median_s'])} / "
            f"{s(r['join_wait_max_s'])} "
            f"| {r['rest_cores']:.2f}, {r['rest_rss_mib']:.0f} | {r['churn_cores']:.2f}, {r['churn_rss_mib']:.0f} "
            f"| {r['metrics_bytes_per_hour'] / 1e6:.1f} | {r['started_s']:.1f} | {r['false_deaths']} |"
        )
    return "\n".join(out)


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--victim", metavar="ADDRESS")
    parser.add_argument("--crowd", metavar="ADDRESS")
    parser.add_argument("--relay", metavar="ADDRESS")
    parser.add_argument("--news", default=NEWS_MODES[0])
    parser.add_argument("--host-beats", metavar="ADDRESS")
    parser.add_argument("--beats", default=BEATS_MODES[0])
    parser.add_argument("--count", type=int)
    parser.add_argument("--interval", type=float)
    parser.add_argument("--timeout", type=float)
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--members", type=int)
    parser.add_argument("--work")
    parser.add_argument("--out")
    a = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: where every thread is, to stderr
    if a.victim:
        _victim_main(a.victim)
        return
    if a.crowd:
        _crowd_main(a.crowd, a.count, a.interval, a.timeout, a.hold)
        return
    if a.relay:
        _relay_main(a.relay, a.timeout)
        return
    if a.host_beats:
        _host_beats_main(a.host_beats, a.interval, a.timeout)
        return
    driver = Driver(a.members, Path(a.work), a.news, beats=a.beats)
    try:
        result = driver.run()
    finally:
        driver.close(members=False)
    Path(a.out).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # thousands of member threads in store calls: no interpreter shutdown under them


if __name__ == "__main__":
    _main()
