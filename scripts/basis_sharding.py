"""MeCeFO's projection bases on FSDP shards: gathered per block, or computed per shard? (docs/parallel.md)

A replica of k ranks holds each FFN weight W (out x in) as k row blocks. Two ways to get the bases V (in x r)
of the efficient backward, measured here on k processes over gloo (one intra-op thread each):

- gathered (what unbroken does): all-gather W on every rank, then the randomized SVD of the whole W
  (``efficient.randomized_basis``). Every rank computes the same V as an unsharded replica would, so MeCeFO on
  shards is bitwise MeCeFO on whole replicas in exact mode.
- per shard: the randomized SVD of the local row block W_j, then an all-gather of the k bases V_j (k x in x r).
  A different approximation: each row block of the weight gradient would be projected on its own basis (the
  backward would need all k of them), and the result would depend on k.

    .venv/bin/python scripts/basis_sharding.py [--shape 11008x4096] [--ranks 2] [--rank 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from unbroken.ft.mecefo import DEFAULT_OVERSAMPLE, DEFAULT_POWER_ITERS, randomized_basis  # noqa: E402


def _rank(rank: int, world: int, port: int, shape: tuple[int, int], r: int, repeats: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    rows, cols = shape
    torch.manual_seed(0)
    full = torch.randn(rows, cols) / cols**0.5
    local = full.chunk(world)[rank].contiguous()
    times: dict[str, list[float]] = {"gather": [], "svd_full": [], "svd_shard": [], "gather_bases": []}
    for i in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        gathered = torch.empty(rows, cols)
        dist.all_gather_into_tensor(gathered, local)
        t1 = time.perf_counter()
        randomized_basis(gathered, r, DEFAULT_OVERSAMPLE, DEFAULT_POWER_ITERS, seed=i)
        t2 = time.perf_counter()
        dist.barrier()
        t3 = time.perf_counter()
        v = randomized_basis(local, r, DEFAULT_OVERSAMPLE, DEFAULT_POWER_ITERS, seed=i)
        t4 = time.perf_counter()
        assert v is not None
        bases = torch.empty(world * v.numel())
        dist.all_gather_into_tensor(bases, v.reshape(-1).contiguous())
        t5 = time.perf_counter()
        for key, value in (
            ("gather", t1 - t0),
            ("svd_full", t2 - t1),
            ("svd_shard", t4 - t3),
            ("gather_bases", t5 - t4),
        ):
            times[key].append(value)
    if rank == 0:
        out.update({k: statistics.median(v) for k, v in times.items()})
        out["gathered_bytes"] = full.numel() * 4 * (world - 1) // world
        out["bases_bytes"] = (world - 1) * cols * r * 4
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="11008x4096", help="OUTxIN of the FFN weight (LLaMA-7B's w1/w3)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rank", type=int, default=64, help="r of the projection")
    parser.add_argument("--repeats", type=int, default=5)
    a = parser.parse_args()
    shape = tuple(int(x) for x in a.shape.split("x"))
    with mp.Manager() as manager:
        out = manager.dict()
        port = 29000 + os.getpid() % 1000
        mp.spawn(_rank, args=(a.ranks, port, shape, a.rank, a.repeats, out), nprocs=a.ranks)
        r = dict(out)
    gathered = r["gather"] + r["svd_full"]
    per_shard = r["svd_shard"] + r["gather_bases"]
    print(f"W {a.shape} over {a.ranks} ranks, r = {a.rank}, median of {a.repeats} (seconds, rank 0):")
    print(f"  gathered : all-gather W {r['gather']:.3f} ({r['gathered_bytes'] / 2**20:.0f} MiB in) + SVD of W "
          f"{r['svd_full']:.3f} = {gathered:.3f}")  # fmt: skip
    print(f"  per shard: SVD of the block {r['svd_shard']:.3f} + all-gather of bases {r['gather_bases']:.3f} "
          f"({r['bases_bytes'] / 2**20:.1f} MiB in) = {per_shard:.3f}")  # fmt: skip
    print(f"  per shard / gathered: {per_shard / gathered:.2f}")


if __name__ == "__main__":
    main()
