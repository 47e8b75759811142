"""``unbroken bench parallel``: replicas of several ranks (FSDP2 shards, optionally tensor ranks) against plain
FSDP2 HSDP (with torch's tensor parallelism), and what the death of one rank costs.

The layout is the config's: ``--parallel.shard=k`` (default 2 here) and ``--parallel.tensor=t`` (default 1), so
``--workers`` is R x k x t for R >= 2 replicas; pipeline stages are not benchmarked.

1. **Step time.** ``unbroken train --workers R*k*t --parallel.shard=k --parallel.tensor=t`` (fp32, and exact,
   reduction) against the same model, data, M, optimizer and clipping under plain FSDP2 HSDP: ``fully_shard``
   on a 2-D mesh (replicate R, shard k), where torch reduce-scatters inside a replica at every microbatch and
   all-reduces across replicas at the last one (``set_requires_all_reduce``), as unbroken's replicas do through
   its own reduction. With t > 1 the mesh is 3-D (replicate R, shard k, tensor t): the model is first split by
   ``apply_tensor_parallel`` (torch's ``parallelize_module``) on its tensor dimension, then ``fully_shard``-ed on
   its (replicate, shard) sub-mesh as above; the t tensor ranks of a shard compute the same microbatches. The
   systems alternate round by round, so drift in the machine's load hits each alike; step times are commit to
   commit for unbroken (everything a worker does per step counts) and the loop body for HSDP.
2. **Peak memory per rank.** Each rank's resident high-water mark (``VmHWM``, read from /proc while it runs),
   in the same rounds.
3. **A rank killed.** A job of 3 replicas x k x t (the ``tiny`` model) under ``kill:worker=...,phase=backward``
   events: from the kill to the failure seen, the epoch without its replica, that epoch's group formed, the
   survivors recovered (the lost microbatches re-planned), and the interrupted step committed; and the peak
   memory of each replacement rank, which receives only its shard of the state from the rank of the same index
   in a live replica, against the rank it replaced.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from unbroken.core.config import RunConfig, load_config, preset_path, replace, to_toml
from unbroken.core.records import committed_steps, read_records
from unbroken.lab.figures import rank_main, run_ranks, stats

WARMUP_STEPS = 2
MEASURED_STEPS = 8
SHARD = 2  # FSDP2 ranks per replica unless --parallel.shard says otherwise
KILL_STEPS = (5, 30, 55)  # the killed workers' steps: far enough apart for each replica to come back
POLL_S = 0.05


# -- memory of child processes --------------------------------------------------------------------------
class PeakMemory:
    """Samples the resident high-water mark (VmHWM, KiB) of every descendant of this process whose command
    line contains ``marker``, until ``stop``; the last value read of each is its peak (VmHWM only grows)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.peaks: dict[int, int] = {}  # pid -> KiB
        self.workers: dict[int, int | None] = {}  # pid -> its UNBROKEN_WORKER_ID (None for HSDP ranks)
        self.started: dict[int, float] = {}  # pid -> when first seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            for pid in _descendants(os.getpid()):
                try:
                    if self.marker not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                        continue
                    status = Path(f"/proc/{pid}/status").read_text()
                    hwm = int(status.split("VmHWM:")[1].split()[0])
                except (OSError, IndexError, ValueError):
                    continue
                if pid not in self.peaks:
                    self.started[pid] = time.time()
                    self.workers[pid] = _worker_id(pid)
                self.peaks[pid] = max(self.peaks.get(pid, 0), hwm)

    def mib(self) -> list[float]:
        return [kib / 1024 for kib in self.peaks.values()]


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    try:
        children = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return out
    for child in children:
        out += [child, *_descendants(child)]
    return out


def _worker_id(pid: int) -> int | None:
    try:
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(b"UNBROKEN_WORKER_ID="):
                return int(item.split(b"=", 1)[1])
    except (OSError, ValueError):
        pass
    return None


# -- the two systems ------------------------------------------------------------------------------------
def _config(config: str | None, overrides: list[str], steps: int) -> RunConfig:
    base = [
        f"--train.steps={steps}",
        "--train.eval_every=0",
        "--checkpoint.every=0",
        "--train.eval_microbatches=1",
        "--failures.schedule=",
    ]
    return load_config(config or str(preset_path("default")), base + overrides)


