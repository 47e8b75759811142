"""``unbroken prepare``: tokenize a corpus once, in parallel, into shards the trainer memory-maps.

Owns the preparation as a whole: checking the inputs before anything is written, finding or training the
tokenizer, streaming pieces of text to one tokenizing process per core (in order, with a bounded number of
tasks in flight, so memory does not grow with the corpus), cutting the ids into fixed-size shards
(``shards``), resuming an interrupted preparation, and writing the final index atomically (or handing the
shards to ``export`` for a Megatron, nanoGPT or llm.c layout). Its command line is ``command``; it does not
read prepared data (``reader``).

    unbroken prepare corpus/*.jsonl.gz --tokenizer tokenizer.json --out data/corpus
    unbroken prepare books/ --train-tokenizer --vocab-size 32000 --sample-bytes 200M --out data/books
    unbroken prepare wiki.parquet --column body --tokenizer gpt2 --format megatron --out data/wiki
    python -m unbroken.data.command ...      (the same, without the ``unbroken`` command)

Crash safety: a rerun of the same command after a crash (even ``kill -9``) keeps every finished shard,
discards the shard being written, and continues from the source position recorded with the last finished
shard; the result is byte-identical to an uninterrupted run, and to a run with any ``--procs``. A rerun of a
finished preparation checks its checksums and does nothing else.

Bad input (a missing, empty or unreadable file, invalid UTF-8 unless ``--errors=replace``, a JSONL line
without the field, a parquet file without the column, a vocabulary too large for ``--dtype``, a damaged
shard) is a ``ValueError`` with a one-line message; files written by a preparation that fails on bad input
are removed.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from unbroken.core.atomic import fsync_dir
from unbroken.data.encode import EncodeError, Encoder, encode_in_worker, init_worker
from unbroken.data.export import LLMC_PATTERN, MANIFEST, MEGATRON_PREFIX, NANOGPT_FILE, check_export, export
from unbroken.data.progress import MODES, Progress
from unbroken.data.shards import (
    DEFAULT_SHARD_TOKENS,
    FORMAT,
    INDEX,
    JOURNAL,
    TOKENIZER,
    VERSION,
    Index,
    ShardRecord,
    ShardWriter,
    check_shards,
    docs_name,
    read_index,
    tokens_name,
    write_atomic,
    write_json_atomic,
)
from unbroken.data.sources import ERRORS, Piece, Unit, iter_pieces, resolve_sources, sample_texts
from unbroken.data.tokenizer import (
    ID_TYPES,
    TokenizerInfo,
    describe,
    id_dtype,
    load_tokenizer,
    read_tokenizer,
    train_bpe,
)

FORMATS = ("unbroken", "megatron", "nanogpt", "llmc")
TASK_CHARS = 1 << 20  # characters of text per tokenizing task
TASK_PIECES = 4096  # pieces per task at most
TASKS_PER_PROC = 4  # tasks in flight per tokenizing process
# Every file a preparation writes in its folder (removed again when it fails on bad input).
_OWNED = (
    TOKENIZER,
    INDEX,
    JOURNAL,
    MANIFEST,
    "shard-*.bin",
    "shard-*.docs",
    "shard-*.tmp",
    "*.tmp-*",
    ".*.tmp-*",
    ".bin-*",
    ".len-*",
    f"{MEGATRON_PREFIX}.bin",
    f"{MEGATRON_PREFIX}.idx",
    NANOGPT_FILE,
    LLMC_PATTERN,
)


@dataclass(frozen=True)
class PrepareOptions:
    """What ``unbroken prepare`` is asked to do (the command-line flags).

    Attributes:
        sources: files, folders, globs (see ``sources.resolve_sources``).
        out: the output folder.
        tokenizer: a tokenizer.json, its folder, or a Hugging Face name in the local cache.
        train_tokenizer: train a byte-level BPE on a sample of the sources instead.
        vocab_size: the trained BPE's vocabulary.
        sample_bytes: characters of text the BPE is trained on.
        field: the text field of JSONL lines.
        column: the text column of parquet files and datasets folders.
        procs: tokenizing processes; 0 = one per core.
        shard_tokens: ids per shard.
        dtype: ``auto`` (uint16 when the vocabulary fits), ``uint16`` or ``uint32``.
        format: ``unbroken`` (shards + index), ``megatron``, ``nanogpt`` or ``llmc``.
        errors: ``strict`` refuses invalid UTF-8; ``replace`` replaces it with U+FFFD.
        eot: the end-of-text token ("" = the first of ``tokenizer.EOT_CANDIDATES`` the tokenizer has).
        progress: ``auto``, ``bar``, ``lines`` or ``none``.
        progress_interval_s: seconds between plain progress lines.
        hf_cache_dir: the Hugging Face hub cache to look tokenizer names up in ("" = the environment's).
    """

    sources: tuple[str, ...]
    out: str
    tokenizer: str = ""
    train_tokenizer: bool = False
    vocab_size: int = 8192
    sample_bytes: int = 64 << 20
    field: str = "text"
    column: str = "text"
    procs: int = 0
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    dtype: str = "auto"
    format: str = "unbroken"
    errors: str = "strict"
    eot: str = ""
    progress: str = "auto"
    progress_interval_s: float = 10.0
    hf_cache_dir: str = ""


@dataclass(frozen=True)
class PrepareResult:
    """What a preparation produced."""

    out: Path
    num_tokens: int
    num_docs: int
    num_shards: int
    vocab_size: int
    dtype: str
    seconds: float
    tokens_per_s: float  # of this run (0 when nothing was left to do)
    resumed: bool = False
    already_done: bool = False
    files: list[str] = field(default_factory=list)


def default_procs() -> int:
    """One tokenizing process per core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _check_options(opts: PrepareOptions) -> None:
    if opts.train_tokenizer == bool(opts.tokenizer):
        raise ValueError("give exactly one of --tokenizer T and --train-tokenizer")
    if opts.procs < 0:
        raise ValueError(f"--procs = {opts.procs} must be >= 1 (or 0 for one per core)")
    if opts.shard_tokens < 1:
        raise ValueError(f"--shard-tokens = {opts.shard_tokens} must be >= 1")
    if opts.format not in FORMATS:
        raise ValueError(f"--format {opts.format} is not allowed; allowed: {', '.join(FORMATS)}")
    if opts.errors not in ERRORS:
        raise ValueError(f"--errors {opts.errors} is not allowed; allowed: {', '.join(ERRORS)}")
    if opts.dtype not in ID_TYPES:
        raise ValueError(f"--dtype {opts.dtype} is not allowed; allowed: {', '.join(ID_TYPES)}")
    if opts.progress not in MODES:
        raise ValueError(f"--progress {opts.progress} is not allowed; allowed: {', '.join(MODES)}")
    if opts.train_tokenizer and opts.sample_bytes < 1:
        raise ValueError(f"--sample-bytes = {opts.sample_bytes} must be >= 1")


# ---------------------------------------------------------------------------------------------------------
# What is already in the output folder


def _existing(out: Path) -> tuple[str, dict[str, Any] | None]:
    """("none" | "journal" | "done", the recorded journal or final record)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder (new or empty)")
    if not out.exists():
        return "none", None
    for name, state in ((INDEX, "done"), (MANIFEST, "done"), (JOURNAL, "journal")):
        if (out / name).is_file():
            try:
                record = json.loads((out / name).read_text())
                assert isinstance(record, dict) and isinstance(record.get("plan"), dict)
            except (ValueError, AssertionError):
                raise ValueError(f"{out / name} is damaged; delete {out} and prepare again") from None
            return state, record
    if any(out.iterdir()):
        raise ValueError(f"--out {out} exists, is not empty and holds no preparation; give a new or empty folder")
    return "none", None


def _plan(opts: PrepareOptions, units: list[Unit], info: TokenizerInfo, dtype: np.dtype) -> dict[str, Any]:
    """Everything the output depends on (so a rerun can tell whether it continues the same preparation)."""
    tokenizer: dict[str, Any] = (
        {"train": [opts.vocab_size, opts.sample_bytes]} if opts.train_tokenizer else {"sha256": info.sha256}
    )
    return {
        "sources": [u.identity() for u in units],
        "field": opts.field,
        "column": opts.column,
        "errors": opts.errors,
        "tokenizer": tokenizer,
        "eot_id": info.eot_id,
        "dtype": dtype.name,
        "shard_tokens": opts.shard_tokens,
        "format": opts.format,
    }


def _differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    return ", ".join(keys) or "nothing"


def _tokenizer(opts: PrepareOptions, units: list[Unit], out: Path, recorded: dict[str, Any] | None) -> TokenizerInfo:
    if not opts.train_tokenizer:
        return load_tokenizer(opts.tokenizer, opts.eot, opts.hf_cache_dir or None)
    spec = [opts.vocab_size, opts.sample_bytes]
    if recorded is not None and recorded["plan"].get("tokenizer") == {"train": spec} and (out / TOKENIZER).is_file():
        # The tokenizer this preparation trained before it was interrupted (or finished): reuse it.
        return describe(read_tokenizer(out / TOKENIZER), opts.eot, f"BPE trained by this preparation ({out})")
    sample = sample_texts(units, opts.sample_bytes, opts.field, opts.column, opts.errors)
    tokenizer = train_bpe(sample, opts.vocab_size)
    desc = f"byte-level BPE of {opts.vocab_size} trained on {opts.sample_bytes:,} characters of the sources"
    return describe(tokenizer, opts.eot, desc)


# ---------------------------------------------------------------------------------------------------------
# The preparation


def prepare(opts: PrepareOptions) -> PrepareResult:
    """Prepare ``opts.sources`` into ``opts.out`` (or continue, or confirm, an earlier preparation there).

    Raises:
        ValueError: bad options or bad input (one line); see the module docstring.
    """
    start = time.perf_counter()
    _check_options(opts)
    units = resolve_sources(opts.sources, opts.column)
    out = Path(opts.out).expanduser()
    state, recorded = _existing(out)
    info = _tokenizer(opts, units, out, recorded)
    dtype = id_dtype(info.vocab_size, opts.dtype)
    if opts.format == "nanogpt" and dtype != np.uint16:
        raise ValueError(
            f"--format nanogpt holds uint16 ids but the vocabulary has {info.vocab_size}; use --format megatron or llmc"
        )
    plan = _plan(opts, units, info, dtype)
    if state == "done":
        assert recorded is not None
        if recorded["plan"] != plan:
            raise ValueError(
                f"--out {out} already holds prepared data of other inputs or settings (they differ in: "
                f"{_differences(recorded['plan'], plan)}); give another --out or delete {out}"
            )
        return _already_done(out, recorded, start)
    if state == "journal":
        assert recorded is not None
        if recorded["plan"] != plan:
            raise ValueError(
                f"--out {out} holds an unfinished preparation of other inputs or settings (they differ in: "
                f"{_differences(recorded['plan'], plan)}); rerun that command to finish it, or delete {out}"
            )
    created = not out.exists()
    shards: list[ShardRecord] = []
    if state == "journal":
        assert recorded is not None
        shards = [ShardRecord.from_json(s) for s in recorded["shards"]]
        _check_listed(out, shards, dtype)
        _discard_unlisted(out, len(shards))
    else:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / TOKENIZER, info.json.encode())
        _write_journal(out, plan, shards)
    resumed = bool(shards)
    try:
        procs = opts.procs or default_procs()
        rate = 0.0
        if not (shards and not shards[-1].cursor):  # the last shard has no cursor once every id is written
            rate = _stream(opts, units, info, dtype, out, plan, shards, procs)
        files = _finish(opts, out, info, dtype, plan, shards, units)
    except ValueError:
        _remove_ours(out, created)  # bad input: a preparation that can never finish leaves nothing behind
        raise
    return PrepareResult(
        out,
        sum(s.num_tokens for s in shards),
        sum(s.num_docs for s in shards),
        len(shards),
        info.vocab_size,
        dtype.name,
        time.perf_counter() - start,
        rate,
        resumed=resumed,
        files=files,
    )


def _write_journal(out: Path, plan: dict[str, Any], shards: list[ShardRecord]) -> None:
    write_json_atomic(
        out / JOURNAL, {"format": FORMAT, "version": VERSION, "plan": plan, "shards": [asdict(s) for s in shards]}
    )


def _check_listed(out: Path, shards: list[ShardRecord], dtype: np.dtype) -> None:
    probe = Index(dtype.name, 0, 0, "", "", 0, 0, 0, shards, [], {})
    check_shards(out, probe, checksums=True, fix=f"delete {out} and prepare again")


def _discard_unlisted(out: Path, num_listed: int) -> None:
    """Remove what a crash left: temporary files and shards finished after the journal's last entry."""
    for pattern in ("shard-*.tmp", "*.tmp-*", ".*.tmp-*", ".bin-*", ".len-*"):
        for p in out.glob(pattern):
            p.unlink(missing_ok=True)
    listed = {name for k in range(num_listed) for name in (tokens_name(k), docs_name(k))}
    for pattern in ("shard-*.bin", "shard-*.docs"):
        for p in out.glob(pattern):
            if p.name not in listed:
                p.unlink(missing_ok=True)


def _remove_ours(out: Path, created: bool) -> None:
    if not out.is_dir():
        return
    for pattern in _OWNED:
        for p in out.glob(pattern):
            if p.is_file():
                p.unlink(missing_ok=True)
    if created or not any(out.iterdir()):
        try:
            out.rmdir()
        except OSError:
            pass  # something else is in it: leave it


@dataclass
class _Task:
    texts: list[str] = field(default_factory=list)
    ends: list[bool] = field(default_factory=list)
    positions: list[tuple[int, int, int]] = field(default_factory=list)
    docs: int = 0
    unit: int = 0
    done_bytes: int = 0


def _tasks(pieces: Iterator[Piece]) -> Iterator[_Task]:
    task, chars = _Task(), 0
    for piece in pieces:
        task.texts.append(piece.text)
        task.ends.append(piece.ends_doc)
        task.positions.append((piece.unit, piece.record, piece.piece))
        task.docs += piece.ends_doc
        task.unit, task.done_bytes = piece.unit, piece.done_bytes
        chars += len(piece.text)
        if chars >= TASK_CHARS or len(task.texts) >= TASK_PIECES:
            yield task
            task, chars = _Task(), 0
    if task.texts:
        yield task


def _encoded(
    tasks: Iterator[_Task], procs: int, info: TokenizerInfo, dtype: np.dtype, errors: str, units: list[Unit]
) -> Iterator[tuple[_Task, tuple[np.ndarray, np.ndarray]]]:
    """Each task with its (ids, lengths), in order; ``procs`` processes tokenize, at most
    ``TASKS_PER_PROC * procs`` tasks are in flight."""
    if procs == 1:
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # --procs 1 means one core: no thread pool either
        try:
            encoder = Encoder(info.tokenizer, info.eot_id, dtype, errors)
            for task in tasks:
                try:
                    yield task, encoder.encode(task.texts, task.ends)
                except EncodeError as e:
                    raise _encode_error(task, e, units) from None
        finally:
            if saved is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved
        return
    pool = ProcessPoolExecutor(
        procs,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=init_worker,
        initargs=(info.json, info.eot_id, dtype.str, errors),
    )
    pending: deque[tuple[_Task, Future[tuple[np.ndarray, np.ndarray]]]] = deque()
    try:
        for task in tasks:
            pending.append((task, pool.submit(encode_in_worker, task.texts, task.ends)))
            while len(pending) >= TASKS_PER_PROC * procs:
                yield _result(*pending.popleft(), units)
        while pending:
            yield _result(*pending.popleft(), units)
    finally:
        for _, future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


def _result(
    task: _Task, future: Future[tuple[np.ndarray, np.ndarray]], units: list[Unit]
) -> tuple[_Task, tuple[np.ndarray, np.ndarray]]:
    try:
        return task, future.result()
    except EncodeError as e:
        raise _encode_error(task, e, units) from None


def _encode_error(task: _Task, e: EncodeError, units: list[Unit]) -> ValueError:
    unit, record, _ = task.positions[e.index]
    where = units[unit].describe()
    line = f"line {record + 1}" if units[unit].kind == "jsonl" else f"record {record}"
    return ValueError(
        f"SRC {where} {line} cannot be tokenized ({e.reason}); fix it, or pass --errors=replace to replace "
        "the characters the tokenizer refuses"
    )


def _stream(
    opts: PrepareOptions,
    units: list[Unit],
    info: TokenizerInfo,
    dtype: np.dtype,
    out: Path,
    plan: dict[str, Any],
    shards: list[ShardRecord],
    procs: int,
) -> float:
    """Tokenize from the last finished shard's cursor to the end; returns this run's tokens per second."""

    def on_shard(record: ShardRecord) -> None:
        shards.append(record)
        _write_journal(out, plan, shards)

    unit_starts = np.cumsum([0] + [u.size for u in units])
    u, r, p, skip = shards[-1].cursor if shards else (0, 0, 0, 0)
    docs = sum(s.num_docs for s in shards)
    tokens_done = sum(s.num_tokens for s in shards)
    writer = ShardWriter(out, dtype, opts.shard_tokens, len(shards), on_shard)
    pieces = iter_pieces(units, opts.field, opts.column, opts.errors, start=(u, r, p))
    encoded = _encoded(_tasks(pieces), procs, info, dtype, opts.errors, units)
    progress = Progress(int(unit_starts[-1]), opts.progress, opts.progress_interval_s)
    try:
        with progress:
            progress.update(docs, tokens_done, int(unit_starts[u]))
            for task, (ids, lengths) in encoded:
                if skip:  # the first piece began in the last finished shard: drop the ids it already holds
                    ids, lengths = ids[skip:], lengths.copy()
                    lengths[0] -= skip
                    skip = 0
                writer.write(ids, lengths, task.ends, task.positions)
                docs += task.docs
                tokens_done += len(ids)
                progress.update(docs, tokens_done, int(unit_starts[task.unit]) + task.done_bytes)
            writer.close()
        return progress.rate()
    except BaseException:
        writer.abandon()
        encoded.close()  # stops the tokenizing processes now, not when the traceback is collected
        raise


# ---------------------------------------------------------------------------------------------------------
# Finishing: the index, or an export


def _finish(
    opts: PrepareOptions,
    out: Path,
    info: TokenizerInfo,
    dtype: np.dtype,
    plan: dict[str, Any],
    shards: list[ShardRecord],
    units: list[Unit],
) -> list[str]:
    index = Index(
        dtype.name,
        info.vocab_size,
        info.eot_id,
        info.sha256,
        info.description,
        opts.shard_tokens,
        sum(s.num_tokens for s in shards),
        sum(s.num_docs for s in shards),
        shards,
        [u.describe() for u in units],
        plan,
    )
    if opts.format == "unbroken":
        write_json_atomic(out / INDEX, index.to_json())
        (out / JOURNAL).unlink(missing_ok=True)
        fsync_dir(out)
        return [INDEX, TOKENIZER] + [name for s in shards for name in (s.tokens, s.docs)]
    return [*export(opts.format, out, index), TOKENIZER]


def _already_done(out: Path, recorded: dict[str, Any], start: float) -> PrepareResult:
    """A rerun of a finished preparation: check it (sizes and checksums) and report it."""
    if (out / INDEX).is_file():
        index = read_index(out)
        check_shards(out, index, checksums=True, fix=f"delete {out} and prepare again")
        files = [INDEX, TOKENIZER] + [name for s in index.shards for name in (s.tokens, s.docs)]
        return PrepareResult(
            out,
            index.num_tokens,
            index.num_docs,
            len(index.shards),
            index.vocab_size,
            index.dtype,
            time.perf_counter() - start,
            0.0,
            already_done=True,
            files=files,
        )
    files = check_export(out, recorded)
    return PrepareResult(
        out,
        int(recorded["num_tokens"]),
        int(recorded["num_docs"]),
        0,
        int(recorded["vocab_size"]),
        str(recorded["dtype"]),
        time.perf_counter() - start,
        0.0,
        already_done=True,
        files=[*files, TOKENIZER],
    )
