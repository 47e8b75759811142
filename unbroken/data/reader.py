"""Opening prepared data for training: our shards, Megatron-LM / NeMo, nanoGPT or llm.c files, read in place.

Owns recognising what a ``data.source`` path holds (``detect_format``), checking it (sizes always;
checksums and the tokenizer on request), and the train/validation split, into a ``PreparedCorpus`` of two
``TokenStream`` views. Nothing is read into memory: the ids stay in the files and a process reads (or, with
``access="mmap"``, maps) only the windows its samples need, so several hosts each read only what their
microbatches need.

The split: where the source has its own validation files (nanoGPT ``val.bin``, llm.c ``*_val_*.bin``) they
are the validation split. Otherwise the validation split is the tail of the corpus, from the first document
boundary at or after ``(1 - val_fraction)`` of the ids (a boundary from the index, or, in a flat file whose
end-of-text id is known, the position after an end-of-text id; failing both, that exact position). Train and
validation windows are cut from their own side of the split, so no sample straddles it. It knows nothing
about sampling (``sampler``) or how the files were written (``shards``, ``formats``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from unbroken.data import formats
from unbroken.data.shards import INDEX, JOURNAL, TOKENIZER, check_shards, file_sha256, read_index
from unbroken.data.stream import Segment, TokenStream

logger = logging.getLogger(__name__)

FORMATS = ("auto", "unbroken", "megatron", "nanogpt", "llmc")
_SCAN_BLOCK = 1 << 22  # ids read at a time when scanning a flat file (largest id, next end-of-text)


@dataclass(frozen=True, eq=False)
class PreparedCorpus:
    """Prepared data, split, read in place.

    Attributes:
        train: the training ids.
        val: the validation ids.
        vocab_size: every id is below it.
        eot_id: the end-of-text id (None when unknown: a foreign file without a tokenizer).
        tokenizer_path: the tokenizer the data was made with (None when unknown).
        tokenizer_sha256: sha256 of that file (None when unknown).
        format: ``unbroken``, ``megatron``, ``nanogpt`` or ``llmc``; ``text`` for the text cache of ``unbroken
            train`` (opened by ``textcache``, not here).
        description: what it is, for logs.

    Pickling sends file names and offsets; the other side opens the files again.
    """

    train: TokenStream
    val: TokenStream
    vocab_size: int
    eot_id: int | None
    tokenizer_path: Path | None
    tokenizer_sha256: str | None
    format: str
    description: str


def detect_format(source: str | Path) -> str | None:
    """``unbroken``, ``megatron``, ``nanogpt`` or ``llmc`` when ``source`` holds prepared data; else None.

    Recognised: a folder with ``index.json`` (or an unfinished ``progress.json``); a folder, prefix, ``.idx``
    or ``.bin`` of a Megatron indexed dataset; a folder with nanoGPT's ``train.bin``; a folder or ``.bin``
    file with llm.c's header; any other ``.bin`` file is read as nanoGPT's flat uint16.
    """
    p = Path(source).expanduser()
    if p.is_dir():
        if (p / INDEX).is_file() or (p / JOURNAL).is_file():
            return "unbroken"
        if _megatron_prefixes(p):
            return "megatron"
        if (p / "train.bin").is_file() and not formats.is_llmc(p / "train.bin"):
            return "nanogpt"
        if any(formats.is_llmc(b) for b in sorted(p.glob("*.bin"))):
            return "llmc"
        return None
    if _is_megatron_prefix(_strip(p)):
        return "megatron"
    if p.is_file() and p.suffix == ".bin":
        return "llmc" if formats.is_llmc(p) else "nanogpt"
    return None


def _strip(p: Path) -> Path:
    return p.with_suffix("") if p.suffix in (".bin", ".idx") else p


def _is_megatron_prefix(prefix: Path) -> bool:
    idx = Path(f"{prefix}.idx")
    if not (idx.is_file() and Path(f"{prefix}.bin").is_file()):
        return False
    with open(idx, "rb") as f:
        return f.read(len(formats.MEGATRON_MAGIC)) == formats.MEGATRON_MAGIC


def _megatron_prefixes(folder: Path) -> list[Path]:
    return [prefix for prefix in (_strip(i) for i in sorted(folder.glob("*.idx"))) if _is_megatron_prefix(prefix)]


# ---------------------------------------------------------------------------------------------------------
# Opening


def open_prepared(
    source: str | Path,
    val_fraction: float = 0.05,
    tokenizer: str = "",
    fmt: str = "auto",
    verify: bool = False,
    hf_cache_dir: str | None = None,
    access: str = "pread",
) -> PreparedCorpus:
    """Open prepared data at ``source``, split it, and check it.

    Args:
        source: a folder (or file, or Megatron prefix) ``detect_format`` recognises.
        val_fraction: share of the ids held out for validation where the source has no validation files.
        tokenizer: "" uses the tokenizer stored with the data; a tokenizer.json / folder / cached Hugging Face
            name must be the one the data was made with (for foreign files without one, it gives the
            vocabulary and end-of-text id).
        fmt: ``auto`` or one of the formats, to skip detection.
        verify: also compare every file's sha256 with the index (reads the whole corpus once; do it in one
            process before training, not in every worker). Sizes are always checked.
        hf_cache_dir: the Hugging Face hub cache for tokenizer names.
        access: how the ids are read, ``pread`` (the default) or ``mmap`` (see ``stream``).

    Raises:
        ValueError: not prepared data, unfinished, damaged (size or checksum), a different tokenizer, or a
            split with an empty side.
    """
    if fmt not in FORMATS:
        raise ValueError(f"data format {fmt!r} is not allowed; allowed: {', '.join(FORMATS)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction = {val_fraction} must be in (0, 1)")
    path = Path(source).expanduser()
    found = detect_format(path) if fmt == "auto" else fmt
    if found is None:
        raise ValueError(
            f"data source {path} holds no prepared data (allowed: a folder written by `unbroken prepare`, a "
            "Megatron .bin/.idx prefix, a nanoGPT train.bin, llm.c .bin files)"
        )
    if found == "unbroken":
        return _open_unbroken(path, val_fraction, tokenizer, verify, hf_cache_dir, access)
    return _open_foreign(path, found, val_fraction, tokenizer, verify, hf_cache_dir, access)


def _user_tokenizer(spec: str, hf_cache_dir: str | None) -> tuple[Path, str, int, int | None]:
    """(file, sha256 of its canonical JSON, vocabulary size, end-of-text id or None)."""
    from unbroken.data.tokenizer import describe, find_tokenizer_file, fingerprint, read_tokenizer, vocab_size_of

    path, description = find_tokenizer_file(spec, hf_cache_dir)
    tok = read_tokenizer(path)
    try:
        info = describe(tok, "", description)
        return path, info.sha256, info.vocab_size, info.eot_id
    except ValueError:  # no end-of-text token: fine for reading
        return path, fingerprint(tok.to_str()), vocab_size_of(tok), None


def _open_unbroken(
    folder: Path, val_fraction: float, tokenizer: str, verify: bool, hf_cache_dir: str | None, access: str
) -> PreparedCorpus:
    index = read_index(folder)
    check_shards(folder, index, checksums=verify)
    stored = folder / TOKENIZER
    if verify and (not stored.is_file() or file_sha256(stored) != index.tokenizer_sha256):
        raise ValueError(
            f"prepared data {folder}: {TOKENIZER} is missing or is not the tokenizer {INDEX} names "
            f"(sha256 {index.tokenizer_sha256[:12]}); prepare the data again into a new folder"
        )
    if tokenizer:
        path, sha, _, _ = _user_tokenizer(tokenizer, hf_cache_dir)
        if sha != index.tokenizer_sha256:
            raise ValueError(
                f"tokenizer {path} (sha256 {sha[:12]}) is not the one the data in {folder} was prepared with "
                f"(sha256 {index.tokenizer_sha256[:12]}); leave the tokenizer unset to use {stored}, or prepare "
                "the data again with this tokenizer"
            )
    dtype = np.dtype(index.dtype).newbyteorder("<").str
    segments = [Segment(str(folder / s.tokens), dtype, 0, s.num_tokens) for s in index.shards]
    stream = TokenStream(segments, access=access)
    shard_starts = np.cumsum([0] + [s.num_tokens for s in index.shards])

    def boundary(pos: int) -> int | None:
        """The first document end >= pos."""
        k = max(0, int(np.searchsorted(shard_starts, pos, side="right")) - 1)
        for j in range(k, len(index.shards)):
            s = index.shards[j]
            if s.num_docs == 0:
                continue
            ends = np.memmap(folder / s.docs, dtype="<i8", mode="r", shape=(s.num_docs,))
            i = int(np.searchsorted(ends, pos - int(shard_starts[j])))
            if i < len(ends):
                return int(shard_starts[j]) + int(ends[i])
        return None

    train, val = _split(stream, val_fraction, boundary, folder)
    desc = f"prepared data {folder} ({index.num_tokens:,} ids, {index.num_docs:,} documents, {len(segments)} shards)"
    return PreparedCorpus(
        train,
        val,
        index.vocab_size,
        index.eot_id,
        stored if stored.is_file() else None,
        index.tokenizer_sha256,
        "unbroken",
        desc,
    )


def _split(
    stream: TokenStream, val_fraction: float, boundary: Callable[[int], int | None], where: Path
) -> tuple[TokenStream, TokenStream]:
    n = len(stream)
    target = math.ceil((1.0 - val_fraction) * n)
    cut = boundary(target)
    if cut is None or cut >= n:
        cut = target
        logger.warning(
            "%s: no document boundary after %.1f%% of the ids; the validation split starts mid-document",
            where,
            100 * (1 - val_fraction),
        )
    if not 0 < cut < n:
        raise ValueError(f"data source {where} has {n} ids: too few to split off val_fraction = {val_fraction}")
    return stream.view(0, cut), stream.view(cut, n)


def _open_foreign(
    path: Path,
    fmt: str,
    val_fraction: float,
    tokenizer: str,
    verify: bool,
    hf_cache_dir: str | None,
    access: str,
) -> PreparedCorpus:
    folder = path if path.is_dir() else path.parent
    val_segments: list[Segment] = []
    megatron: list[tuple[formats.MegatronIndex, int]] = []  # (index, first id) per prefix
    if fmt == "megatron":
        prefixes = _megatron_prefixes(path) if path.is_dir() else [_strip(path)]
        if not prefixes:
            raise ValueError(f"data source {path} holds no Megatron .bin/.idx pair")
        segments = []
        first = 0
        for prefix in prefixes:
            index = formats.read_megatron_index(Path(f"{prefix}.idx"))
            segments.append(formats.megatron_segment(prefix, index))
            megatron.append((index, first))
            first += segments[-1].length
    elif fmt == "nanogpt":
        train_file = path / "train.bin" if path.is_dir() else path
        segments = [formats.nanogpt_segment(train_file)]
        if path.is_dir() and (path / "val.bin").is_file():
            val_segments = [formats.nanogpt_segment(path / "val.bin")]
    else:
        assert fmt == "llmc", fmt
        files = [b for b in sorted(path.glob("*.bin")) if formats.is_llmc(b)] if path.is_dir() else [path]
        val_files = [f for f in files if "_val" in f.name]
        segments = [formats.llmc_segment(f) for f in files if f not in val_files]
        val_segments = [formats.llmc_segment(f) for f in val_files]
        if not segments:
            raise ValueError(f"data source {path} has llm.c validation files only (*_val*.bin), no training files")
    dtypes = {s.dtype for s in segments + val_segments}
    if len(dtypes) > 1:
        raise ValueError(f"data source {path} mixes id types {sorted(dtypes)}; every file must hold the same type")

    # The tokenizer: given, or stored beside the files by `unbroken prepare --format ...`, or unknown.
    tok_path: Path | None = None
    eot: int | None = None
    vocab = 0
    if tokenizer:
        tok_path, sha, vocab, eot = _user_tokenizer(tokenizer, hf_cache_dir)
        stored = folder / TOKENIZER
        if stored.is_file():
            _, stored_sha, _, _ = _user_tokenizer(str(stored), None)
            if stored_sha != sha:
                raise ValueError(
                    f"tokenizer {tok_path} (sha256 {sha[:12]}) is not the one stored with the data in {folder} "
                    f"(sha256 {stored_sha[:12]}); leave the tokenizer unset to use it, or prepare the data again"
                )
    elif (folder / TOKENIZER).is_file():
        tok_path, sha, vocab, eot = _user_tokenizer(str(folder / TOKENIZER), None)
    if verify or not vocab:
        largest = max(_largest_id(TokenStream([s])) for s in segments + val_segments)
        if vocab and largest >= vocab:
            raise ValueError(
                f"data source {path} has id {largest}, beyond the tokenizer's vocabulary of {vocab}; "
                "it was not made with this tokenizer"
            )
        if not vocab:
            vocab = largest + 1
            logger.warning(
                "%s: no tokenizer given or stored; the vocabulary is taken as the largest id + 1 = %d", path, vocab
            )
    stream = TokenStream(segments, access=access)
    if val_segments:
        train, val = stream, TokenStream(val_segments, access=access)
    else:
        boundary = _megatron_boundary(megatron) if megatron else _eot_boundary(stream, eot)
        train, val = _split(stream, val_fraction, boundary, path)
    desc = f"{fmt} data {path} ({len(train) + len(val):,} ids)"
    file_sha = file_sha256(tok_path) if tok_path is not None else None
    return PreparedCorpus(train, val, vocab, eot, tok_path, file_sha, fmt, desc)


def _largest_id(stream: TokenStream) -> int:
    largest = -1
    for lo in range(0, len(stream), _SCAN_BLOCK):
        block = stream.read(lo, min(_SCAN_BLOCK, len(stream) - lo))
        largest = max(largest, int(block.max()))
    stream.close()
    return largest


def _eot_boundary(stream: TokenStream, eot: int | None) -> Callable[[int], int | None]:
    def boundary(pos: int) -> int | None:
        if eot is None:
            return None
        for lo in range(pos, len(stream), _SCAN_BLOCK):
            block = stream.read(lo, min(_SCAN_BLOCK, len(stream) - lo))
            hits = np.flatnonzero(block == eot)
            if len(hits):
                return lo + int(hits[0]) + 1
        return None

    return boundary


def _megatron_boundary(parts: list[tuple[formats.MegatronIndex, int]]) -> Callable[[int], int | None]:
    def boundary(pos: int) -> int | None:
        for index, first in parts:
            num_docs = len(index.doc_indices) - 1  # doc_indices[k] is where document k begins; the last, the end
            lo, hi = 1, num_docs + 1  # the end of document k - 1 is the start of document k
            while lo < hi:
                mid = (lo + hi) // 2
                if first + formats.megatron_doc_start(index, mid) >= pos:
                    hi = mid
                else:
                    lo = mid + 1
            if lo <= num_docs:
                return first + formats.megatron_doc_start(index, lo)
        return None

    return boundary
