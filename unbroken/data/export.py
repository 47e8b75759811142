"""Exporting a finished preparation to the layout another trainer reads: Megatron-LM / NeMo, nanoGPT, llm.c.

Owns turning the shards of ``unbroken prepare`` into ``OUT/text_document.bin`` + ``.idx`` (Megatron, one
sequence per document), ``OUT/train.bin`` (nanoGPT) or ``OUT/data_train_NNNNNN.bin`` (llm.c, one file per
shard), recording their checksums in ``OUT/prepare.json`` (those files carry no tokenizer fingerprint), and
checking such a folder on a rerun. The shards are read back in blocks, never whole; they are removed once
the manifest is written, so an export interrupted before that point is simply done again. The byte layouts
belong to ``formats``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from unbroken.core.atomic import fsync_dir
from unbroken.data.formats import write_llmc, write_megatron, write_nanogpt
from unbroken.data.shards import JOURNAL, Index, ShardRecord, file_sha256, write_json_atomic

MANIFEST = "prepare.json"
MEGATRON_PREFIX = "text_document"
NANOGPT_FILE = "train.bin"
LLMC_PATTERN = "data_train_*.bin"


def export(fmt: str, out: Path, index: Index) -> list[str]:
    """Write ``index``'s shards in layout ``fmt``, then the manifest, then remove the shards; returns the
    files written (manifest first)."""
    files = _write(fmt, out, index)
    manifest = {
        "format": fmt,
        "plan": index.plan,
        "files": {name: file_sha256(out / name) for name in files},
        "dtype": index.dtype,
        "vocab_size": index.vocab_size,
        "eot_id": index.eot_id,
        "tokenizer_sha256": index.tokenizer_sha256,
        "num_tokens": index.num_tokens,
        "num_docs": index.num_docs,
    }
    write_json_atomic(out / MANIFEST, manifest)
    remove_shards(out)
    return [MANIFEST, *files]


def check_export(out: Path, manifest: dict[str, Any]) -> list[str]:
    """Check a finished export against its manifest; returns its files.

    Raises:
        ValueError: a file is missing or fails its checksum (one line).
    """
    for name, digest in manifest["files"].items():
        path = out / name
        if not path.is_file() or file_sha256(path) != digest:
            raise ValueError(
                f"prepared data {out}: {name} is missing or fails its checksum ({MANIFEST} says sha256 "
                f"{digest[:12]}); the file is damaged: delete {out} and prepare again"
            )
    remove_shards(out)  # an export interrupted after its manifest
    return [MANIFEST, *manifest["files"]]


def remove_shards(out: Path) -> None:
    """Remove the shards and the journal of a preparation (after an export)."""
    for pattern in ("shard-*.bin", "shard-*.docs", JOURNAL):
        for p in out.glob(pattern):
            p.unlink(missing_ok=True)
    fsync_dir(out)


def _shard_chunks(
    out: Path, shards: list[ShardRecord], dtype: np.dtype, block: int = 1 << 22
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, document ends within the ids) of ``shards``, in blocks of at most ``block`` ids."""
    for s in shards:
        if s.num_tokens == 0:
            continue
        ids = np.memmap(out / s.tokens, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
        ends = np.fromfile(out / s.docs, dtype="<i8") if s.num_docs else np.zeros(0, np.int64)
        for lo in range(0, s.num_tokens, block):
            hi = min(s.num_tokens, lo + block)
            a, b = np.searchsorted(ends, [lo + 1, hi + 1])
            yield np.array(ids[lo:hi]), ends[a:b] - lo
        del ids


def _write(fmt: str, out: Path, index: Index) -> list[str]:
    dtype = np.dtype(index.dtype)
    if fmt == "megatron":
        write_megatron(out / MEGATRON_PREFIX, _shard_chunks(out, index.shards, dtype), dtype)
        return [f"{MEGATRON_PREFIX}.bin", f"{MEGATRON_PREFIX}.idx"]
    if fmt == "nanogpt":
        write_nanogpt(out / NANOGPT_FILE, (ids for ids, _ in _shard_chunks(out, index.shards, dtype)), index.vocab_size)
        return [NANOGPT_FILE]
    assert fmt == "llmc", fmt
    names = []
    for k, s in enumerate(index.shards):  # one llm.c file per shard, as llm.c's own data scripts write them
        name = f"data_train_{k:06d}.bin"
        write_llmc(out / name, (ids for ids, _ in _shard_chunks(out, [s], dtype)), s.num_tokens, dtype)
        names.append(name)
    return names
