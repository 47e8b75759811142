"""Q3: a rank of a replica dies (SIGKILL). What happens to FSDP2's collectives, and the FT recovery around it.

``fsdp-kill``: one replica of k ranks (no FT layer), plain FSDP2. The last rank SIGKILLs itself inside FSDP's
    backward just before a reduce-scatter (``--where rs``) or inside the forward just before an all-gather
    (``--where ag``); the others report how long their FSDP call stayed blocked and how it ended, with the
    process group timeout ``--timeout`` (set at ``init_process_group``; the device mesh uses that group).

        .venv/bin/python scripts/proto_hsdp/p3_failure.py fsdp-kill --k 2 --where rs --timeout 5
        .venv/bin/python scripts/proto_hsdp/p3_failure.py fsdp-kill --k 3 --where rs --timeout 5
        .venv/bin/python scripts/proto_hsdp/p3_failure.py fsdp-kill --k 2 --where rs --timeout 5 --signal stop
        .venv/bin/python scripts/proto_hsdp/p3_failure.py fsdp-kill --k 2 --timeout 15 --signal stop --abort abort

``mesh-timeout``: 4 ranks, ``init_process_group(timeout=5 s)``: the timeouts of a 1-D mesh's group, of a 2-D mesh's
    dimension groups (they do *not* inherit it: 30 min, the default), and of a 2-D mesh built with
    ``backend_override`` options carrying a timeout.

        .venv/bin/python scripts/proto_hsdp/p3_failure.py mesh-timeout

``recover``: 2 replicas x 2 shards in exact mode through the prototype's FT layer (common.ReplicaRank), M = 8,
    16 steps padded to >= 1 s each. Rank r1/s1 is SIGKILLed inside FSDP's reduce-scatter of step 1, round 1 (its
    replica-mate is then
    blocked in that collective). The parent plays the coordinator: it sees the death, publishes an epoch
    without replica 1; r1/s0 leaves (exit 3) on seeing it; replica 0 recomputes replica 1's 4 microbatch ids
    and commits step 1 alone. The parent (the agent) starts a replacement replica 1 at once (two fresh processes,
    incarnation 2) and, once both are up, publishes an epoch with it: at the next step boundary
    every shard group is re-formed and the replacement's rank j receives shard j of the state (parameters,
    AdamW moments, fixed-point bounds, step) from replica 0's rank j. The final parameters must be bitwise
    equal to the failure-free run (the unsharded reference of p2).

        .venv/bin/python scripts/proto_hsdp/p3_failure.py recover
        .venv/bin/python scripts/proto_hsdp/p3_failure.py recover --victim 0,0,2,0   # the leader replica's rank 0
        .venv/bin/python scripts/proto_hsdp/p3_failure.py recover --hang             # SIGSTOP: no reset, no exit

    With ``--hang`` the victim is frozen instead (a hung host: its sockets stay open, so nothing fails in gloo);
    the parent declares its replica dead ``--detect-s`` after the hang (standing for the heartbeat timeout), and
    the replica-mate, blocked inside FSDP's reduce-scatter (process group timeout 20 s), must leave on the
    epoch alone. ``ProcessGroup.abort()`` / ``shutdown()`` do not unblock a gloo collective (they return at once
    and the call still waits for the timeout: see docs/parallel.md), so the rank ends itself (``os._exit``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import Launcher, Role, build_model, loss_of, microbatch, reference_worker, replica_worker, shard_model  # noqa: E402
from torch.distributed import PrefixStore  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402


# -- fsdp-kill ---------------------------------------------------------------------------------------------
def fsdp_kill_worker(role: Role, store, port: int, timeout_s: float, where: str, sig: str, abort: str) -> dict:  # noqa: ANN001
    dist.init_process_group(
        "gloo",
        store=PrefixStore("kill", store),
        rank=role.shard,
        world_size=role.k,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    mesh = init_device_mesh("cpu", (role.k,))
    model = build_model()
    shard_model(model, mesh)
    victim = role.shard == role.k - 1
    state = {"step": 0}
    name = "reduce_scatter_single" if where == "rs" else "all_gather_single"
    original = getattr(dist, name)

    def patched(*a, **kw):  # noqa: ANN002, ANN003
        if victim and state["step"] == 1:
            store.set("killed_at", repr(time.time()))
            # SIGKILL: the kernel closes the sockets (peers see a reset). SIGSTOP: a hung host or a partition,
            # the connections stay open and nothing is ever sent (the parent SIGKILLs it at the end).
            os.kill(os.getpid(), signal.SIGKILL if sig == "kill" else signal.SIGSTOP)
        return original(*a, **kw)

    setattr(dist, name, patched)
    aborted: dict[str, float] = {}
    if abort and not victim:  # try to unblock the collective in-process: ProcessGroup.abort() / shutdown()

        def aborter() -> None:
            store.wait(["killed_at"], datetime.timedelta(seconds=120))
            time.sleep(1.0)
            t = time.time()
            getattr(dist.distributed_c10d._get_default_group(), abort)()
            aborted["after_s"] = round(t - float(store.get("killed_at").decode()), 3)
            aborted["call_s"] = round(time.time() - t, 3)

        threading.Thread(target=aborter, daemon=True).start()
    for step in range(3):
        state["step"] = step
        t0 = time.time()
        try:
            loss_of(model, microbatch(step, role.shard)).backward()
        except Exception as e:  # noqa: BLE001
            killed_at = float(store.get("killed_at").decode())
            return {
                "role": str(role),
                "replica": 0,
                "shard": role.shard,
                "blocked_s": round(time.time() - killed_at, 3),
                "call_s": round(time.time() - t0, 3),
                "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}",
                "abort": aborted,
            }
    return {"role": str(role), "replica": 0, "shard": role.shard, "error": None}


def fsdp_kill(k: int, where: str, timeout_s: float, sig: str, abort: str) -> None:
    launcher = Launcher(tempfile.mkdtemp(prefix="proto_p3a_"))
    launcher.publish(["0:1"])
    for j in range(k):
        launcher.spawn(fsdp_kill_worker, Role(0, j, k), timeout_s=timeout_s, where=where, sig=sig, abort=abort)
    deadline = time.monotonic() + timeout_s + 60
    for role, p in launcher.procs.items():
        if role.shard == k - 1 and sig == "stop":
            continue
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            print(f"{role}: still blocked {timeout_s + 60:.0f} s after the kill (killed by the parent)")
    for p in launcher.procs.values():
        if p.is_alive():
            p.kill()
            p.join()
    print(
        f"k={k}, rank {k - 1} {'SIGKILLed' if sig == 'kill' else 'SIGSTOPped (hung: no connection reset)'} "
        f"before FSDP's {'reduce-scatter (backward)' if where == 'rs' else 'all-gather (forward)'}, "
        f"process group timeout {timeout_s} s"
    )
    for r in launcher.results():
        print(f"  {r['role']}: blocked {r['blocked_s']} s after the kill, then {r['error']}")
        if r.get("abort"):
            print(
                f"    ({abort}() was called {r['abort']['after_s']} s after the kill and returned in "
                f"{r['abort']['call_s']} s; the collective stayed blocked until the above)"
            )
    codes = {str(r): p.exitcode for r, p in launcher.procs.items()}
    print(f"  exit codes: {codes}")


# -- mesh-timeout ----------------------------------------------------------------------------------------
def _timeout_of(pg) -> str:  # noqa: ANN001
    backend = pg._get_backend(torch.device("cpu"))
    return str(getattr(getattr(backend, "options", None), "_timeout", None))


def mesh_timeout_worker(role: Role, store, port: int) -> dict:  # noqa: ANN001
    """Which timeout do the groups of a device mesh get? (init_process_group's: 5 s)"""
    dist.init_process_group(
        "gloo", store=PrefixStore("mt", store), rank=role.shard, world_size=4, timeout=datetime.timedelta(seconds=5)
    )
    m1 = init_device_mesh("cpu", (4,))
    m2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "shard"))
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=7)
    m3 = init_device_mesh(
        "cpu", (2, 2), mesh_dim_names=("pp", "shard"), backend_override={"pp": ("gloo", opts), "shard": ("gloo", opts)}
    )
    return {
        "role": str(role),
        "replica": 0,
        "shard": role.shard,
        "default group (init_process_group timeout=5 s)": _timeout_of(dist.distributed_c10d._get_default_group()),
        "1-D mesh over the world": _timeout_of(m1.get_group()),
        "2-D mesh dims pp, shard": f"{_timeout_of(m2.get_group('pp'))}, {_timeout_of(m2.get_group('shard'))}",
        "2-D mesh with backend_override (7 s)": (
            f"{_timeout_of(m3.get_group('pp'))}, {_timeout_of(m3.get_group('shard'))}"
        ),
    }


