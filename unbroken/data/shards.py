"""The on-disk layout of prepared data: fixed-size token shards, their index, and the journal of a preparation.

Owns the files ``unbroken prepare`` writes in its output folder and what makes them crash-safe:

    tokenizer.json          the tokenizer, canonical JSON (its sha256 is the index's tokenizer fingerprint)
    shard-00000.bin         token ids, little-endian uint16 or uint32; every shard holds exactly
    shard-00001.bin ...     ``shard_tokens`` ids except the last
    shard-00000.docs ...    int64 little-endian: where each document ending in the shard ends (exclusive,
                            counted from the shard's first token); documents may run across shards
    progress.json           while preparing: the plan and every finished shard with its checksum and the
                            source position of the next token (deleted when the index is written)
    index.json              when done: dtype, vocabulary, end-of-text id, tokenizer fingerprint, and per
                            shard its files, token and document counts and sha256 checksums

A shard is written as ``*.tmp``, fsynced and renamed into place (sealed by ``core.atomic``), and only then
entered in the journal (itself replaced atomically), so after a crash the journal lists exactly the shards
that are complete; anything else is discarded by the next run. ``index.json`` appears last, atomically: a
folder with an index is a finished preparation. It knows nothing about sources or tokenizers.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from unbroken.core.atomic import SealedFile, fsync_dir, write_sealed

FORMAT = "unbroken-shards"
VERSION = 1
INDEX = "index.json"
JOURNAL = "progress.json"
TOKENIZER = "tokenizer.json"
DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens: 128 MiB of uint16
_HASH_BLOCK = 8 << 20


def tokens_name(k: int) -> str:
    return f"shard-{k:05d}.bin"


def docs_name(k: int) -> str:
    return f"shard-{k:05d}.docs"


@dataclass(frozen=True)
class ShardRecord:
    """One finished shard, as the journal and the index list it.

    Attributes:
        tokens: file name of the token ids.
        docs: file name of the document ends.
        num_tokens: ids in the shard.
        num_docs: documents that end in the shard.
        sha256: checksum of the token file.
        docs_sha256: checksum of the document-end file.
        cursor: the source position of the token after the shard, (unit, record, piece, token in piece);
            empty for the last shard.
    """

    tokens: str
    docs: str
    num_tokens: int
    num_docs: int
    sha256: str
    docs_sha256: str
    cursor: list[int] = field(default_factory=list)

    @staticmethod
    def from_json(d: dict[str, Any]) -> ShardRecord:
        return ShardRecord(
            str(d["tokens"]),
            str(d["docs"]),
            int(d["num_tokens"]),
            int(d["num_docs"]),
            str(d["sha256"]),
            str(d["docs_sha256"]),
            [int(x) for x in d.get("cursor", [])],
        )


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a reader (or a crash) sees the old file or the new one."""
    write_sealed(path, data, path.with_name(f"{path.name}.tmp-{os.getpid()}"))


def write_json_atomic(path: Path, obj: Any) -> None:
    write_atomic(path, (json.dumps(obj, indent=1) + "\n").encode())


def _sealed_shard(path: Path) -> SealedFile:
    """A shard file written as ``<name>.tmp`` (what a resumed preparation discards) until it is sealed."""
    return SealedFile(path, path.with_name(path.name + ".tmp"))


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


