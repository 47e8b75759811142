"""Benchmarks behind ``unbroken bench``; their figures are recorded in docs/benchmarks.md, or in the page of their
subject (``DOCS``). ``--dry-run`` checks the arguments, resolves each benchmark's config with the overrides and says
in one line what would run (``run_bench``).

``bench ddp``: the step time of an ``unbroken`` run (fp32 and exact reduction) against the same model,
data, M and optimizer trained with ``torch.nn.parallel.DistributedDataParallel`` (gradient accumulation
under ``no_sync``), for each worker count. The systems alternate round by round on the same machine so
drift in the machine's load hits all of them; the figures are the ratio of median step times over all
rounds and the median of each round's ratio.

``bench recovery``: real SIGKILLs at backward / reduction / forward of a running job (each victim
restarted so it rejoins): detection, group re-formation and time to the first committed step after.

``bench policies``: one failure schedule under ``recover``, ``drop`` and ``restart``: committed tokens per
second, recomputed and dropped microbatches.

``bench control``: two agents of two workers: ``kill -9`` of a worker, of a whole agent, of the coordinator
(journal, etcd): the time to the re-formed group, to a serving coordinator, to the next commit
(``bench_control``).

``bench library``: ``examples/plain_loop.py`` under ``unbroken launch`` against the same loop with DDP: the
library's own per-step cost (``bench_library``).

``bench start``: what starting a worker costs, cold against forked by the agent's zygote (``bench_start``).

``bench data``: ``unbroken prepare`` against Hugging Face ``tokenizers`` and ``datasets.map``, its memory,
and what reading prepared data costs a training step and a worker's memory (``bench_data``).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from enum import StrEnum
from pathlib import Path
from typing import Any

from unbroken.core.config import RunConfig, load_config, preset_path, replace, to_toml
from unbroken.core.records import RecordKind, committed_steps
from unbroken.lab.harness import keep_final, rank_main, run_ranks, stats
from unbroken.lab.runs import run_to_end

WARMUP_STEPS = 2
MEASURED_STEPS = 6


def _bench_config(config: str | None, overrides: list[str]) -> RunConfig:
    base = [
        f"--train.steps={WARMUP_STEPS + MEASURED_STEPS}",
        "--train.eval_every=0",
        "--checkpoint.every=0",
        "--train.eval_microbatches=1",
        "--failures.schedule=",  # failure-free: the demo preset kills a worker
    ]
    return load_config(config or _default_config(), base + overrides)


def _default_config() -> str:
    return str(preset_path("default"))


def run_unbroken(cfg: RunConfig, workers: int, keep: Path | None = None) -> list[float]:
    """Step times (s) of an unbroken run after warm-up: the periods between consecutive commits (the
    leader's step records are stamped when it publishes them, right after each commit), so everything a
    worker does per step counts, its bookkeeping between steps included. DDP's loop does nothing between
    steps, so its loop-body time is the same measure. With ``keep`` the run's folder is ``keep``/run, kept."""
    from unbroken.control.launcher import Launcher, plan_launch
    from unbroken.core.records import read_records
    from unbroken.train.launch import trainer_worker
    from unbroken.train.trainer import validate_launch

    with tempfile.TemporaryDirectory(prefix="unbroken-bench-") as tmp:
        run_dir = (keep or Path(tmp)) / "run"
        plan = plan_launch(cfg, run_dir, workers, False, "127.0.0.1", 0, trainer_worker, validate_launch)
        code = Launcher(plan, show_progress=False, show_summary=False).run()
        if code != 0:
            raise RuntimeError(f"unbroken run failed (exit {code}); logs in {run_dir}/logs")
        commits = [r["time"] for r in committed_steps(read_records(run_dir)).values()]
        return [b - a for a, b in zip(commits[WARMUP_STEPS - 1 : -1], commits[WARMUP_STEPS:], strict=True)]


def run_ddp(cfg: RunConfig, workers: int, keep: Path | None = None) -> list[float]:
    """Step times (s) of the DDP baseline after warm-up (rank 0's measurement); with ``keep``, each rank's
    final parameters and work are written there (``figures.keep_final``)."""
    times = run_ranks("unbroken.lab.bench", "--ddp-rank", to_toml(cfg), workers, contextlib.nullcontext(), keep)
    return times[WARMUP_STEPS:]


def ddp_worker(rank: int, world: int, port: int, config_path: str, out: str, keep: str = "") -> None:
    """One rank of the DDP baseline: same model, data, M, optimizer and schedule as the trainer."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from unbroken.core.plan import plan_step
    from unbroken.data.corpus import open_corpus, train_sampler
    from unbroken.ft.hostmem import retain_freed_memory
    from unbroken.train.model import Transformer, model_args
    from unbroken.train.trainer import build_optimizer, lr_at

    cfg = load_config(config_path)
    tc = cfg.train
    if tc.retain_host_memory:  # the same allocator setting as unbroken's workers: compare like with like
        retain_freed_memory()
    torch.set_num_threads(tc.threads or max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    corpus = open_corpus(cfg.data)
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
    sampler = train_sampler(corpus, cfg.data, tc.microbatches, tc.seed)
    times = []
    work: list[list[list[int]]] = []  # per step, [id, tokens] of each microbatch trained on
    norms = []  # per step, the clipping's gradient norm
    for step in range(tc.steps):
        t0 = time.perf_counter()
        ids = plan_step(step, range(world), tc.microbatches).ids_for(rank)
        optimizer.zero_grad(set_to_none=True)
        work.append([])
        for k, j in enumerate(ids):
            inputs, targets = sampler.microbatch(step, j)
            work[-1].append([j, inputs.numel()])
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
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip, foreach=True))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, tc)
        optimizer.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    if keep:
        keep_final(keep, rank, model, rank, work, norms=[float(n) for n in norms])
    dist.destroy_process_group()


def bench_ddp(config: str | None, worker_counts: list[int], repeats: int, overrides: list[str]) -> list[dict[str, Any]]:
    """Median step times of DDP, unbroken (fp32 reduction) and unbroken (exact reduction), alternating."""
    cfg = _bench_config(config, overrides)
    exact = replace(cfg, recovery=replace(cfg.recovery, reduction="exact"))
    rows = []
    for workers in worker_counts:
        times: dict[str, list[float]] = {"ddp": [], "fp32": [], "exact": []}
        paired: list[float] = []  # each round's fp32 / DDP: the two ran back to back, under the same load
        for _ in range(repeats):  # alternate so that machine drift hits every system alike
            ddp, fp32 = run_ddp(cfg, workers), run_unbroken(cfg, workers)
            paired.append(statistics.median(fp32) / statistics.median(ddp))
            times["ddp"] += ddp
            times["fp32"] += fp32
            times["exact"] += run_unbroken(exact, workers)
        summary = {name: stats(values) for name, values in times.items()}
        rows.append(
            {
                "workers": workers,
                **summary,
                "ratio": summary["fp32"]["median"] / summary["ddp"]["median"],
                "exact_ratio": summary["exact"]["median"] / summary["ddp"]["median"],
                "paired": stats(paired),
            }
        )
    return rows


def _ms(stat: dict[str, float]) -> str:
    return f"{stat['median'] * 1000:.0f} ms [{stat['q1'] * 1000:.0f}, {stat['q3'] * 1000:.0f}] (n={stat['n']})"


def format_ddp(rows: list[dict[str, Any]], cfg: RunConfig) -> str:
    tokens = cfg.train.microbatches * cfg.data.microbatch_size * cfg.data.seq_len
    lines = [
        f"model {cfg.model.flavour}, M = {cfg.train.microbatches}, {tokens} tokens/step, "
        f"{MEASURED_STEPS} steps after {WARMUP_STEPS} warm-up per round; step time median [q1, q3]; "
        "fp32 / DDP per round: the median [min, max] of each round's ratio (the two ran back to back)",
        "",
        "| workers | DDP | unbroken fp32 | unbroken exact | fp32 / DDP | exact / DDP | fp32 / DDP per round |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        paired = r["paired"]
        lines.append(
            f"| {r['workers']} | {_ms(r['ddp'])} | {_ms(r['fp32'])} | {_ms(r['exact'])} "
            f"| {r['ratio']:.3f} | {r['exact_ratio']:.3f} "
            f"| {paired['median']:.3f} [{paired['min']:.3f}, {paired['max']:.3f}] (n={paired['n']}) |"
        )
    return "\n".join(lines)


def bench_recovery(config: str | None, workers: int, kills: int, overrides: list[str]) -> dict[str, Any]:
    """Latency of in-step recovery after real SIGKILLs: detection, group re-formation, first commit after."""
    phases = ["backward", "reduction", "forward"]
    every = 4
    events = [
        f"kill:worker={1 + i % (workers - 1)},step={every * (i + 1)},phase={phases[i % 3]},rejoin=0.5"
        for i in range(kills)
    ]
    steps = every * (kills + 2)
    base = [
        f"--train.steps={steps}",
        "--train.eval_every=0",
        "--checkpoint.every=0",
        "--train.eval_microbatches=1",
        "--train.microbatches=16",
        f"--failures.schedule={'; '.join(events)}",
    ]
    cfg = load_config(config or _tiny_config(), base + overrides)
    records = run_to_end(cfg, workers)
    failures = [r for r in records if r["type"] == RecordKind.FAILURE and "detection_s" in r]
    recoveries = [r for r in records if r["type"] == RecordKind.RECOVERY and r.get("missing") is not None]
    commits = sorted((r["time"], r["step"]) for r in records if r["type"] == RecordKind.STEP)
    rows = []
    for f in failures:
        injected = f["time"] - f["detection_s"]
        reform = next((r for r in recoveries if r["epoch"] == f["epoch"]), None)
        first = next((t for t, _ in commits if t > f["time"]), None)
        if reform is None or first is None:
            continue
        rows.append(
            {
                "detection_s": f["detection_s"],
                "reform_s": reform["reform_s"],
                "to_commit_s": first - injected,
                "event": f.get("event", ""),
            }
        )
    return {
        "workers": workers,
        "kills": len(rows),
        "scheduled": kills,
        "rows": rows,
        "detection": stats([r["detection_s"] for r in rows]),
        "reform": stats([r["reform_s"] for r in rows]),
        "detect_plus_reform": stats([r["detection_s"] + r["reform_s"] for r in rows]),
        "to_commit": stats([r["to_commit_s"] for r in rows]),
    }


def format_recovery(result: dict[str, Any]) -> str:
    lines = [
        f"{result['kills']} of {result['scheduled']} scheduled kills timed (a kill with no recovery of its own epoch, "
        f"e.g. skipped or merged with another change, is not) with {result['workers']} workers; "
        "seconds, median [q1, q3] (min - max)",
        "",
        "| phase of recovery | median | q1 | q3 | min | max |",
        "|---|---|---|---|---|---|",
    ]
    for name, key in [
        ("detection (SIGKILL -> new epoch published)", "detection"),
        ("group re-formation", "reform"),
        ("detection + re-formation", "detect_plus_reform"),
        ("SIGKILL -> first committed step", "to_commit"),
    ]:
        st = result[key]
        lines.append(
            f"| {name} | {st['median']:.3f} | {st['q1']:.3f} | {st['q3']:.3f} | {st['min']:.3f} | {st['max']:.3f} |"
        )
    return "\n".join(lines)


def bench_policies(config: str | None, workers: int, overrides: list[str]) -> list[dict[str, Any]]:
    """Committed tokens per second and wasted work of recover, drop and restart on one failure schedule."""
    schedule = "kill:worker=1,step=10,phase=backward,rejoin=3; kill:worker=2,step=25,phase=reduction"
    base = [
        "--train.steps=40",
        "--train.eval_every=0",
        "--train.eval_microbatches=1",
        "--checkpoint.every=10",
        "--train.microbatches=16",
        f"--failures.schedule={schedule}",
    ]
    rows = []
    for policy in ("recover", "drop", "restart"):
        cfg = load_config(config or _tiny_config(), [*base, f"--recovery.policy={policy}", *overrides])
        records = run_to_end(cfg, workers)
        steps = [r for r in records if r["type"] == RecordKind.STEP and not r.get("republished")]  # every commit, timed
        final = committed_steps(records)
        start = min(r["time"] - r["step_time_s"] for r in steps)
        wall = max(r["time"] for r in final.values()) - start
        m = cfg.train.microbatches
        committed = sum(r["tokens"] * (m - r["dropped"]) / m for r in final.values())
        redone_steps = len(steps) - len(final)  # steps committed again after a rollback to a checkpoint
        rows.append(
            {
                "policy": policy,
                "wall_s": wall,
                "committed_tokens": committed,
                "tokens_per_s": committed / wall,
                "recomputed_microbatches": sum(r.get("recomputed", 0) for r in steps) + redone_steps * m,
                "dropped_microbatches": sum(r["dropped"] for r in final.values()),
                "restarts": sum(1 for r in records if r["type"] == RecordKind.RESTART),
            }
        )
    return rows


def format_policies(rows: list[dict[str, Any]]) -> str:
    best = max(r["tokens_per_s"] for r in rows)
    lines = [
        "| policy | wall (s) | committed tokens | committed tokens/s | vs best | recomputed mb | dropped mb "
        "| restarts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['wall_s']:.1f} | {r['committed_tokens']:,.0f} | {r['tokens_per_s']:,.0f} "
            f"| {r['tokens_per_s'] / best:.2f} | {r['recomputed_microbatches']} | {r['dropped_microbatches']} "
            f"| {r['restarts']} |"
        )
    return "\n".join(lines)


CONVERGENCE_POLICIES = ("recover", "mecefo", "mecefo-spread", "drop")


def bench_convergence(
    config: str | None,
    workers: int,
    steps: int,
    scenarios: tuple[str, ...],
    policies: tuple[str, ...],
    overrides: list[str],
    seed: int = 0,
) -> dict[str, Any]:
    """Validation perplexity after a fixed budget of steps, failure-free and under MeCeFO's scenarios, per
    policy; and the step time while a worker is down against while all are up, in the same run.

    The failure-free reference runs first; its median step time converts the scenarios' repair hours into the
    launcher's restart delay (``failures.step_time_s``), so every policy sees the same seeded kills."""
    base = [
        f"--train.steps={steps}",
        f"--train.eval_every={steps}",
        "--train.eval_microbatches=32",
        "--checkpoint.every=0",
        "--train.microbatches=8",
        "--data.microbatch_size=4",
        f"--failures.seed={seed}",
        "--failures.schedule=",
    ]
    ref_cfg = load_config(config or _tiny_config(), [*base, *overrides])
    reference = _convergence_row("none", "recover", run_to_end(ref_cfg, workers), workers)
    step_time = reference["step_time_up_s"]
    rows = []
    for scenario in scenarios:
        for policy in policies:
            cfg = load_config(
                config or _tiny_config(),
                [
                    *base,
                    f"--failures.scenario={scenario}",
                    f"--failures.step_time_s={step_time:.4f}",
                    f"--recovery.policy={policy}",
                    *overrides,
                ],
            )
            try:
                row = _convergence_row(scenario, policy, run_to_end(cfg, workers), workers)
                row["ppl_vs_reference"] = row["val_ppl"] / reference["val_ppl"] - 1.0
            except RuntimeError as e:  # e.g. every worker down at once: the job stops, as a real one would
                row = {"scenario": scenario, "policy": policy, "error": str(e).splitlines()[0]}
            print(json.dumps(row), file=sys.stderr, flush=True)  # progress: a long benchmark
            rows.append(row)
    return {"workers": workers, "steps": steps, "step_time_s": step_time, "reference": reference, "rows": rows}


def _convergence_row(scenario: str, policy: str, records: list[dict[str, Any]], workers: int) -> dict[str, Any]:
    steps = committed_steps(records)
    final_eval = max((r for r in records if r["type"] == RecordKind.EVAL), key=lambda r: r["step"])
    timed = [r for r in steps.values() if not r.get("republished")]
    down = [r["step_time_s"] for r in timed if r["alive"] < workers]
    up = [r["step_time_s"] for r in timed if r["alive"] >= workers and not r["recoveries"]]
    return {
        "scenario": scenario,
        "policy": policy,
        "val_loss": final_eval["val_loss"],
        "val_ppl": final_eval["val_ppl"],
        "kills": sum(1 for r in records if r["type"] == RecordKind.FAILURE),
        "steps_degraded": len(down),
        "efficient_microbatches": sum(r.get("efficient", 0) for r in steps.values()),
        "dropped_microbatches": sum(r["dropped"] for r in steps.values()),
        "recomputed_microbatches": sum(r.get("recomputed", 0) for r in steps.values()),
        "step_time_up_s": statistics.median(up) if up else float("nan"),
        "step_time_down_s": statistics.median(down) if down else float("nan"),
    }


def format_convergence(result: dict[str, Any]) -> str:
    ref = result["reference"]
    lines = [
        f"{result['workers']} workers, {result['steps']} steps; failure-free reference: val loss "
        f"{ref['val_loss']:.4f}, ppl {ref['val_ppl']:.2f}; reference step time {result['step_time_s'] * 1000:.0f} ms",
        "",
        "| scenario | policy | kills | steps with a worker down | efficient mb | dropped mb | recomputed mb "
        "| val loss | val ppl | ppl vs failure-free | step time, all up (ms) | step time, one+ down (ms) | down / up |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['scenario']} | {r['policy']} | run failed: {r['error']} |" + " |" * 10)
            continue
        ratio = r["step_time_down_s"] / r["step_time_up_s"]
        lines.append(
            f"| {r['scenario']} | {r['policy']} | {r['kills']} | {r['steps_degraded']} | {r['efficient_microbatches']} "
            f"| {r['dropped_microbatches']} | {r['recomputed_microbatches']} | {r['val_loss']:.4f} "
            f"| {r['val_ppl']:.2f} | {r['ppl_vs_reference'] * 100:+.2f}% | {r['step_time_up_s'] * 1000:.0f} "
            f"| {r['step_time_down_s'] * 1000:.0f} | {ratio:.2f} |"
        )
    return "\n".join(lines)


def _tiny_config() -> str:
    return str(preset_path("tiny"))


def bench_mecefo(steps: int) -> str:
    """MeCeFO's efficient mode on ``small``: one microbatch (time, memory, rank table) and the gradient
    error over a run under the ``high`` scenario, for plain and spread MeCeFO."""
    from unbroken.lab import bench_mecefo as bm

    out = []
    result = bm.bench_microbatch()
    out.append(
        f"one microbatch, small, seq_len {result['seq_len']}, batch {result['batch']}, rank {result['rank']}, "
        f"{result['threads']} threads: median [min, max] of {9} alternating repeats"
    )
    out += ["", "| mode | time (ms) | saved activations (MiB) | in blocks (MiB) |", "|---|---|---|---|"]
    for name in ("exact", "efficient"):
        out.append(
            f"| {name} | {result[f'{name}_ms']:.1f} [{result[f'{name}_ms_min']:.1f}, {result[f'{name}_ms_max']:.1f}] "
            f"| {result[f'{name}_saved_bytes'] / 2**20:.2f} | {result[f'{name}_block_saved_bytes'] / 2**20:.2f} |"
        )
    out.append(
        f"| efficient / exact | {result['time_ratio']:.3f} (FLOPs model {result['expected_flops_ratio']:.3f}) "
        f"| {result['memory_ratio']:.3f} (model {result['expected_memory_ratio']:.3f}) "
        f"| {result['block_memory_ratio']:.4f} (model {result['expected_block_memory_ratio']:.4f}) |"
    )
    rows = bm.gradient_errors(ranks=(8, 16, 32, 64, 128, bm.FULL_RANK))
    out += [
        "",
        "relative gradient error of one efficient microbatch, per rank r (after 300 exact steps; mean of 4):",
        "",
        "| r | FFN weights: projection only | FFN weights vs exact | all but attention | all (attention = 0) |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        r = "full" if row["rank"] == bm.FULL_RANK else str(row["rank"])
        out.append(
            f"| {r} | {row['ffn_projection']:.3f} | {row['ffn']:.3f} | {row['model']:.3f} "
            f"| {row['model_with_attention']:.3f} |"
        )
    out += [
        "",
        f"step gradient error over a {steps}-step run, `high` scenario, 4 workers, M = 8 "
        "(failure steps only; median [q1, q3], max):",
        "",
        "| policy | failure steps | step error, all | step error, without attention | efficient microbatch alone |",
        "|---|---|---|---|---|",
    ]
    for spread in (False, True):
        run = bm.gradient_error_run(steps=steps, spread=spread)
        fs = run["failure_steps"]
        cells = []
        for key in ("error", "error_without_attention", "microbatch_error"):
            st = stats([r[key] for r in fs])
            cells.append(f"{st['median']:.3f} [{st['q1']:.3f}, {st['q3']:.3f}], max {st['max']:.3f}")
        out.append(f"| {'mecefo-spread' if spread else 'mecefo'} | {len(fs)} | {' | '.join(cells)} |")
    return "\n".join(out)


class Bench(StrEnum):
    """The benchmarks of ``unbroken bench`` (``all`` runs each)."""

    DDP = "ddp"
    RECOVERY = "recovery"
    CONTROL = "control"
    LIBRARY = "library"
    POLICIES = "policies"
    MECEFO = "mecefo"
    CONVERGENCE = "convergence"
    SIMULATOR = "simulator"
    DATA = "data"
    PARALLEL = "parallel"
    SPARES = "spares"
    FAILSLOW = "failslow"
    CONTROL_SCALE = "control-scale"
    CONTROL_NETNS = "control-netns"  # needs root (network namespaces): says why not where it cannot run
    START = "start"
    GPU = "gpu"  # needs a CUDA GPU: not part of ``all`` (bench_gpu)


BENCHES = tuple(b.value for b in Bench)
CPU_BENCHES = tuple(b for b in BENCHES if b != Bench.GPU)  # what ``all`` runs
DOC = Path("docs") / "benchmarks.md"  # in the checkout --record runs from
# Where each benchmark's figures are recorded (benchmarks.md unless named here: the page of their subject).
DOCS = {
    "simulator": DOC.with_name("simulation.md"),
    "data": DOC.with_name("data.md"),
    "control-scale": DOC.with_name("control.md"),
    "gpu": DOC.with_name("gpu.md"),
}


def machine() -> str:
    """One line naming the machine the figures come from."""
    import platform

    import torch

    mem = ""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        kib = int(meminfo.read_text().split("MemTotal:")[1].split()[0])
        mem = f", {kib / 2**20:.0f} GiB"
    cpu = platform.processor() or platform.machine()
    accel = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{os.cpu_count()} CPU cores ({cpu}){mem}, {accel}; torch {torch.__version__}, "
        f"Python {platform.python_version()}, {platform.system()} {platform.release()}"
    )


def _commit(where: Path) -> str:
    """``, commit abc1234`` (``+`` if the tree has changes) in a git checkout; empty elsewhere."""

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return ""
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return f", commit {head.stdout.strip()}{'+' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        return ""


def record(name: str, command: str, body: str, doc: Path = DOC) -> None:
    """Replace (or append) section ``name`` of docs/benchmarks.md: the command, when, where, the table.

    A section lies between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``; text outside the markers
    (the discussion) is kept. Written atomically (temporary file, rename)."""
    if not doc.parent.is_dir():
        raise ValueError(f"--record writes {doc}: run it from the repository root (no {doc.parent}/ here)")
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()) + _commit(doc.parent)
    section = f"{start}\n```sh\n{command}\n```\n\n{stamp}, {machine()}\n\n{body}\n{end}"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if start in text and end in text:
        text = text[: text.index(start)] + section + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + f"\n\n{section}\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    tmp = doc.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, doc)