def mesh_timeout() -> None:
    launcher = Launcher(tempfile.mkdtemp(prefix="proto_p3m_"))
    res = launcher.run(mesh_timeout_worker, 1, 4)[0]
    for key, val in res.items():
        if key not in ("role", "replica", "shard"):
            print(f"  {key}: {val}")


# -- recover -----------------------------------------------------------------------------------------------
def recover(
    steps: int, min_step_s: float, victim: tuple[int, int, int, int], hang: bool, detect_s: float, out: Path
) -> None:
    vr, vs, vstep, vround = victim
    kill = {"replica": vr, "shard": vs, "step": vstep, "round": vround, "hang": int(hang)}
    cfg = {
        "steps": steps,
        "M": 8,
        "exact": True,
        "kill": kill,
        "op_timeout_s": 20.0,
        "pg_timeout_s": 20.0,
        "min_step_s": min_step_s,
    }
    ref_l = Launcher(out / "ref")
    ref_l.publish(["0:1"])
    ref_l.spawn(reference_worker, Role(0, 0, 1), cfg={k: v for k, v in cfg.items() if k not in ("kill", "min_step_s")})
    ref_l.wait_all(300)
    reference = ref_l.results()[0]["checksum"]
    print(f"failure-free reference (unsharded, GradientReducer exact): {reference[:16]}", flush=True)

    L = Launcher(out / "run")
    members = ["0:1", "1:1"]
    mate = f"r{vr}.1/s{1 - vs}"
    L.publish(members)
    t_start = time.time()
    for r in range(2):
        for j in range(2):
            L.spawn(replica_worker, Role(r, j, 2), cfg=cfg)
    replaced = published_join = False
    t_dead = None
    timeline: list[str] = []
    deadline = time.monotonic() + 300
    victim_role = Role(vr, vs, 2)
    victim_killed = False
    while time.monotonic() < deadline:
        if hang and f"{vr}:1" in members and L.store.check(["killed_at"]):
            # a hung rank sends no more heartbeats: the coordinator declares its replica dead after detect_s
            hung_at = float(L.store.get("killed_at").decode())
            if time.time() - hung_at >= detect_s:
                t_dead = time.time()
                members = [m for m in members if m != f"{vr}:1"]
                e = L.publish(members)
                timeline.append(
                    f"{t_dead - t_start:7.3f} s  no heartbeat from {victim_role} for {detect_s} s: "
                    f"coordinator publishes epoch {e} {members}"
                )
        if (
            hang
            and t_dead is not None
            and not victim_killed
            and (L.store.check([f"exit/{mate}"]) or time.time() - t_dead > 30)
        ):
            L.procs[victim_role].kill()  # the agent ends the declared-dead process (after its mate left)
            victim_killed = True
            timeline.append(f"{time.time() - t_start:7.3f} s  the hung {victim_role} is SIGKILLed by its agent")
        for role, p in list(L.procs.items()):
            if p.exitcode not in (None, 0) and role.key in members:
                t_dead = time.time()
                members = [m for m in members if m != role.key]
                e = L.publish(members)
                timeline.append(
                    f"{t_dead - t_start:7.3f} s  {role} exited with {p.exitcode}: "
                    f"coordinator publishes epoch {e} {members}"
                )
        if t_dead is not None and not replaced:  # the agent restarts the dead replica's ranks at once
            for j in range(2):
                L.spawn(replica_worker, Role(vr, j, 2, incarnation=2), cfg=cfg)
            replaced = True
            timeline.append(f"{time.time() - t_start:7.3f} s  replacement replica {vr} (incarnation 2) started")
        if replaced and not published_join and L.store.check([f"ready/{vr}:2/0", f"ready/{vr}:2/1"]):
            members = members + [f"{vr}:2"]
            e = L.publish(members)
            published_join = True
            timeline.append(
                f"{time.time() - t_start:7.3f} s  both replacement ranks up: coordinator publishes epoch {e} {members}"
            )
        if all(p.exitcode is not None for p in L.procs.values()):
            break
        time.sleep(0.005)
    codes = {str(r): p.exitcode for r, p in L.procs.items()}
    killed_at = float(L.store.get("killed_at").decode())
    for key in (f"exit/{mate}",):
        if L.store.check([key]):
            timeline.append(
                f"{float(L.store.get(key).decode()) - t_start:7.3f} s  {key.split('/', 1)[1]} left "
                f"({float(L.store.get(key).decode()) - killed_at:.3f} s after the kill)"
            )
    timeline.append(
        f"{killed_at - t_start:7.3f} s  r{vr}.1/s{vs} {'hangs (SIGSTOP)' if hang else 'SIGKILLed itself'} "
        "inside FSDP's reduce-scatter"
    )
    print("\ntimeline (seconds since start):")
    for line in sorted(timeline):
        print("  " + line)
    print(f"exit codes: {codes}")
    results = L.results()
    for r in results:
        print(
            f"\n{r['role']}: final params {r['checksum'][:16]} "
            f"{'== reference' if r['checksum'] == reference else '!= REFERENCE'}"
        )
        for e in r["events"]:
            print(f"    {e}")
        for h in r["history"]:
            print(
                f"    {h['time'] - t_start:7.3f} s  step {h['step']} committed: loss {h['loss']:.6f} "
                f"epoch {h['epoch']} "
                f"replicas {h['replicas']}"
            )
    ok = all(r["checksum"] == reference for r in results) and len(results) == 4
    print(f"\nall {len(results)} surviving/replacement ranks bitwise equal to the failure-free reference: {ok}")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    a1 = sub.add_parser("fsdp-kill")
    a1.add_argument("--k", type=int, default=2)
    a1.add_argument("--where", choices=["rs", "ag"], default="rs")
    a1.add_argument("--timeout", type=float, default=5.0)
    a1.add_argument("--signal", choices=["kill", "stop"], default="kill")
    a1.add_argument("--abort", choices=["", "abort", "shutdown"], default="", help="call it 1 s after the kill")
    sub.add_parser("mesh-timeout")
    a2 = sub.add_parser("recover")
    a2.add_argument("--steps", type=int, default=16)
    a2.add_argument("--min-step-s", type=float, default=1.0, help="pad steps (a replacement needs ~5 s to start here)")
    a2.add_argument("--victim", default="1,1,1,1", help="replica,shard,step,round of the rank to SIGKILL")
    a2.add_argument("--hang", action="store_true", help="SIGSTOP instead: no connection reset, no exit")
    a2.add_argument("--detect-s", type=float, default=1.0, help="--hang: the coordinator's heartbeat timeout")
    a = ap.parse_args()
    if a.cmd == "fsdp-kill":
        fsdp_kill(a.k, a.where, a.timeout, a.signal, a.abort)
    elif a.cmd == "mesh-timeout":
        mesh_timeout()
    else:
        victim = tuple(int(x) for x in a.victim.split(","))
        recover(a.steps, a.min_step_s, victim, a.hang, a.detect_s, Path(tempfile.mkdtemp(prefix="proto_p3_")))


if __name__ == "__main__":
    main()