def run_unbroken(cfg: RunConfig, workers: int, keep: Path | None = None) -> tuple[list[float], PeakMemory, Path]:
    """Commit-to-commit step times after warm-up, the workers' peak memory, and the run's directory (kept under
    ``keep`` if given, else removed)."""
    from unbroken.control.launcher import TRAINER, Launcher, plan_launch
    from unbroken.train.trainer import validate_launch

    tmp = Path(tempfile.mkdtemp(prefix="unbroken-bench-parallel-", dir=keep))
    run_dir = tmp / "run"
    plan = plan_launch(cfg, run_dir, workers, False, "127.0.0.1", 0, TRAINER, validate_launch)
    with PeakMemory("unbroken.train") as memory:
        code = Launcher(plan, show_progress=False, show_summary=False).run()
    if code != 0:
        raise RuntimeError(f"unbroken run failed (exit {code}); logs in {run_dir}/logs")
    commits = [r["time"] for r in committed_steps(read_records(run_dir)).values()]
    times = [b - a for a, b in zip(commits[WARMUP_STEPS - 1 : -1], commits[WARMUP_STEPS:], strict=True)]
    if keep is None:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return times, memory, run_dir


def run_hsdp(cfg: RunConfig, workers: int) -> tuple[list[float], PeakMemory]:
    """Step times after warm-up (rank 0's) and the ranks' peak memory of plain FSDP2 HSDP."""
    memory = PeakMemory("unbroken.lab.bench_parallel")
    times = run_ranks("unbroken.lab.bench_parallel", "--hsdp-rank", to_toml(cfg), workers, memory)
    return times[WARMUP_STEPS:], memory


def hsdp_worker(rank: int, world: int, port: int, config_path: str, out: str) -> None:
    """One rank of plain FSDP2 HSDP (with t > 1 tensor ranks, on a 3-D mesh): the trainer's model, data, M,
    optimizer, clipping and schedule."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from unbroken.core.plan import plan_step
    from unbroken.ft.fsdp import apply_fsdp
    from unbroken.ft.hostmem import retain_freed_memory
    from unbroken.ft.tensor import apply_tensor_parallel
    from unbroken.train.data import open_corpus, train_sampler
    from unbroken.train.trainer import build_model, build_optimizer, lr_at

    cfg = load_config(config_path)
    tc, shard, tensor = cfg.train, cfg.parallel.shard, cfg.parallel.tensor
    data_ranks = world // tensor  # a shard's tensor ranks compute the same microbatches
    if tc.retain_host_memory:  # the same allocator setting as unbroken's workers
        retain_freed_memory()
    torch.set_num_threads(tc.threads or max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    corpus = open_corpus(cfg.data)
    model = build_model(cfg, corpus.vocab_size)
    if tensor == 1:
        mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    else:  # tensor ranks innermost, as unbroken places them (worker = replica x shard x tensor, row-major)
        mesh3 = init_device_mesh(
            "cpu", (data_ranks // shard, shard, tensor), mesh_dim_names=("replicate", "shard", "tensor")
        )
        apply_tensor_parallel(model, mesh3["tensor"], cfg.parallel.sequence_parallel)
        mesh = mesh3["replicate", "shard"]
    apply_fsdp(model, mesh)  # a 2-D mesh: replicated over its first dimension, sharded over its second (HSDP)
    clip = torch.nn.utils.clip_grad_norm_ if tensor == 1 else clip_across_meshes
    optimizer = build_optimizer(model, tc)
    sampler = train_sampler(corpus, cfg.data, tc.microbatches, tc.seed)
    times = []
    for step in range(tc.steps):
        t0 = time.perf_counter()
        ids = plan_step(step, range(data_ranks), tc.microbatches).ids_for(rank // tensor)
        optimizer.zero_grad(set_to_none=True)
        for k, j in enumerate(ids):
            model.set_requires_all_reduce(k == len(ids) - 1)  # across replicas once, after the last microbatch
            inputs, targets = sampler.microbatch(step, j)
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
            (loss * data_ranks / tc.microbatches).backward()  # FSDP averages over its mesh: SUM/M as unbroken
        if tc.grad_clip > 0:
            clip(list(model.parameters()), tc.grad_clip, foreach=True)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, tc)
        optimizer.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def clip_across_meshes(params: list[Any], max_norm: float, foreach: bool = True) -> None:
    """torch's ``clip_grad_norm_`` for gradients on several meshes: FSDP's (replicate, shard) mesh for what
    tensor parallelism leaves whole, the 3-D one for what it splits. DTensor's foreach ops take one mesh at a
    time, so the norm is taken per mesh, made whole and combined, and each mesh's gradients are scaled apart."""
    import torch
    from torch.distributed.tensor import DTensor

    by_mesh: dict[object, list[Any]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in ps], foreach=foreach) for ps in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    for ps in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total, foreach=foreach)


