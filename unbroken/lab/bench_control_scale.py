"""``unbroken bench control-scale``: the real coordinator and gateway against hundreds of members (issue 33).

The coordinator is a child process started as the launcher starts one (``spawn_coordinator``: its gateway in
front of its store, the job's token). Every member is a ``control.client.CoordinatorClient``, the code path of a
worker for everything the coordinator sees: admission with the token, a heartbeat every interval, the epoch
watch on the workers' doorbell, the metrics records (the leader's step record every ``STEP_S``, with every
member's speed and quota, as ``ft.commit`` writes it). There is no model, no data and no collective. N - V
members are objects of one driver process (threads); the V victims are processes of one member each, so that a
death is a real ``kill -9`` and a hang a real ``SIGSTOP``. The driver is itself a child process (``drive``), so
its thousands of threads and sockets end with it.

Measured at each N:

- **death**: a victim killed, its death reported as an agent reports a process exit (``report_death``) at
  ``t``; -> the epoch without it published (the time in its record), -> each
  driver member's watcher has read it (its ``on_epoch``): p50 and p99 over members and deaths, and the last;
- **silence**: a victim stopped (``SIGSTOP``) with nobody reporting: -> the epoch without it (the heartbeat
  timeout, then the coordinator's check);
- **joins**: ``JOINS`` new members started at once: how many epochs took them in, seconds from their start to
  the epoch holding the last of them (its record's time), and each one's wait from its admission to the first
  epoch holding it (the coordinator's own records); the admissions spread over as long as the driver's threads
  take to open their connections;
- the coordinator's CPU (cores: its user + system time over the wall time, from /proc) and RSS, at rest and
  over the churn (the deaths and the joins);
- metrics.jsonl's growth per hour at rest.

One machine, one clock: the driver's members and the coordinator compare ``time.time()``. The driver's members
share one process and one tunnel loop, where real workers each have their own: the "every member has read it"
figures include that shared client side, so they overstate what a real member waits.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import faulthandler
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from unbroken.control import keys
from unbroken.control.client import CoordinatorClient
from unbroken.control.coordinator import spawn_coordinator
from unbroken.control.gateway import TOKEN_ENV, new_token
from unbroken.control.store import bind_listen_socket, connect_store, read_json, report_death
from unbroken.core.config import dump_config, load_config, preset_path
from unbroken.core.records import METRICS_FILE, RecordKind, make, read_records

DEFAULT_MEMBERS = (64, 256, 512, 1024)
VICTIMS = 4  # V: V - 1 deaths, then one silence
JOINS = 64
REST_S = 10.0  # the window of the at-rest figures
STEP_S = 1.0  # the leader's step records at rest: one a second
SETTLE_S = 1.0  # between two faults
CONNECTORS = 16  # members started at a time
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


class Driver:
    """One coordinator and ``members`` members; the figures of one N (``run``)."""

    def __init__(self, members: int, work: Path, joins: int = JOINS, rest_s: float = REST_S) -> None:
        if members < VICTIMS + 2:
            raise ValueError(f"--members {members}: each count must be at least {VICTIMS + 2}")
        self.n, self.work, self.joins, self.rest_s = members, work, joins, rest_s
        self.token = new_token()
        self.cfg = load_config(str(preset_path("tiny")), ["--comm.join_timeout_s=600"])
        self.run_dir = work / "run"
        self.run_dir.mkdir(parents=True)
        dump_config(self.cfg, self.run_dir)
        self.clients: list[CoordinatorClient] = []
        self.seen: dict[int, list[float]] = {}  # epoch -> when each driver member read it
        self.victims: dict[int, subprocess.Popen[bytes]] = {}  # worker id -> its process
        self.processes: list[subprocess.Popen[bytes]] = []  # every child started: ``close`` ends them

    def _on_epoch(self, epoch: int, _members: tuple[int, ...]) -> None:
        self.seen.setdefault(epoch, []).append(time.time())  # list.append is atomic: no lock on the watchers

    def _member(self) -> CoordinatorClient:
        comm = self.cfg.comm
        client = CoordinatorClient(
            self.address, None, comm.heartbeat_interval_s, comm.heartbeat_timeout_s, token=self.token
        )
        client.on_epoch = self._on_epoch
        return client

    def _start_victims(self) -> None:
        """``VICTIMS`` processes of one member each, started together; each prints its id once admitted."""
        cmd = [sys.executable, "-m", "unbroken.lab.bench_control_scale", "--victim", self.address]
        env = {**os.environ, TOKEN_ENV: self.token, "TORCH_CPP_LOG_LEVEL": "ERROR"}
        started = [subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env) for _ in range(VICTIMS)]
        self.processes += started
        for proc in started:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.strip():
                raise RuntimeError("bench control-scale: a victim process did not join")
            self.victims[int(line)] = proc

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
        _wait(lambda: len(self.seen.get(epoch, [])) >= len(self.clients), f"every member reading epoch {epoch}")
        return self.seen[epoch]

    def run(self) -> dict[str, Any]:
        """Start the coordinator and the members, then measure; ``close`` ends them (call it whatever happens)."""
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the coordinator inherits it
        sock = bind_listen_socket("127.0.0.1", 0)
        env = {**os.environ, TOKEN_ENV: self.token, "TORCH_CPP_LOG_LEVEL": "ERROR"}
        self.coordinator, self.address = spawn_coordinator(sock, self.run_dir, self.n, False, env)
        self.processes.append(self.coordinator)
        sock.close()
        return self._measure()

    def close(self, members: bool) -> None:
        """End the victims and the coordinator; with ``members``, first close the driver's members (each close
        rings every member's doorbell: for a few only; a driver process of hundreds exits instead)."""
        if members:
            for client in self.clients:
                client.close()
        for proc in self.processes:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def _measure(self) -> dict[str, Any]:
        self.store = connect_store(self.address, token=self.token)
        t_start = time.monotonic()
        self._start_victims()
        with concurrent.futures.ThreadPoolExecutor(CONNECTORS) as pool:
            self.clients = list(pool.map(lambda _: self._member(), range(self.n - VICTIMS)))
        _wait(lambda: all(c.latest_epoch >= 1 for c in self.clients), "the first epoch")
        started_s = time.monotonic() - t_start
        self.last_epoch = int(self.store.get(keys.EPOCH))

        # At rest: heartbeats, the epoch watch, and the leader's step record every STEP_S.
        metrics = self.run_dir / METRICS_FILE
        size0, t0, usage = metrics.stat().st_size, time.monotonic(), _Usage(self.coordinator.pid)
        leader, everyone = self.clients[0], [*(c.worker_id for c in self.clients), *self.victims]
        step = 0
        while time.monotonic() - t0 < self.rest_s:
            leader.publish_metrics(_step_record(step, everyone))
            step += 1
            time.sleep(STEP_S)
        leader.flush_metrics()
        time.sleep(0.5)  # the coordinator's next drain
        rest_cores, rest_rss = usage.cores(), _rss_mib(self.coordinator.pid)
        growth = (metrics.stat().st_size - size0) / (time.monotonic() - t0) * 3600

        # Churn: deaths reported as an agent reports them, a silent hang, joins.
        churn = _Usage(self.coordinator.pid)
        deaths: list[dict[str, float]] = []
        read_after: list[float] = []
        victims = list(self.victims)
        for wid in victims[:-1]:
            time.sleep(SETTLE_S)
            proc = self.victims[wid]
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            t_report = time.time()
            report_death(self.store, wid, "killed by SIGKILL")
            record = self._epoch_without(wid)
            reads = self._read_by_all(record["epoch"])
            read_after += [t - t_report for t in reads]
            deaths.append({"published": record["time"] - t_report, "last_read": max(reads) - t_report})
        time.sleep(SETTLE_S)
        hung = victims[-1]
        self.victims[hung].send_signal(signal.SIGSTOP)
        t_stop = time.time()
        silence_s = self._epoch_without(hung)["time"] - t_stop
        self.victims[hung].kill()
        time.sleep(SETTLE_S)

        first_new_epoch = int(self.store.get(keys.EPOCH)) + 1
        t_joins = time.time()
        with concurrent.futures.ThreadPoolExecutor(self.joins) as pool:
            joiners = list(pool.map(lambda _: self._member(), range(self.joins)))
        self.clients += joiners
        ids = {c.worker_id for c in joiners}
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
        join_s = max(taken_in.values()) - t_joins
        time.sleep(1.0)  # the coordinator's next drains: its admitted and failure records in metrics.jsonl
        admitted = {r["worker"]: r["time"] for r in read_records(self.run_dir, "admitted") if r["worker"] in ids}
        waits = [taken_in[w] - admitted[w] for w in ids]
        # Members declared dead that nobody killed or stopped: heartbeats the driver could not send in time.
        false_deaths = [f for f in read_records(self.run_dir, "failure") if f["worker"] not in self.victims]
        churn_cores, churn_rss = churn.cores(), _rss_mib(self.coordinator.pid)
        return {
            "members": self.n,
            "started_s": started_s,
            "death_published_s": [d["published"] for d in deaths],
            "death_last_read_s": [d["last_read"] for d in deaths],
            "read_p50_s": statistics.median(read_after),
            "read_p99_s": _percentile(read_after, 0.99),
            "silence_s": silence_s,
            "heartbeat_timeout_s": self.cfg.comm.heartbeat_timeout_s,
            "joins": self.joins,
            "join_epochs": len(joined_epochs),
            "false_deaths": len(false_deaths),
            "join_s": join_s,
            "join_admitted_spread_s": max(admitted.values()) - min(admitted.values()),
            "join_wait_median_s": statistics.median(waits),
            "join_wait_max_s": max(waits),
            "rest_cores": rest_cores,
            "rest_rss_mib": rest_rss,
            "churn_cores": churn_cores,
            "churn_rss_mib": churn_rss,
            "metrics_bytes_per_hour": growth,
        }


