"""``unbroken bench parallel``: replicas of several ranks (FSDP2 shards, pipeline stages, tensor ranks, in any mix)
against plain torch on the same mesh, and what the death of one rank costs.

The layout is the config's: ``--parallel.shard=k`` (default 2 here), ``--parallel.pipeline=p`` and
``--parallel.tensor=t`` (default 1), so ``--workers`` is R x k x p x t for R >= 2 replicas.

1. **Step time.** ``unbroken train --workers R*k*p*t`` with that layout (fp32, and exact, reduction) against the
   same model, data, M, optimizer and clipping under plain torch: ``fully_shard`` on a 2-D mesh (replicate R,
   shard k) as FSDP2's HSDP, where torch reduce-scatters inside a replica at every microbatch and all-reduces
   across replicas at the last one (``set_requires_all_reduce``), as unbroken's replicas do through its own
   reduction. With t > 1 the model is first split by ``apply_tensor_parallel`` (torch's ``parallelize_module``)
   on the mesh's tensor dimension; with p > 1 each rank keeps its stage (``pipeline_stage``) and runs torch's
   own schedule (``torch.distributed.pipelining``, 1F1B or GPipe as unbroken picks it), which defers FSDP's
   reduce-scatter and all-reduce to the last microbatch; the clipping norm is summed over the stages. The
   mesh is unbroken's rank order (replicate, pp, shard, tensor), and the tensor ranks of a shard compute the
   same microbatches. The systems alternate round by round, so drift in the machine's load hits each alike;
   step times are commit to commit for unbroken (everything a worker does per step counts) and the loop body
   for plain torch.
2. **Peak memory per rank.** Each rank's resident high-water mark (``VmHWM``, read from /proc while it runs),
   in the same rounds.
3. **A rank killed.** A job of 3 such replicas (the ``tiny`` model) under ``kill:worker=...,phase=backward``
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

from unbroken.control.host.zygote import worker_of
from unbroken.core.config import RunConfig, load_config, preset_path, replace, to_toml
from unbroken.core.layout import ReplicaLayout
from unbroken.core.records import committed_steps, read_records
from unbroken.lab.harness import keep_final, rank_main, run_ranks, stats

WARMUP_STEPS = 2
MEASURED_STEPS = 8
SHARD = 2  # FSDP2 ranks per replica unless --parallel.shard says otherwise
KILL_STEPS = (5, 30, 55)  # the killed workers' steps: far enough apart for each replica to come back
POLL_S = 0.05


# -- memory of child processes --------------------------------------------------------------------------
class PeakMemory:
    """Samples the resident high-water mark (VmHWM, KiB) of every descendant of this process whose command
    line contains ``marker`` (``WORKERS``: every unbroken worker, started cold or forked by a zygote, whose command
    line is the zygote's), until ``stop``; the last value read of each is its peak (VmHWM only grows)."""

    WORKERS = ""

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
                    if self.marker == PeakMemory.WORKERS:
                        if worker_of(pid) is None:
                            continue
                    elif self.marker not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                        continue
                    status = Path(f"/proc/{pid}/status").read_text()
                    hwm = int(status.split("VmHWM:")[1].split()[0])
                except (OSError, IndexError, ValueError):
                    continue
                if pid not in self.peaks:
                    self.started[pid] = time.time()
                    self.workers[pid] = worker_of(pid)
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
    from unbroken.control.launcher import Launcher, plan_launch
    from unbroken.train.launch import trainer_worker
    from unbroken.train.trainer import validate_launch

    tmp = Path(tempfile.mkdtemp(prefix="unbroken-bench-parallel-", dir=keep))
    run_dir = tmp / "run"
    plan = plan_launch(cfg, run_dir, workers, False, "127.0.0.1", 0, trainer_worker, validate_launch)
    with PeakMemory(PeakMemory.WORKERS) as memory:
        code = Launcher(plan, show_progress=False, show_summary=False).run()
    if code != 0:
        raise RuntimeError(f"unbroken run failed (exit {code}); logs in {run_dir}/logs")
    commits = [r["time"] for r in committed_steps(read_records(run_dir)).values()]
    times = [b - a for a, b in zip(commits[WARMUP_STEPS - 1 : -1], commits[WARMUP_STEPS:], strict=True)]
    if keep is None:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return times, memory, run_dir


def run_hsdp(cfg: RunConfig, workers: int, keep: Path | None = None) -> tuple[list[float], PeakMemory]:
    """Step times after warm-up (rank 0's) and the ranks' peak memory of plain FSDP2 HSDP; with ``keep``, each
    rank's final parameters, work and gradient norms are written there (``figures.keep_final``)."""
    memory = PeakMemory("unbroken.lab.bench_parallel")
    times = run_ranks("unbroken.lab.bench_parallel", "--hsdp-rank", to_toml(cfg), workers, memory, keep)
    return times[WARMUP_STEPS:], memory


def hsdp_worker(rank: int, world: int, port: int, config_path: str, out: str, keep: str = "") -> None:
    """One rank of plain torch on the replica's mesh: FSDP2 HSDP, with t > 1 tensor ranks torch's tensor
    parallelism, with p > 1 stages torch's pipelining; the trainer's model, data, M, optimizer, clipping and
    schedule."""
    import torch
    import torch.distributed as dist

    from unbroken.core.plan import plan_step
    from unbroken.data.corpus import open_corpus, train_sampler
    from unbroken.ft.hostmem import retain_freed_memory
    from unbroken.train.trainer import build_model, build_optimizer, cross_entropy, lr_at

    cfg = load_config(config_path)
    tc, stages, tensor = cfg.train, cfg.parallel.pipeline, cfg.parallel.tensor
    lanes = world // (stages * tensor)  # (replica, shard) pairs: each computes microbatches of its own
    if tc.retain_host_memory:  # the same allocator setting as unbroken's workers
        retain_freed_memory()
    torch.set_num_threads(tc.threads or max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    corpus = open_corpus(cfg.data)
    model, lane, stage, stage_group = _on_mesh(build_model(cfg, corpus.vocab_size), cfg, rank, world)
    optimizer = build_optimizer(model, tc)
    sampler = train_sampler(corpus, cfg.data, tc.microbatches, tc.seed)

    def scaled_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, targets) * lanes / tc.microbatches  # FSDP averages over its mesh: SUM/M

    schedules: dict[int, Any] = {}
    times = []
    work: list[list[list[int]]] = []  # per step, [id, tokens] of each microbatch this rank's lane trained on
    norms: list[Any] = []  # per step, the clipping's gradient norm (read after the loop)
    for step in range(tc.steps):
        t0 = time.perf_counter()
        ids = plan_step(step, range(lanes), tc.microbatches).ids_for(lane)
        optimizer.zero_grad(set_to_none=True)
        work.append([])
        if stage_group is None:
            for k, j in enumerate(ids):
                model.set_requires_all_reduce(k == len(ids) - 1)  # across replicas once, after the last microbatch
                inputs, targets = sampler.microbatch(step, j)
                work[-1].append([j, inputs.numel()])
                scaled_loss(model(inputs), targets).backward()
        else:  # pipelining defers FSDP's reduce-scatter and all-reduce to the last microbatch itself
            if len(ids) not in schedules:
                schedules[len(ids)] = _schedule(model, stage, stages, stage_group, len(ids), cfg, scaled_loss)
            schedule = schedules[len(ids)]
            pairs = [sampler.microbatch(step, j) for j in ids]
            work[-1] += [[j, x.numel()] for j, (x, _) in zip(ids, pairs, strict=True)]
            args = (torch.cat([x for x, _ in pairs]),) if stage == 0 else ()
            if stage == stages - 1:
                schedule.step(*args, target=torch.cat([y for _, y in pairs]))
            else:
                schedule.step(*args)
        if tc.grad_clip > 0 and tensor == 1 and stage_group is None:  # one mesh: torch's own clipping
            norms.append(torch.nn.utils.clip_grad_norm_(list(model.parameters()), tc.grad_clip, foreach=True))
        elif tc.grad_clip > 0:
            norms.append(clip_across_meshes(list(model.parameters()), tc.grad_clip, stage_group=stage_group))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, tc)
        optimizer.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    if keep:
        from torch.distributed.tensor import DTensor

        whole = [float(n.full_tensor() if isinstance(n, DTensor) else n) for n in norms]
        keep_final(keep, rank, model, lane, work, norms=whole)
    dist.destroy_process_group()


