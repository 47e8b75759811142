"""``unbroken bench library``: the library's own per-step cost on a user's loop.

``examples/plain_loop.py`` (a user's small model, data and AdamW, written against ``unbroken.ft``) is run
under ``unbroken launch --workers W``, and the same loop with ``DistributedDataParallel`` (the same model
and initial weights, the same microbatches per rank from the same plan, accumulation under ``no_sync``,
the same optimizer) in W processes on gloo. The model is tiny on purpose: a step is mostly the per-step
machinery (planning, the reduction, the commit's agreement), which is what the library adds. The two
alternate round by round; unbroken's step time is the period between two commits, DDP's the loop body.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from unbroken.control.store.netif import free_port
from unbroken.lab.harness import keep_final, stats

WARMUP = 5


def _example() -> Path:
    path = Path("examples") / "plain_loop.py"
    if not path.is_file():
        raise ValueError("bench library runs examples/plain_loop.py: run it from the repository root")
    return path.resolve()


def _load_example(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("plain_loop", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_library(workers: int, steps: int, microbatches: int, exact: bool, keep: Path | None = None) -> list[float]:
    """Step times after warm-up of the plain loop under ``unbroken launch`` (with ``keep``: its run folder is
    ``keep``/run, kept)."""
    from unbroken.control.launcher import Launcher, plan_launch
    from unbroken.core.config import load_config, preset_path
    from unbroken.core.records import committed_steps, read_records
    from unbroken.train.launch import script_worker

    overrides = [f"--train.steps={steps}", f"--train.microbatches={microbatches}", "--checkpoint.every=0"]
    overrides += ["--failures.schedule=", f"--recovery.reduction={'exact' if exact else 'fp32'}"]
    cfg = load_config(str(preset_path("tiny")), overrides)
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-library-") as tmp:
        run_dir = (keep or Path(tmp)) / "run"
        command = script_worker((sys.executable, str(_example())))
        plan = plan_launch(cfg, run_dir, workers, False, "127.0.0.1", 0, command)
        code = Launcher(plan, show_progress=False, show_summary=False).run()
        if code != 0:
            raise RuntimeError(f"the plain loop under unbroken failed (exit {code})")
        commits = [r["time"] for r in committed_steps(read_records(run_dir)).values()]
    return [b - a for a, b in zip(commits[WARMUP - 1 : -1], commits[WARMUP:], strict=True)]


def run_ddp(workers: int, steps: int, microbatches: int, keep: Path | None = None) -> list[float]:
    """Step times after warm-up of the plain loop under DDP (with ``keep``: each rank's final parameters and work
    are written there, ``figures.keep_final``)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ddp-bench-library-") as tmp:
        out = Path(tmp) / "times.json"
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "unbroken.lab.bench_library", str(rank), str(workers), str(port), str(steps)]
                + [str(microbatches), str(out), str(keep or "")]
            )
            for rank in range(workers)
        ]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise RuntimeError(f"the plain loop under DDP failed: exit codes {codes}")
        return json.loads(out.read_text())[WARMUP:]


def ddp_rank(rank: int, world: int, port: int, steps: int, microbatches: int, out: str, keep: str = "") -> None:
    """One rank of the plain loop under DDP: what a user would have written without unbroken."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from unbroken.core.plan import plan_step

    example = _load_example(_example())
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    seed = 0
    torch.manual_seed(seed)
    model = example.TinyLM()
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    times = []
    work: list[list[list[int]]] = []  # per step, [id, tokens] of each microbatch trained on
    norms = []  # per step, the clipping's gradient norm
    for step in range(steps):
        t0 = time.perf_counter()
        ids = plan_step(step, range(world), microbatches).ids_for(rank)
        optimizer.zero_grad(set_to_none=True)
        work.append([])
        for k, mb in enumerate(ids):
            x, y = example.batch_for(seed, step, mb)
            work[-1].append([mb, x.numel()])
            last = k == len(ids) - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = nn.functional.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
                (loss * world / microbatches).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    if keep:
        keep_final(keep, rank, model, rank, work, norms=[float(n) for n in norms])
    dist.destroy_process_group()


def bench_library(workers: int, repeats: int, steps: int = 60, microbatches: int = 8) -> dict[str, Any]:
    times: dict[str, list[float]] = {"ddp": [], "fp32": [], "exact": []}
    for _ in range(repeats):
        times["ddp"] += run_ddp(workers, steps, microbatches)
        times["fp32"] += run_library(workers, steps, microbatches, exact=False)
        times["exact"] += run_library(workers, steps, microbatches, exact=True)
    return {"workers": workers, "steps": steps, "microbatches": microbatches, "repeats": repeats,
            **{k: stats(v) for k, v in times.items()}}  # fmt: skip


def format_library(result: dict[str, Any]) -> str:
    ddp = result["ddp"]["median"]
    lines = [
        f"examples/plain_loop.py, {result['workers']} workers, M = {result['microbatches']}, {result['steps']} steps "
        f"({WARMUP} warm-up) per round, {result['repeats']} alternating rounds; step time in ms, median [q1, q3]",
        "",
        "| loop | step time | per-step cost over DDP | / DDP |",
        "|---|---|---|---|",
    ]
    for key, name in (
        ("ddp", "DDP (no_sync accumulation)"),
        ("fp32", "unbroken.ft, fp32"),
        ("exact", "unbroken.ft, exact"),
    ):
        s = result[key]
        over = "" if key == "ddp" else f"{1e3 * (s['median'] - ddp):+.1f} ms"
        ratio = "" if key == "ddp" else f"{s['median'] / ddp:.3f}"
        lines.append(f"| {name} | {1e3 * s['median']:.1f} [{1e3 * s['q1']:.1f}, {1e3 * s['q3']:.1f}] (n={s['n']}) "
                     f"| {over} | {ratio} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    r, w, p, n, m, o, k = sys.argv[1:8]
    ddp_rank(int(r), int(w), int(p), int(n), int(m), o, k)
