"""Q6: failure-free step time and memory, 2 replicas x 2 shards (4 processes, 1 thread each, on a 2-core host).

  hsdp      FSDP2's own HSDP: one world group of 4, a 2-D "cpu" mesh (replicate=2, shard=2), ``fully_shard`` on it.
            Reduce-scatter per backward inside the replica; the replicate all-reduce only on the last backward
            (``set_requires_all_reduce``), SUM semantics (``set_force_sum_reduction_for_comms``, factor 1).
  ft        FSDP2 shard-only (a 1-D mesh per replica) + the prototype's FT layer (common.ReplicaRank, fp32 mode):
            reduce-scatter per backward, then the local gradient shard all-reduced across replicas on the shard's
            FT group (unbroken.ft.comm, polled), plus the side vector, the intra-replica agreement, the
            membership watcher thread.
  ft-exact  the same in exact mode: int64 quantise + int64 reduce-scatter per backward, int64 all-reduce, exact
            norm.

Model: the Transformer at dim 256, 4 layers, vocab 4096, ffn 768 (5.3 M parameters), microbatches of 4 x 128
tokens, M = 8 (2 per rank), AdamW. Step time = median over steps 1..N-1 of the slowest rank; memory = each
rank's peak RSS (VmHWM) and its growth over the RSS after set-up (model built and sharded). Because the host is
shared, the CPU seconds each rank uses per step (all its threads, getrusage) are reported too: they do not
count time spent waiting for the CPU.

    .venv/bin/python scripts/proto_hsdp/p6_bench.py [--steps 6] [--modes hsdp,ft,ft-exact] [--repeat 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import (  # noqa: E402
    Config,
    Launcher,
    ReplicaRank,
    Role,
    build_model,
    cpu_seconds,
    full_checksum,
    loss_of,
    microbatch,
    shard_model,
)
from torch.distributed import PrefixStore  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from unbroken.core.flavours import ModelArgs  # noqa: E402

BENCH = ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=4096, ffn_hidden=768, max_seq_len=128)
M = 8


def _bench_setup() -> None:
    common.ARGS = BENCH
    common.MB_BATCH, common.MB_SEQ = 4, 127


def _mem() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS", "VmHWM")):
            key, val = line.split(":")
            out[key] = int(val.split()[0]) / 1024.0
    return out


def hsdp_worker(role: Role, store, port: int, steps: int) -> dict:  # noqa: ANN001
    _bench_setup()
    rank = role.replica * role.k + role.shard
    dist.init_process_group(
        "gloo", store=PrefixStore("world", store), rank=rank, world_size=4, timeout=datetime.timedelta(seconds=120)
    )
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = build_model()
    for u in shard_model(model, mesh):
        u.set_force_sum_reduction_for_comms(True)
        u.set_gradient_divide_factor(1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    setup = _mem()
    times, cpus = [], []
    # the plan of the FT runs: replica a gets ids 4a..4a+3, in rounds of 2: rank j computes 4a+j and 4a+2+j
    ids = [4 * role.replica + role.shard, 4 * role.replica + 2 + role.shard]
    for step in range(steps):
        t0, c0 = time.perf_counter(), cpu_seconds()
        for p in model.parameters():
            p.grad = None
        for i, mb in enumerate(ids):
            model.set_requires_all_reduce(i == len(ids) - 1)
            (loss_of(model, microbatch(step, mb)) / M).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        times.append(time.perf_counter() - t0)
        cpus.append(cpu_seconds() - c0)
    return {
        "role": str(role),
        "replica": role.replica,
        "shard": role.shard,
        "times": times,
        "cpus": cpus,
        "setup": setup,
        "mem": _mem(),
        "checksum": full_checksum(model) if role.replica == 0 else None,
    }


def ft_worker(role: Role, store, port: int, steps: int, exact: bool) -> dict:  # noqa: ANN001
    _bench_setup()
    rank = ReplicaRank(role, store, port, Config(M=M, steps=steps, exact=exact, op_timeout_s=120, pg_timeout_s=120))
    setup = _mem()
    t0, c0 = time.time(), cpu_seconds()
    res = rank.run()
    stamps = [t0] + [h["time"] for h in res["history"]]
    times = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    cstamps = [c0] + [h["cpu"] for h in res["history"]]
    cpus = [b - a for a, b in zip(cstamps, cstamps[1:], strict=False)]
    return {
        "role": str(role),
        "replica": role.replica,
        "shard": role.shard,
        "times": times,
        "cpus": cpus,
        "setup": setup,
        "mem": _mem(),
        "checksum": res["checksum"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--modes", default="hsdp,ft,ft-exact")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    n_params = sum(p.numel() for p in build_model(args=BENCH).parameters())
    print(
        f"model {n_params / 1e6:.2f} M parameters ({n_params * 4 / 2**20:.1f} MiB fp32), M = {M}, 2 x 2 ranks, "
        f"{a.steps} steps (first excluded)",
        flush=True,
    )
    out = Path(tempfile.mkdtemp(prefix="proto_p6_"))
    rows: dict[str, list] = {}
    for rep in range(a.repeat):
        for mode in a.modes.split(","):
            L = Launcher(out / f"{mode}_{rep}")
            if mode == "hsdp":
                res = L.run(hsdp_worker, 2, 2, timeout_s=900, steps=a.steps)
            else:
                res = L.run(ft_worker, 2, 2, timeout_s=900, steps=a.steps, exact=mode == "ft-exact")
            per_step = [max(r["times"][s] for r in res) for s in range(1, a.steps)]
            med = statistics.median(per_step)
            cpu = statistics.median(r["cpus"][s] for r in res for s in range(1, a.steps))
            hwm = max(r["mem"]["VmHWM"] for r in res)
            growth = max(r["mem"]["VmHWM"] - r["setup"]["VmRSS"] for r in res)
            cks = {r["checksum"] for r in res if r["checksum"]}
            rows.setdefault(mode, []).append((med, hwm, growth, cks, cpu))
            print(
                f"  run {rep} {mode:8s}: step {med:.3f} s (steps {[round(x, 3) for x in per_step]}), CPU {cpu:.3f} s "
                f"per rank-step, peak RSS/rank {hwm:.0f} MiB, growth after set-up {growth:.0f} MiB, "
                f"params {sorted(c[:12] for c in cks)}; load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    print("\nmode      median wall step (s)   median CPU s/rank-step   peak RSS/rank (MiB)   growth after set-up (MiB)")
    for mode, rs in rows.items():
        print(
            f"{mode:9s} {str([round(r[0], 3) for r in rs]):22s} {str([round(r[4], 3) for r in rs]):24s} "
            f"{str([round(r[1]) for r in rs]):21s} {str([round(r[2]) for r in rs])}"
        )
    fp32 = {c for m in ("hsdp", "ft") for r in rows.get(m, []) for c in r[3]}
    if "hsdp" in rows and "ft" in rows:
        print(
            f"\nfp32 final params, native HSDP vs shard-only + FT all-reduce: "
            f"{'bitwise equal' if len(fp32) == 1 else 'different: ' + str(sorted(c[:12] for c in fp32))}"
        )


if __name__ == "__main__":
    main()