class ShardWriter:
    """Cuts a token stream into shards of exactly ``shard_tokens`` ids in ``out``.

    Args:
        out: the output folder.
        dtype: the id type.
        shard_tokens: ids per shard (the last may hold fewer).
        first_shard: the number of the next shard (shards before it are already finished).
        on_shard: called with each finished shard's record, after its files are in place.
    """

    def __init__(
        self,
        out: Path,
        dtype: np.dtype,
        shard_tokens: int,
        first_shard: int,
        on_shard: Callable[[ShardRecord], None],
    ) -> None:
        assert shard_tokens >= 1
        self.out = out
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shard_tokens = shard_tokens
        self.on_shard = on_shard
        self.shard = first_shard
        self.count = 0  # ids in the open shard
        self.num_docs = 0
        self._tokens: SealedFile | None = None
        self._docs: SealedFile | None = None
        self._hash = hashlib.sha256()
        self._docs_hash = hashlib.sha256()

    def _open(self) -> None:
        self._tokens = _sealed_shard(self.out / tokens_name(self.shard))
        self._docs = _sealed_shard(self.out / docs_name(self.shard))
        self._hash = hashlib.sha256()
        self._docs_hash = hashlib.sha256()
        self.count = 0
        self.num_docs = 0

    def write(
        self,
        tokens: np.ndarray,
        lengths: np.ndarray,
        ends_doc: Sequence[bool],
        positions: Sequence[tuple[int, int, int]],
    ) -> None:
        """Append the ids of consecutive pieces.

        Args:
            tokens: the ids of the pieces, concatenated.
            lengths: ids per piece.
            ends_doc: whether each piece ends a document (its last id is then an end-of-text id).
            positions: (unit, record, piece) of each piece, for the cursor of a shard that ends inside them.
        """
        piece_ends = np.cumsum(lengths)
        doc_ends = piece_ends[np.asarray(ends_doc, dtype=bool)]
        tokens = tokens.astype(self.dtype, copy=False)
        pos = 0
        while pos < len(tokens):
            if self._tokens is None:
                self._open()
            assert self._tokens is not None and self._docs is not None
            take = min(self.shard_tokens - self.count, len(tokens) - pos)
            chunk = tokens[pos : pos + take].tobytes()
            self._tokens.write(chunk)
            self._hash.update(chunk)
            lo, hi = np.searchsorted(doc_ends, [pos + 1, pos + take + 1])  # ends in (pos, pos + take]
            if hi > lo:
                ends = (doc_ends[lo:hi] - pos + self.count).astype("<i8").tobytes()
                self._docs.write(ends)
                self._docs_hash.update(ends)
                self.num_docs += int(hi - lo)
            self.count += take
            pos += take
            if self.count == self.shard_tokens:
                i = int(np.searchsorted(piece_ends, pos, side="right"))
                if i < len(piece_ends):
                    start = int(piece_ends[i - 1]) if i > 0 else 0
                    cursor = [*positions[i], pos - start]
                else:  # the shard ends with the last piece: resume after all of its ids
                    cursor = [*positions[-1], int(lengths[-1])]
                self._finish(cursor)

    def close(self) -> None:
        """Finish the last, partly filled shard (if any)."""
        if self._tokens is not None and self.count > 0:
            self._finish([])

    def abandon(self) -> None:
        """Close and delete the open shard's temporary files (a crash or an error; nothing is renamed)."""
        for f in (self._tokens, self._docs):
            if f is not None:
                f.discard()
        self._tokens = self._docs = None

    def _finish(self, cursor: list[int]) -> None:
        assert self._tokens is not None and self._docs is not None
        for f in (self._tokens, self._docs):
            f.seal(sync_dir=False)
        fsync_dir(self.out)
        record = ShardRecord(
            tokens_name(self.shard),
            docs_name(self.shard),
            self.count,
            self.num_docs,
            self._hash.hexdigest(),
            self._docs_hash.hexdigest(),
            cursor,
        )
        self._tokens = self._docs = None
        self.shard += 1
        self.on_shard(record)


# ---------------------------------------------------------------------------------------------------------
# The index


@dataclass(frozen=True)
class Index:
    """``index.json`` of a finished preparation."""

    dtype: str
    vocab_size: int
    eot_id: int
    tokenizer_sha256: str
    tokenizer_description: str
    shard_tokens: int
    num_tokens: int
    num_docs: int
    shards: list[ShardRecord]
    sources: list[str]
    plan: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["shards"] = [{k: v for k, v in asdict(s).items() if k != "cursor"} for s in self.shards]
        return {"format": FORMAT, "version": VERSION, **d}


def read_index(folder: Path) -> Index:
    """The index of a finished preparation in ``folder``.

    Raises:
        ValueError: the folder holds no index (an unfinished preparation says so), or an unreadable one.
    """
    path = folder / INDEX
    if not path.is_file():
        if (folder / JOURNAL).is_file():
            raise ValueError(
                f"prepared data {folder} is unfinished (a preparation stopped before its end); rerun the same "
                "`unbroken prepare` command to finish it"
            )
        raise ValueError(f"{folder} has no {INDEX}; it is not a folder written by `unbroken prepare`")
    try:
        d = json.loads(path.read_text())
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise ValueError(f"format {d.get('format')!r} version {d.get('version')!r}")
        return Index(
            str(d["dtype"]),
            int(d["vocab_size"]),
            int(d["eot_id"]),
            str(d["tokenizer_sha256"]),
            str(d.get("tokenizer_description", "")),
            int(d["shard_tokens"]),
            int(d["num_tokens"]),
            int(d["num_docs"]),
            [ShardRecord.from_json(s) for s in d["shards"]],
            [str(s) for s in d.get("sources", [])],
            dict(d.get("plan", {})),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path} is not a readable index of prepared data ({e}); it needs {FORMAT} version {VERSION}"
        ) from None


def check_shards(
    folder: Path, index: Index, checksums: bool, fix: str = "prepare the data again into a new folder"
) -> None:
    """Check every shard of ``index``: present, the size the index gives, and (``checksums``) its sha256.

    Raises:
        ValueError: one line naming the first shard that fails (and ``fix``).
    """
    itemsize = np.dtype(index.dtype).itemsize
    for s in index.shards:
        for name, size, digest in (
            (s.tokens, s.num_tokens * itemsize, s.sha256),
            (s.docs, s.num_docs * 8, s.docs_sha256),
        ):
            path = folder / name
            if not path.is_file():
                raise ValueError(f"prepared data {folder}: {name} is missing; {fix}")
            if path.stat().st_size != size:
                raise ValueError(
                    f"prepared data {folder}: {name} has {path.stat().st_size} bytes, {INDEX} says {size}; "
                    f"the file is damaged: {fix}"
                )
            if checksums:
                got = file_sha256(path)
                if got != digest:
                    raise ValueError(
                        f"prepared data {folder}: {name} fails its checksum (sha256 {got[:12]}, {INDEX} says "
                        f"{digest[:12]}); the file is damaged: {fix}"
                    )