# -- the benchmark --------------------------------------------------------------------------------------
def bench_step_time(config: str | None, workers: int, shard: int, repeats: int, overrides: list[str]) -> dict[str, Any]:
    """Step times and peak memory of HSDP, unbroken fp32 and unbroken exact, ``repeats`` alternating rounds."""
    cfg = _config(config, [f"--parallel.shard={shard}", *overrides], WARMUP_STEPS + MEASURED_STEPS)
    exact = replace(cfg, recovery=replace(cfg.recovery, reduction="exact"))
    times: dict[str, list[float]] = {"hsdp": [], "fp32": [], "exact": []}
    memory: dict[str, list[float]] = {"hsdp": [], "fp32": [], "exact": []}
    paired = []
    for _ in range(repeats):
        hsdp, hsdp_mem = run_hsdp(cfg, workers)
        fp32, fp32_mem, _ = run_unbroken(cfg, workers)
        ex, ex_mem, _ = run_unbroken(exact, workers)
        paired.append(statistics.median(fp32) / statistics.median(hsdp))
        for name, t, m in (("hsdp", hsdp, hsdp_mem), ("fp32", fp32, fp32_mem), ("exact", ex, ex_mem)):
            times[name] += t
            memory[name] += m.mib()
    return {"cfg": cfg, "workers": workers, "times": times, "memory": memory, "paired": paired}


def bench_kills(config: str | None, shard: int, tensor: int, overrides: list[str]) -> dict[str, Any]:
    """A job of 3 replicas x ``shard`` x ``tensor`` ranks with a rank killed in its backward at each of
    ``KILL_STEPS``."""
    per = shard * tensor  # ranks per replica
    workers = 3 * per
    steps = KILL_STEPS[-1] + 15
    events = []
    for n, step in enumerate(KILL_STEPS):
        victim = (n % 3) * per + (per - 1 if n % 2 else 0)  # another replica each time, its first or last rank
        events.append(f"kill:worker={victim},step={step},phase=backward,rejoin=0.5")
        # A replacement takes seconds to start; slow steps (the last replica 10x slower) leave it that time.
        slow = 2 * per if n % 3 != 2 else 0
        events.append(f"slow:worker={slow},factor=10,steps={step + 1}-{min(step + 15, steps - 1)}")
    layout = [f"--parallel.shard={shard}", f"--parallel.tensor={tensor}"]
    cfg = _config(config, [*layout, f"--failures.schedule={'; '.join(events)}", *overrides], steps)
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-kills-") as keep:
        _, memory, run = run_unbroken(cfg, workers, keep=Path(keep))
        records = read_records(run)
    by_type: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_type.setdefault(r["type"], []).append(r)
    rows = []
    for injected in by_type.get("injected", []):
        t = injected["time"]
        failure = next(f for f in by_type["failure"] if f["time"] >= t and f["worker"] == injected["worker"])
        epoch = next(m for m in by_type["membership"] if m["epoch"] == failure["epoch"])
        recovery = next(r for r in by_type["recovery"] if r["epoch"] == failure["epoch"])
        commit = min(s["time"] for s in by_type["step"] if s["step"] == recovery["step"] and s["time"] > t)
        rows.append(
            {
                "detected": failure["time"] - t,
                "epoch": epoch["time"] - t,
                "reformed": recovery["time_reformed"] - t,
                "recovered": recovery["time_recovered"] - t,
                "committed": commit - t,
                "removed": sorted(set(range(workers)) - set(epoch["members"])),
            }
        )
    joins = [m["epoch"] for m in by_type["membership"] if m["reason"].startswith("joined")]
    sent = [r["state_bytes"] for r in by_type["recovery"] if r["epoch"] in joins and r.get("state_bytes")]
    first: dict[int, tuple[float, float]] = {}  # worker -> (start time, peak MiB) of its first process
    replaced: list[tuple[int, float, float]] = []
    for pid in sorted(memory.peaks, key=lambda p: memory.started[p]):
        worker = memory.workers[pid]
        if worker is None:
            continue
        peak = memory.peaks[pid] / 1024
        if worker in first:
            replaced.append((worker, first[worker][1], peak))
        else:
            first[worker] = (memory.started[pid], peak)
    return {"workers": workers, "rows": rows, "replaced": replaced, "cfg": cfg, "sent": sent, "params": _params(cfg)}


def _params(cfg: RunConfig) -> int:
    """The model's parameter count (the tokenizer's vocabulary unless model.vocab_size says more)."""
    from unbroken.core.flavours import model_args, num_params

    vocab = cfg.model.vocab_size or cfg.data.vocab_size
    return num_params(model_args(cfg.model.flavour, vocab_size=vocab, n_kv_heads=cfg.model.n_kv_heads))


