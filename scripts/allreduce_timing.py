"""gloo's collectives on the `small` model's gradient size (7.4 M values), float32 against int64, behind
docs/benchmarks.md's discussion of what exact mode's reduction costs: median ms of 7, processes on this
machine, one thread each.

    python scripts/allreduce_timing.py 2
    python scripts/allreduce_timing.py 4
"""

import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from unbroken.lab.harness import free_port

VALUES = 7_400_000


def rank_main(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    n = VALUES // world * world
    times = {}

    def median_ms(name: str, fn: Callable[[], object]) -> None:
        for _ in range(2):
            fn()
        samples = []
        for _ in range(7):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        times[name] = round(1e3 * statistics.median(samples), 1)

    f32, i64 = torch.ones(n), torch.ones(n, dtype=torch.int64)
    shard64, shard32, gathered = torch.empty(n // world, dtype=torch.int64), torch.empty(n // world), torch.empty(n)
    median_ms("all-reduce float32", lambda: dist.all_reduce(f32))
    median_ms("all-reduce int64", lambda: dist.all_reduce(i64))
    median_ms("reduce-scatter int64", lambda: dist.reduce_scatter_tensor(shard64, i64))
    median_ms("all-gather float32", lambda: dist.all_gather_into_tensor(gathered, shard32))
    if rank == 0:
        print(f"{world} ranks, {n / 1e6:.1f} M values; median ms of 7")
        for name, ms in times.items():
            print(f"| {name} | {ms} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    mp.spawn(rank_main, args=(world, free_port()), nprocs=world)