def _on_mesh(model: Any, cfg: RunConfig, rank: int, world: int) -> tuple[Any, int, int, Any]:
    """``model`` laid out by plain torch on the replica's mesh: this rank's part of it, its lane (its (replica,
    shard) pair), its pipeline stage and the stages' group (None without pipelining)."""
    from torch.distributed.device_mesh import init_device_mesh

    from unbroken.ft.parallel.fsdp import apply_fsdp
    from unbroken.ft.parallel.tensor import apply_tensor_parallel
    from unbroken.train.stages import pipeline_stage
    from unbroken.train.trainer import tensor_plan

    shard, stages, tensor = cfg.parallel.shard, cfg.parallel.pipeline, cfg.parallel.tensor
    lanes = world // (stages * tensor)
    stage_group = None
    if tensor == 1 and stages == 1:
        mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
        lane, stage = rank, 0
    else:  # unbroken's rank order: worker = replica x (stage, shard, tensor), row-major, tensor ranks innermost
        mesh4 = init_device_mesh(
            "cpu",
            (lanes // shard, stages, shard, tensor),
            mesh_dim_names=("replicate", "pp", "shard", "tensor"),
        )
        stage = mesh4["pp"].get_local_rank()
        lane = mesh4["replicate"].get_local_rank() * shard + mesh4["shard"].get_local_rank()
        if stages > 1:
            model = pipeline_stage(model, stage, stages)
            stage_group = mesh4["pp"].get_group()
        if tensor > 1:
            apply_tensor_parallel(model, mesh4["tensor"], tensor_plan(cfg), cfg.parallel.sequence_parallel)
        mesh = mesh4["replicate", "shard"]
    apply_fsdp(model, mesh)  # a 2-D mesh: replicated over its first dimension, sharded over its second (HSDP)
    return model, lane, stage, stage_group


def _schedule(model: Any, stage: int, stages: int, group: Any, n: int, cfg: RunConfig, loss_fn: Any) -> Any:
    """torch's schedule for ``n`` microbatches through this rank's stage, the kind unbroken's pipeline runs
    (``schedule_kind``); gradients summed, not averaged."""
    import torch
    from torch.distributed.pipelining import PipelineStage

    from unbroken.ft.parallel.pipeline import schedule_kind

    pipeline_stage = PipelineStage(model, stage, stages, torch.device("cpu"), group=group)
    kind = schedule_kind(cfg.parallel.schedule, n, stages)
    return kind(pipeline_stage, n_microbatches=n, loss_fn=loss_fn, scale_grads=False)


def clip_across_meshes(params: list[Any], max_norm: float, foreach: bool = True, stage_group: Any = None) -> Any:
    """torch's ``clip_grad_norm_`` for gradients on several meshes: FSDP's (replicate, shard) mesh for what
    tensor parallelism leaves whole, the 3-D one for what it splits. DTensor's foreach ops take one mesh at a
    time, so the norm is taken per mesh, made whole and combined, and each mesh's gradients are scaled apart.
    With pipeline stages the squared norms of the stages are summed over ``stage_group`` (as torchtitan's
    clipping does). Returns the norm."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    by_mesh: dict[object, list[Any]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in ps], foreach=foreach) for ps in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    if stage_group is not None:
        squared = total**2
        dist.all_reduce(squared, group=stage_group)
        total = squared.sqrt()
    for ps in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total, foreach=foreach)
    return total


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


def bench_kills(config: str | None, layout: ReplicaLayout, overrides: list[str]) -> dict[str, Any]:
    """A job of 3 replicas of ``layout`` with a rank killed in its backward at each of ``KILL_STEPS``."""
    per = layout.size  # ranks per replica
    workers = 3 * per
    steps = KILL_STEPS[-1] + 15
    events = []
    for n, step in enumerate(KILL_STEPS):
        victim = (n % 3) * per + (per - 1 if n % 2 else 0)  # another replica each time, its first or last rank
        events.append(f"kill:worker={victim},step={step},phase=backward,rejoin=0.5")
        # A replacement takes seconds to start; slow steps (the last replica 10x slower) leave it that time.
        slow = 2 * per if n % 3 != 2 else 0
        events.append(f"slow:worker={slow},factor=10,steps={step + 1}-{min(step + 15, steps - 1)}")
    degrees = [f"--parallel.{name}={n}" for name, n in _degrees(layout)]
    cfg = _config(config, [*degrees, f"--failures.schedule={'; '.join(events)}", *overrides], steps)
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
    layout = ReplicaLayout.of(cfg.parallel)
    med = {name: statistics.median(v) for name, v in t.items()}
    mem = {name: statistics.median(v) for name, v in m.items()}
    lines = [
        f"model {cfg.model.flavour}, {step['workers'] // layout.size} replicas x {_describe(layout)}, "
        f"M = {cfg.train.microbatches}, "
        f"{tokens} tokens/step, {MEASURED_STEPS} steps after {WARMUP_STEPS} warm-up per round, "
        f"{len(paired)} rounds; median [q1, q3] (n)",
        "",
        "| system | step time (ms) | vs baseline | peak RSS per rank (MiB) | vs baseline |",
        "|---|---|---|---|---|",
    ]
    for name, label in (("hsdp", _baseline(layout)), ("fp32", "unbroken fp32"), ("exact", "unbroken exact")):
        lines.append(
            f"| {label} | {_cell(t[name], 1000)} | {med[name] / med['hsdp']:.3f} | {_cell(m[name])} "
            f"| {mem[name] / mem['hsdp']:.3f} |"
        )
    p = stats(paired)
    lines += [
        "",
        f"unbroken fp32 / baseline per round (the two ran back to back): median {p['median']:.3f} "
        f"[{p['min']:.3f}, {p['max']:.3f}]",
        "",
        f"A rank killed in its backward ({kills['workers'] // layout.size} replicas x {_describe(layout)}, "
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


def _degrees(layout: ReplicaLayout) -> list[tuple[str, int]]:
    return [("shard", layout.shard), ("pipeline", layout.pipeline), ("tensor", layout.tensor)]


def _describe(layout: ReplicaLayout) -> str:
    """``(2 shards x 2 stages x 2 tensor ranks)``: a replica's degrees above 1."""
    names = {"shard": "shards", "pipeline": "stages", "tensor": "tensor ranks"}
    parts = [f"{n} {names[name]}" for name, n in _degrees(layout) if n > 1]
    return f"({' x '.join(parts)})" if parts else "(1 rank)"


def _baseline(layout: ReplicaLayout) -> str:
    """What plain torch runs on the same mesh."""
    parts = ["FSDP2 HSDP"] + ["TP"] * (layout.tensor > 1) + ["pipelining"] * (layout.pipeline > 1)
    mesh = 2 + (layout.tensor > 1) + (layout.pipeline > 1)
    return f"{' + '.join(parts)} ({mesh}-D mesh)"


def parallel_config(config: str | None, workers: int, overrides: list[str]) -> RunConfig:
    """The config ``bench parallel`` runs (``--parallel.shard`` 2 unless the overrides say otherwise), checked
    against ``workers``: ValueError (one line) for a layout the benchmark cannot run."""
    cfg = _config(config, [f"--parallel.shard={SHARD}", *overrides], 1)
    layout = ReplicaLayout.of(cfg.parallel)
    if workers % layout.size or workers < 2 * layout.size:
        raise ValueError(
            f"bench parallel: --workers {workers} must be a multiple of shard x pipeline x tensor = {layout.size}, "
            f"at least {2 * layout.size}"
        )
    lanes = workers // (layout.pipeline * layout.tensor)
    if layout.pipeline > 1 and cfg.train.microbatches % lanes:
        raise ValueError(
            f"bench parallel: train.microbatches = {cfg.train.microbatches} must be a multiple of the {lanes} "
            "pipelines (replicas x shards): plain torch's stages need as many microbatches in every pipeline"
        )
    return cfg


def bench_parallel(config: str | None, workers: int, repeats: int, overrides: list[str]) -> str:
    """``unbroken bench parallel``: ``workers`` = R x k x p x t ranks (``--parallel.shard=k``, default 2,
    ``--parallel.pipeline=p`` and ``--parallel.tensor=t``, default 1, among ``overrides``) for R >= 2 replicas."""
    layout = ReplicaLayout.of(parallel_config(config, workers, overrides).parallel)
    step = bench_step_time(config, workers, layout.shard, repeats, overrides)
    kills = bench_kills(str(preset_path("tiny")), layout, overrides)  # tiny: the slow windows stay short
    return format_parallel(step, kills)


def _main() -> None:
    rank_main("--hsdp-rank", hsdp_worker)


if __name__ == "__main__":
    _main()