def _cell(values: list[float], scale: float = 1.0, unit: str = "") -> str:
    s = stats([v * scale for v in values])
    return f"{s['median']:.0f}{unit} [{s['q1']:.0f}, {s['q3']:.0f}] (n={s['n']})"


def format_parallel(step: dict[str, Any], kills: dict[str, Any]) -> str:
    cfg: RunConfig = step["cfg"]
    t, m, paired = step["times"], step["memory"], step["paired"]
    tokens = cfg.train.microbatches * cfg.data.microbatch_size * cfg.data.seq_len
    k, tp = cfg.parallel.shard, cfg.parallel.tensor
    tensor = f" x {tp} tensor ranks" if tp > 1 else ""
    med = {name: statistics.median(v) for name, v in t.items()}
    mem = {name: statistics.median(v) for name, v in m.items()}
    baseline = "FSDP2 HSDP + TP (3-D mesh)" if tp > 1 else "FSDP2 HSDP (2-D mesh)"
    kill_layout = f"{k} shards{tensor}" if tp > 1 else f"{k}"
    lines = [
        f"model {cfg.model.flavour}, {step['workers'] // (k * tp)} replicas x {k} shards{tensor}, "
        f"M = {cfg.train.microbatches}, "
        f"{tokens} tokens/step, {MEASURED_STEPS} steps after {WARMUP_STEPS} warm-up per round, "
        f"{len(paired)} rounds; median [q1, q3] (n)",
        "",
        "| system | step time (ms) | vs HSDP | peak RSS per rank (MiB) | vs HSDP |",
        "|---|---|---|---|---|",
    ]
    for name, label in (("hsdp", baseline), ("fp32", "unbroken fp32"), ("exact", "unbroken exact")):
        lines.append(
            f"| {label} | {_cell(t[name], 1000)} | {med[name] / med['hsdp']:.3f} | {_cell(m[name])} "
            f"| {mem[name] / mem['hsdp']:.3f} |"
        )
    p = stats(paired)
    lines += [
        "",
        f"unbroken fp32 / HSDP per round (the two ran back to back): median {p['median']:.3f} "
        f"[{p['min']:.3f}, {p['max']:.3f}]",
        "",
        f"A rank killed in its backward ({kills['workers'] // (k * tp)} replicas x {kill_layout}, "
        f"{kills['cfg'].model.flavour}); "
        "seconds from the kill:",
        "",
        "| kill | replica removed | failure seen | epoch published | group formed | recovered | step committed |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, r in enumerate(kills["rows"], 1):
        lines.append(
            f"| {n} | workers {r['removed']} | {r['detected']:.3f} | {r['epoch']:.3f} | {r['reformed']:.3f} "
            f"| {r['recovered']:.3f} | {r['committed']:.3f} |"
        )
    lines += ["", "| replaced worker | peak RSS of its first process (MiB) | of its replacement | ratio |"]
    lines.append("|---|---|---|---|")
    for worker, before, after in kills["replaced"]:
        lines.append(f"| {worker} | {before:.0f} | {after:.0f} | {after / before:.3f} |")
    whole = 12 * kills["params"] / 2**20  # float32 parameters and AdamW's two moments
    sent = ", ".join(f"{b / 2**20:.2f}" for b in kills["sent"])
    lines += [
        "",
        f"State sent to each rank of a rejoining replica (MiB): {sent}; the whole state (float32 parameters and "
        f"AdamW moments, {kills['params']:,} parameters) is {whole:.2f} MiB.",
    ]
    return "\n".join(lines)


def bench_parallel(config: str | None, workers: int, repeats: int, overrides: list[str]) -> str:
    """``unbroken bench parallel``: ``workers`` = R x k x t ranks (``--parallel.shard=k``, default 2, and
    ``--parallel.tensor=t``, default 1, among ``overrides``) for R >= 2 replicas."""
    layout = _config(config, [f"--parallel.shard={SHARD}", *overrides], 1).parallel
    shard, tensor, per = layout.shard, layout.tensor, layout.shard * layout.tensor
    if layout.pipeline != 1:
        raise ValueError(
            f"bench parallel: parallel.pipeline = {layout.pipeline} must be 1 (it benchmarks shards and tensor ranks)"
        )
    if workers % per or workers < 2 * per:
        raise ValueError(
            f"bench parallel: --workers {workers} must be a multiple of shard x tensor = {per}, at least {2 * per}"
        )
    step = bench_step_time(config, workers, shard, repeats, overrides)
    kills = bench_kills(str(preset_path("tiny")), shard, tensor, overrides)  # tiny: the slow windows stay short
    return format_parallel(step, kills)


def _main() -> None:
    rank_main("--hsdp-rank", hsdp_worker)


if __name__ == "__main__":
    _main()