def run_one(
    what: str,
    config: str | None,
    worker_counts: list[int],
    repeats: int,
    overrides: list[str],
    steps: int | None,
    data_gb: tuple[float, float] = (1.0, 10.0),
    members: tuple[int, ...] = (),
    news: tuple[str, ...] = (),
    beats: tuple[str, ...] = (),
) -> str:
    """The markdown figures of benchmark ``what`` (``data_gb``: bench data's throughput and reader corpora;
    ``members``, ``news`` and ``beats``: bench control-scale's member counts, ways of taking the news and
    senders of the heartbeats)."""
    if what == "ddp":
        cfg = _bench_config(config, overrides)
        return format_ddp(bench_ddp(config, worker_counts, repeats, overrides), cfg)
    if what == "recovery":
        return format_recovery(bench_recovery(config, max(worker_counts), 12 * repeats, overrides))
    if what == "control":
        from unbroken.lab.bench_control import bench_control

        return bench_control(config or _tiny_config(), repeats, overrides)
    if what == "control-netns":
        from unbroken.lab.bench_control import bench_control_netns

        return bench_control_netns(config or _tiny_config(), repeats, overrides)
    if what == "library":
        from unbroken.lab.bench_library import bench_library, format_library

        return format_library(bench_library(max(worker_counts), repeats, steps or 60))
    if what == "policies":
        return format_policies(bench_policies(config, max(worker_counts), overrides))
    if what == "mecefo":
        return bench_mecefo(steps or 100)
    if what == "data":
        from unbroken.lab.bench_data import run_bench_data

        corpus_gb, reader_gb = data_gb
        return run_bench_data(corpus_gb=corpus_gb, repeats=repeats, reader_gb=reader_gb, train_steps=steps or 100)[1]
    if what == "parallel":
        from unbroken.lab.bench_parallel import bench_parallel

        return bench_parallel(config, max(worker_counts), repeats, overrides)
    if what == "spares":
        from unbroken.lab.bench_spares import STEPS_AFTER, bench_spares, format_spares

        return format_spares(bench_spares(config, repeats, overrides, steps or STEPS_AFTER))
    if what == "failslow":
        from unbroken.lab.bench_failslow import bench_failslow, format_failslow

        return format_failslow(bench_failslow(config, max(worker_counts), repeats, overrides), max(worker_counts))
    if what == "control-scale":
        from unbroken.lab.bench_control_scale import (
            BEATS_MODES,
            DEFAULT_MEMBERS,
            NEWS_MODES,
            bench_control_scale,
            format_control_scale,
        )

        counts = list(members or DEFAULT_MEMBERS)
        return format_control_scale(bench_control_scale(counts, news or NEWS_MODES, beats or BEATS_MODES[:1]))
    if what == "start":
        from unbroken.lab.bench_start import bench_start, format_start

        return format_start(bench_start(max(worker_counts), repeats, overrides), max(worker_counts))
    if what == "simulator":
        from unbroken.lab.bench_simulator import bench_simulator, format_simulator

        return format_simulator(bench_simulator(config or _tiny_config(), overrides))
    assert what == "convergence", what
    result = bench_convergence(
        config, max(worker_counts), steps or 300, ("low", "mid", "high"), CONVERGENCE_POLICIES, overrides
    )
    return format_convergence(result)


