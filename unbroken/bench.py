"""Benchmarks behind ``unbroken bench``; their figures are recorded in docs/benchmarks.md.

``bench ddp``: the step time of an ``unbroken`` run against the same model, data, M and optimizer trained
with ``torch.nn.parallel.DistributedDataParallel`` (gradient accumulation under ``no_sync``), for each
worker count. The two systems alternate round by round on the same machine so drift in the machine's
load hits both; the figure is the ratio of median step times (unbroken / DDP), measured after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from unbroken.config import RunConfig, load_config, to_toml

WARMUP_STEPS = 2
MEASURED_STEPS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bench_config(config: str | None, overrides: list[str]) -> RunConfig:
    base = [
        f"--train.steps={WARMUP_STEPS + MEASURED_STEPS}",
        "--train.eval_every=0",
        "--checkpoint.every=0",
        "--train.eval_microbatches=1",
    ]
    return load_config(config or _default_config(), base + overrides)


def _default_config() -> str:
    return str(Path(__file__).resolve().parent.parent / "configs" / "default.toml")


def run_unbroken(cfg: RunConfig, workers: int) -> list[float]:
    """Step times (s) of an unbroken run after warm-up."""
    from unbroken.launcher import Launcher, plan_launch
    from unbroken.metrics import read_metrics

    with tempfile.TemporaryDirectory(prefix="unbroken-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        plan = plan_launch(cfg, run_dir, workers, False, "127.0.0.1", 0)
        code = Launcher(plan, show_progress=False, show_summary=False).run()
        if code != 0:
            raise RuntimeError(f"unbroken run failed (exit {code}); logs in {run_dir}/logs")
        steps = sorted(read_metrics(run_dir, "step"), key=lambda r: r["step"])
        return [r["step_time_s"] for r in steps[WARMUP_STEPS:]]


def run_ddp(cfg: RunConfig, workers: int) -> list[float]:
    """Step times (s) of the DDP baseline after warm-up (rank 0's measurement)."""
    with tempfile.TemporaryDirectory(prefix="ddp-bench-") as tmp:
        config_path = Path(tmp) / "config.toml"
        config_path.write_text(to_toml(cfg))
        out = Path(tmp) / "times.json"
        port = _free_port()
        env = {**os.environ, "UNBROKEN_LOCAL_WORKERS": str(workers)}
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "unbroken.bench",
                    "--ddp-rank",
                    str(rank),
                    "--world",
                    str(workers),
                    "--port",
                    str(port),
                    "--config",
                    str(config_path),
                    "--out",
                    str(out),
                ],
                env=env,
            )
            for rank in range(workers)
        ]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise RuntimeError(f"DDP baseline failed: exit codes {codes}")
        return json.loads(out.read_text())[WARMUP_STEPS:]


def ddp_worker(rank: int, world: int, port: int, config_path: str, out: str) -> None:
    """One rank of the DDP baseline: same model, data, M, optimizer and schedule as the trainer."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from unbroken.data import MicrobatchSampler, prepare_corpus
    from unbroken.model import Transformer, model_args
    from unbroken.plan import plan_step
    from unbroken.trainer import build_optimizer, lr_at

    cfg = load_config(config_path)
    tc = cfg.train
    torch.set_num_threads(tc.threads or max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    corpus = prepare_corpus(cfg.data)
    args = model_args(
        cfg.model.flavour,
        vocab_size=cfg.model.vocab_size or corpus.vocab_size,
        n_kv_heads=cfg.model.n_kv_heads,
        max_seq_len=cfg.data.seq_len,
    )
    torch.manual_seed(tc.seed)
    model = Transformer(args)
    ddp = DDP(model)
    optimizer = build_optimizer(model, tc)
    sampler = MicrobatchSampler(corpus.train, cfg.data.seq_len, cfg.data.microbatch_size, tc.microbatches, tc.seed)
    times = []
    for step in range(tc.steps):
        t0 = time.perf_counter()
        ids = plan_step(step, range(world), tc.microbatches).ids_for(rank)
        optimizer.zero_grad(set_to_none=True)
        for k, j in enumerate(ids):
            inputs, targets = sampler.microbatch(step, j)
            # DDP averages over ranks; scaling by world/M makes the update the same SUM/M as unbroken's.
            if k < len(ids) - 1:
                with ddp.no_sync():
                    logits = ddp(inputs)
                    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
                    (loss * world / tc.microbatches).backward()
            else:
                logits = ddp(inputs)
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
                (loss * world / tc.microbatches).backward()
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip, foreach=True)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, tc)
        optimizer.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def _stats(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    q = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    return {
        "median": statistics.median(ordered),
        "q1": q[0],
        "q3": q[2],
        "min": ordered[0],
        "max": ordered[-1],
        "n": len(ordered),
    }


def bench_ddp(config: str | None, worker_counts: list[int], repeats: int, overrides: list[str]) -> list[dict[str, Any]]:
    cfg = _bench_config(config, overrides)
    rows = []
    for workers in worker_counts:
        ours: list[float] = []
        theirs: list[float] = []
        for _ in range(repeats):  # alternate so that machine drift hits both systems alike
            theirs += run_ddp(cfg, workers)
            ours += run_unbroken(cfg, workers)
        a, b = _stats(ours), _stats(theirs)
        rows.append({"workers": workers, "unbroken": a, "ddp": b, "ratio": a["median"] / b["median"]})
    return rows


def format_ddp(rows: list[dict[str, Any]], cfg: RunConfig) -> str:
    tokens = cfg.train.microbatches * cfg.data.microbatch_size * cfg.data.seq_len
    lines = [
        f"model {cfg.model.flavour}, M = {cfg.train.microbatches}, {tokens} tokens/step, "
        f"{MEASURED_STEPS} steps after {WARMUP_STEPS} warm-up per round",
        "",
        "| workers | unbroken step (median [q1, q3]) | DDP step (median [q1, q3]) | ratio unbroken/DDP |",
        "|---|---|---|---|",
    ]
    for r in rows:
        a, b = r["unbroken"], r["ddp"]
        lines.append(
            f"| {r['workers']} | {a['median'] * 1000:.0f} ms [{a['q1'] * 1000:.0f}, {a['q3'] * 1000:.0f}] (n={a['n']}) "
            f"| {b['median'] * 1000:.0f} ms [{b['q1'] * 1000:.0f}, {b['q3'] * 1000:.0f}] (n={b['n']}) "
            f"| {r['ratio']:.3f} |"
        )
    return "\n".join(lines)


def run_bench(what: str, config: str | None, worker_counts: list[int], repeats: int, overrides: list[str]) -> int:
    if what != "ddp":
        raise ValueError(f"unknown benchmark {what!r}; allowed: ddp")
    if repeats < 1 or any(w < 1 for w in worker_counts):
        raise ValueError("--repeats and every --workers count must be >= 1")
    cfg = _bench_config(config, overrides)
    rows = bench_ddp(config, worker_counts, repeats, overrides)
    print(format_ddp(rows, cfg))
    return 0


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ddp-rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    a = parser.parse_args()
    ddp_worker(a.ddp_rank, a.world, a.port, a.config, a.out)


if __name__ == "__main__":
    _main()
