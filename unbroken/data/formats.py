"""Interchange formats of tokenized corpora: Megatron-LM / NeMo indexed datasets, nanoGPT and llm.c ``.bin``.

Owns reading and writing the three layouts other trainers use, byte for byte as documented by their own
code (no code of theirs is used or needed):

- Megatron-LM / NeMo ``MMapIndexedDataset``: ``PREFIX.bin`` holds the ids of every sequence back to back;
  ``PREFIX.idx`` is the 9-byte magic ``MMIDIDX\\x00\\x00``, a little-endian uint64 version (1), a uint8 dtype
  code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), a uint64 sequence
  count S, a uint64 document-index count D, then S int32 sequence lengths, S int64 byte offsets of the
  sequences in ``.bin``, and D int64 sequence indices where documents end (the first is 0). We write one
  sequence per document, so the document index is 0, 1, ..., S.
- nanoGPT: a flat file of uint16 ids (``train.bin``, ``val.bin``), no header.
- llm.c: a header of 256 little-endian int32 (magic 20240520, version 1 for uint16 ids; magic 20240801,
  version 7 for uint32 ids; then the number of ids), then the ids.

Readers return ``Segment``s (and, for Megatron, document ends) for the memory-mapped ``TokenStream``;
writers stream chunks of ids to disk through sealed files (``core.atomic``: a temporary file renamed into
place), holding no corpus in memory. Which files make up a dataset, and the train/validation split, belong
to ``reader``.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from unbroken.core.atomic import SealedFile, sealed
from unbroken.data.stream import Segment

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_VERSION = 1
MEGATRON_DTYPES = {1: "u1", 2: "i1", 3: "i2", 4: "i4", 5: "i8", 6: "f8", 7: "f4", 8: "u2"}
_MEGATRON_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
LLMC_HEADER_INTS = 256
LLMC_KINDS = {20240520: (1, "u2"), 20240801: (7, "u4")}  # magic: (version, id type)
_BLOCK = 1 << 22  # ids (or index entries) copied at a time


@dataclass(frozen=True)
class MegatronIndex:
    """The arrays of a Megatron ``.idx`` file (memory-mapped)."""

    dtype: np.dtype
    lengths: np.ndarray  # int32 [S]
    pointers: np.ndarray  # int64 [S], byte offsets into .bin
    doc_indices: np.ndarray  # int64 [D], sequence index where each document ends (first = 0)


def read_megatron_index(idx: Path) -> MegatronIndex:
    """Parse ``idx``.

    Raises:
        ValueError: not a Megatron index (magic, version, dtype code, size), or ids that are not integers.
    """
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        head = f.read(_MEGATRON_HEADER.size)
    if len(head) < _MEGATRON_HEADER.size:
        raise ValueError(f"{idx} is too short for a Megatron index ({size} bytes)")
    magic, version, code, num_seqs, num_docs = _MEGATRON_HEADER.unpack(head)
    if magic != MEGATRON_MAGIC or version != MEGATRON_VERSION:
        raise ValueError(
            f"{idx} is not a Megatron indexed dataset (magic {magic!r}, version {version}); "
            f"allowed: magic {MEGATRON_MAGIC!r}, version {MEGATRON_VERSION}"
        )
    if code not in MEGATRON_DTYPES or MEGATRON_DTYPES[code][0] == "f":
        raise ValueError(f"{idx} has dtype code {code}; allowed: integer codes 1-5 and 8")
    expected = _MEGATRON_HEADER.size + num_seqs * (4 + 8) + num_docs * 8
    if size < expected:
        raise ValueError(
            f"{idx} has {size} bytes; its header ({num_seqs} sequences, {num_docs} doc indices) needs {expected}"
        )
    off = _MEGATRON_HEADER.size

    def arr(dtype: str, count: int, offset: int) -> np.ndarray:
        if count == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(idx, dtype=dtype, mode="r", offset=offset, shape=(count,))

    lengths = arr("<i4", num_seqs, off)
    pointers = arr("<i8", num_seqs, off + 4 * num_seqs)
    doc_indices = arr("<i8", num_docs, off + 12 * num_seqs)
    return MegatronIndex(np.dtype(MEGATRON_DTYPES[code]).newbyteorder("<"), lengths, pointers, doc_indices)


def megatron_segment(prefix: Path, index: MegatronIndex) -> Segment:
    """The ids of ``prefix.bin`` as one segment; sequences must lie back to back from offset 0 (as every
    Megatron builder writes them).

    Raises:
        ValueError: the ``.bin`` size or the sequence offsets disagree with the index.
    """
    bin_path = Path(f"{prefix}.bin")
    itemsize = index.dtype.itemsize
    num_ids = 0
    for lo in range(0, len(index.lengths), _BLOCK):
        lengths = np.asarray(index.lengths[lo : lo + _BLOCK], dtype=np.int64)
        starts = num_ids + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        if not np.array_equal(np.asarray(index.pointers[lo : lo + _BLOCK]), starts * itemsize):
            raise ValueError(f"{prefix}.idx: sequences are not stored back to back in {bin_path.name}; cannot read it")
        num_ids += int(lengths.sum())
    size = bin_path.stat().st_size if bin_path.is_file() else -1
    if size != num_ids * itemsize:
        raise ValueError(f"{bin_path} has {size} bytes; {prefix}.idx lists {num_ids} ids of {itemsize} bytes")
    return Segment(str(bin_path), index.dtype.str, 0, num_ids)


def megatron_doc_start(index: MegatronIndex, k: int) -> int:
    """The first id of document ``k`` (``k`` = number of documents gives the end of the data)."""
    itemsize = index.dtype.itemsize
    seq = int(index.doc_indices[k])
    if seq < len(index.pointers):
        return int(index.pointers[seq]) // itemsize
    return (int(index.pointers[-1]) // itemsize + int(index.lengths[-1])) if len(index.pointers) else 0


def write_megatron(prefix: Path, chunks: Iterable[tuple[np.ndarray, np.ndarray]], dtype: np.dtype) -> tuple[int, int]:
    """Write ``prefix.bin`` and ``prefix.idx``, one sequence per document; returns (ids, documents).

    Both are sealed (``core.atomic``) once both are written, the ``.idx`` last: a prefix with an ``.idx`` is
    complete.

    Args:
        prefix: the path prefix (Megatron's ``--data-path``).
        chunks: (ids, document ends) pairs in order; the ends are exclusive offsets into the chunk's ids.
            Ids after the last end form a final document.
        dtype: uint16 or uint32 ids; uint32 is written as int32 (code 4), as Megatron does.

    Raises:
        ValueError: a document longer than an int32 length allows.
    """
    out_dtype = np.dtype("<u2") if np.dtype(dtype).itemsize == 2 else np.dtype("<i4")
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    folder, tag = bin_path.parent, f"{bin_path.name}-{os.getpid()}"
    data = SealedFile(bin_path, folder / f".bin-{tag}")
    lens_path = folder / f".len-{tag}"  # the sequence lengths, until the index is written
    idx: SealedFile | None = None
    try:
        with open(lens_path, "wb") as lens:
            num_ids, num_seqs = _write_megatron_ids(data, lens, chunks, out_dtype)
        idx = SealedFile(idx_path, idx_path.with_name(f".{idx_path.name}.tmp-{os.getpid()}"))
        _write_megatron_index(idx, lens_path, num_seqs, out_dtype)
        data.seal()
        idx.seal()  # last: a prefix with an .idx is complete
    except BaseException:
        for sink in (data, idx):
            if sink is not None:
                sink.discard()
        raise
    finally:
        lens_path.unlink(missing_ok=True)
    return num_ids, num_seqs


def _write_megatron_ids(
    data: SealedFile, lens: BinaryIO, chunks: Iterable[tuple[np.ndarray, np.ndarray]], out_dtype: np.dtype
) -> tuple[int, int]:
    """Stream the ids into ``data`` and one int32 length per document into ``lens``; returns (ids, documents)."""
    num_ids = 0
    num_seqs = 0
    open_len = 0  # ids of the document not yet ended
    for ids, ends in chunks:
        data.write(np.asarray(ids).astype(out_dtype, copy=False).tobytes())
        bounds = np.concatenate([[0], np.asarray(ends, dtype=np.int64)])
        doc_lens = np.diff(bounds)
        if len(doc_lens):
            doc_lens[0] += open_len
            open_len = len(ids) - int(bounds[-1])
        else:
            open_len += len(ids)
        if len(doc_lens) and int(doc_lens.max()) >= 2**31:
            raise ValueError(f"a document of {int(doc_lens.max())} ids is too long for a Megatron index")
        lens.write(doc_lens.astype("<i4").tobytes())
        num_ids += len(ids)
        num_seqs += len(doc_lens)
    if open_len:
        lens.write(np.array([open_len], dtype="<i4").tobytes())
        num_seqs += 1
    return num_ids, num_seqs


def _write_megatron_index(idx: SealedFile, lens_path: Path, num_seqs: int, out_dtype: np.dtype) -> None:
    """The ``.idx``: header, the lengths of ``lens_path``, the byte offsets, the document index 0..S."""
    code = 8 if out_dtype.itemsize == 2 else 4  # the codes of uint16 and int32
    idx.write(_MEGATRON_HEADER.pack(MEGATRON_MAGIC, MEGATRON_VERSION, code, num_seqs, num_seqs + 1))
    with open(lens_path, "rb") as src:
        while block := src.read(4 * _BLOCK):
            idx.write(block)
    offset = 0
    lengths = np.memmap(lens_path, dtype="<i4", mode="r") if num_seqs else np.zeros(0, "<i4")
    for lo in range(0, num_seqs, _BLOCK):
        ids = np.asarray(lengths[lo : lo + _BLOCK], dtype=np.int64)
        starts = offset + np.concatenate([[0], np.cumsum(ids)[:-1]])
        idx.write((starts * out_dtype.itemsize).astype("<i8").tobytes())
        offset += int(ids.sum())
    del lengths
    for lo in range(0, num_seqs + 1, _BLOCK):
        idx.write(np.arange(lo, min(num_seqs + 1, lo + _BLOCK), dtype="<i8").tobytes())


def nanogpt_segment(path: Path) -> Segment:
    """A nanoGPT ``.bin``: uint16 ids, no header.

    Raises:
        ValueError: the size is odd.
    """
    size = path.stat().st_size
    if size % 2:
        raise ValueError(f"{path} has {size} bytes, not a whole number of uint16 ids; is it a nanoGPT .bin?")
    return Segment(str(path), "<u2", 0, size // 2)


def write_nanogpt(path: Path, chunks: Iterable[np.ndarray], vocab_size: int) -> int:
    """Write ids as a nanoGPT ``.bin`` (uint16, no header); returns the number of ids.

    Raises:
        ValueError: the vocabulary has ids beyond uint16.
    """
    if vocab_size > 2**16:
        raise ValueError(
            f"nanoGPT's .bin holds uint16 ids but the vocabulary has {vocab_size}; use --format megatron or llmc"
        )
    return _write_flat(path, b"", chunks, np.dtype("<u2"))


def llmc_segment(path: Path) -> Segment:
    """An llm.c ``.bin``: its 256-int32 header, then the ids.

    Raises:
        ValueError: not an llm.c token file (magic, version, size).
    """
    size = path.stat().st_size
    header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INTS) if size >= 4 * LLMC_HEADER_INTS else None
    if header is None or int(header[0]) not in LLMC_KINDS:
        raise ValueError(f"{path} is not an llm.c token file (no magic {' or '.join(map(str, LLMC_KINDS))})")
    version, dtype = LLMC_KINDS[int(header[0])]
    if int(header[1]) != version:
        raise ValueError(f"{path}: llm.c magic {int(header[0])} with version {int(header[1])}; allowed: {version}")
    count = int(header[2])
    itemsize = np.dtype(dtype).itemsize
    if size != 4 * LLMC_HEADER_INTS + count * itemsize:
        raise ValueError(f"{path} has {size} bytes; its header says {count} ids of {itemsize} bytes after 1024")
    return Segment(str(path), "<" + dtype, 4 * LLMC_HEADER_INTS, count)


def is_llmc(path: Path) -> bool:
    """Whether ``path`` starts with an llm.c magic number."""
    with open(path, "rb") as f:
        head = f.read(4)
    return len(head) == 4 and struct.unpack("<i", head)[0] in LLMC_KINDS


def write_llmc(path: Path, chunks: Iterable[np.ndarray], num_ids: int, dtype: np.dtype) -> int:
    """Write ids as an llm.c ``.bin`` (uint16: magic 20240520 version 1; uint32: 20240801 version 7).

    Raises:
        ValueError: ``num_ids`` does not fit the header's int32 or disagrees with the chunks.
    """
    if num_ids >= 2**31:
        raise ValueError(f"an llm.c file holds fewer than 2**31 ids, not {num_ids}; use smaller --shard-tokens")
    dtype = np.dtype(dtype).newbyteorder("<")
    magic = next(m for m, (_, d) in LLMC_KINDS.items() if np.dtype("<" + d) == dtype)
    header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
    header[:3] = (magic, LLMC_KINDS[magic][0], num_ids)
    written = _write_flat(path, header.tobytes(), chunks, dtype)
    if written != num_ids:
        path.unlink(missing_ok=True)
        raise ValueError(f"llm.c file {path}: {written} ids written, header says {num_ids}")
    return written


def _write_flat(path: Path, header: bytes, chunks: Iterable[np.ndarray], dtype: np.dtype) -> int:
    count = 0
    with sealed(path, path.with_name(f".{path.name}.tmp-{os.getpid()}")) as f:
        f.write(header)
        for ids in chunks:
            f.write(np.asarray(ids).astype(dtype, copy=False).tobytes())
            count += len(ids)
    return count