def _member_counts(members: str) -> tuple[int, ...]:
    """``--members`` (bench control-scale): comma-separated counts, each at least 6; empty: the default."""
    from unbroken.lab.bench_control_scale import VICTIMS

    if not members:
        return ()
    try:
        counts = tuple(int(m) for m in members.split(","))
    except ValueError:
        raise ValueError(f"--members {members!r}: expected comma-separated whole numbers, e.g. 64,1024") from None
    if any(n < VICTIMS + 2 for n in counts):
        raise ValueError(f"--members {members!r}: each count must be at least {VICTIMS + 2}")
    return counts


def _modes(option: str, given: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """``--news`` or ``--beats`` (bench control-scale): a comma-separated choice among ``allowed``."""
    modes = tuple(m.strip() for m in given.split(",") if m.strip())
    if unknown := [m for m in modes if m not in allowed]:
        raise ValueError(f"{option} {given!r}: unknown {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    return modes


def run_bench(
    what: str,
    config: str | None,
    worker_counts: list[int],
    repeats: int,
    overrides: list[str],
    steps: int | None = None,
    record_doc: bool = False,
    command: str = "",
    data_gb: tuple[float, float] = (1.0, 10.0),
    out: str | None = None,
    parts: str = "",
    members: str = "",
    news: str = "",
    beats: str = "",
    dry_run: bool = False,
) -> int:
    """``unbroken bench WHAT``: print the figures; with ``record_doc`` (always for ``all``) also write them
    into their section of docs/benchmarks.md under the command that produced them. ``gpu`` (``bench_gpu``)
    also writes its tables and figures into ``out`` and returns 1 unless its bitwise checks pass. ``dry_run``:
    every argument checked and each benchmark's config resolved as the run does, one line of what would run
    printed, nothing started or written."""
    if what != "all" and what not in BENCHES:
        raise ValueError(f"unknown benchmark {what!r}; allowed: all, {', '.join(BENCHES)}")
    if what == Bench.GPU:
        return _run_bench_gpu(record_doc, command, out, parts, dry_run)
    if repeats < 1 or any(w < 1 for w in worker_counts):
        raise ValueError("--repeats and every --workers count must be >= 1")
    if steps is not None and steps < 1:
        raise ValueError(f"--steps = {steps} must be >= 1")
    member_counts = _member_counts(members)
    from unbroken.lab.bench_control_scale import BEATS_MODES, NEWS_MODES

    news_modes = _modes("--news", news, NEWS_MODES)
    beats_modes = _modes("--beats", beats, BEATS_MODES)
    recording = record_doc or what == "all"
    if recording and not DOC.parent.is_dir():
        raise ValueError(f"--record writes into {DOC.parent}/: run it from the repository root")
    names = CPU_BENCHES if what == "all" else (what,)
    if dry_run:
        print(_dry_run_line(names, config, worker_counts, repeats, overrides, recording))
        return 0
    for name in names:
        body = run_one(
            name, config, worker_counts, repeats, overrides, steps, data_gb, member_counts, news_modes, beats_modes
        )
        print(body, flush=True)
        if recording:
            text = command.replace(" all", f" {name}", 1) if what == "all" else command
            record(name, text, body, DOCS.get(name, DOC))
    return 0


def _run_bench_gpu(record_doc: bool, command: str, out: str | None, parts: str, dry_run: bool) -> int:
    from unbroken.lab.bench_gpu import PARTS, bench_gpu, parse_parts, require_gpu

    chosen = parse_parts(parts or ",".join(PARTS))
    require_gpu()  # before anything is written
    if record_doc and not DOC.parent.is_dir():
        raise ValueError(f"--record writes into {DOC.parent}/: run it from the repository root")
    folder = Path(out or f"runs/bench-gpu-{time.strftime('%Y%m%d-%H%M%S')}")
    if dry_run:
        into = f", recording into {DOCS[Bench.GPU]}" if record_doc else ""
        print(
            f"dry run: would run bench gpu, parts {', '.join(chosen)}, into {folder}{into}; nothing started or written"
        )
        return 0
    body, passed = bench_gpu(folder, chosen)
    print(body, flush=True)
    if record_doc:
        record(Bench.GPU, command, body, DOCS[Bench.GPU])
    return 0 if passed else 1


# The config each benchmark runs when none is given (a packaged preset); those not named take none.
BENCH_PRESETS = {
    Bench.DDP: "default",
    Bench.PARALLEL: "default",
    **{b: "tiny" for b in (Bench.RECOVERY, Bench.CONTROL, Bench.CONTROL_NETNS, Bench.POLICIES, Bench.CONVERGENCE)},
    **{b: "tiny" for b in (Bench.SIMULATOR, Bench.SPARES, Bench.FAILSLOW, Bench.START)},
}
# The benchmarks that run the largest of ``--workers`` (``ddp`` runs each count; the others a fixed number).
LARGEST_WORKERS = (Bench.RECOVERY, Bench.LIBRARY, Bench.POLICIES, Bench.CONVERGENCE, Bench.PARALLEL)
LARGEST_WORKERS += (Bench.FAILSLOW, Bench.START)


def _dry_run_line(
    names: tuple[str, ...], config: str | None, worker_counts: list[int], repeats: int, overrides: list[str], doc: bool
) -> str:
    """``unbroken bench ... --dry-run``: each benchmark's config loaded with the overrides (a bad key or value is
    the run's one-line error), ``bench parallel``'s layout checked against its worker count, and one line."""
    described = []
    for name in names:
        bench, what = Bench(name), []
        if (preset := BENCH_PRESETS.get(bench)) is not None:
            if bench is Bench.PARALLEL:
                from unbroken.lab.bench_parallel import parallel_config

                cfg = parallel_config(config, max(worker_counts), overrides)
            else:  # bench start takes no config: only overrides of its preset
                source = config if config and bench is not Bench.START else str(preset_path(preset))
                cfg = load_config(source, overrides)
            label = config if config and bench is not Bench.START else preset
            what.append(f"{label}: model {cfg.model.hf_config or cfg.model.flavour}, M = {cfg.train.microbatches}")
        if bench is Bench.DDP:
            what.append(f"{' and '.join(str(w) for w in worker_counts)} workers")
        elif bench in LARGEST_WORKERS:
            what.append(f"{max(worker_counts)} workers")
        described.append(f"{name} ({'; '.join(what)})" if what else name)
    into = f", recording into {', '.join(sorted({str(DOCS.get(n, DOC)) for n in names}))}" if doc else ""
    return (
        f"dry run: would run bench {', '.join(described)}, {repeats} round{'s' * (repeats != 1)} each{into}; "
        "nothing started or written"
    )


def _main() -> None:
    rank_main("--ddp-rank", ddp_worker)


if __name__ == "__main__":
    _main()