def _step_record(step: int, members: list[int]) -> dict[str, Any]:
    """A step record as the leader publishes one (``ft.commit``), every member's quota and speed in it."""
    quotas = {str(w): 1 for w in members}
    speeds = {str(w): 0.1 for w in members}
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


def bench_control_scale(member_counts: list[int]) -> list[dict[str, Any]]:
    """The driver once per N, each in a fresh process; their figures in order (a failed N: ``failed``)."""
    results = []
    for n in member_counts:
        with tempfile.TemporaryDirectory(prefix="control-scale-") as tmp:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, "-m", "unbroken.lab.bench_control_scale", "--members", str(n), "--work", tmp]
            env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
            done = subprocess.run([*cmd, "--out", str(out)], env=env, timeout=20 * 60, check=False)
            if done.returncode != 0 or not out.exists():  # a row that says so; the other counts still run
                results.append({"members": n, "failed": f"the driver exited {done.returncode} (its stderr above)"})
                continue
            results.append(json.loads(out.read_text()))
    return results


def format_control_scale(results: list[dict[str, Any]]) -> str:
    def s(x: float) -> str:
        return f"{x:.3f}"

    out = [
        f"the real coordinator (a child process) and N members: N - {VICTIMS} in one driver process, {VICTIMS} "
        f"processes of one member each; {VICTIMS - 1} deaths reported (kill -9), 1 hang (SIGSTOP), {JOINS} joins",
        "",
        "| members | death -> epoch published (s) | death -> every member read it: p50 / p99 / last (s) "
        "| hang -> epoch (s) | joins: how many, in how many epoch changes, over the admissions' spread; "
        "admission -> epoch, median / max (s) | coordinator at rest: cores, RSS MiB | churn: cores, RSS MiB "
        "| metrics MB/h | start (s) | false deaths |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "failed" in r:
            out.append(f"| {r['members']} | did not finish: {r['failed']} |" + " |" * 8)
            continue
        published = statistics.median(r["death_published_s"])
        last = max(r["death_last_read_s"])
        out.append(
            f"| {r['members']} | {s(published)} (max {s(max(r['death_published_s']))}) "
            f"| {s(r['read_p50_s'])} / {s(r['read_p99_s'])} / {s(last)} "
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
    parser.add_argument("--members", type=int)
    parser.add_argument("--work")
    parser.add_argument("--out")
    a = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: where every thread is, to stderr
    if a.victim:
        _victim_main(a.victim)
        return
    driver = Driver(a.members, Path(a.work))
    try:
        result = driver.run()
    finally:
        driver.close(members=False)
    Path(a.out).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # thousands of member threads in store calls: no interpreter shutdown under them


if __name__ == "__main__":
    _main()
