"""Interchange formats, read and written: Megatron-LM / NeMo indexed datasets, nanoGPT and llm.c ``.bin``.

Each foreign file is built here from the format's documented layout (``struct`` and ``numpy`` calls written
in this test, not our writer), read with ``open_prepared``; and each file our writer makes is parsed here
with the same documented layout. Layouts (as their own code writes them):
- Megatron ``.idx``: b"MMIDIDX\\x00\\x00", <Q version 1, <B dtype code (4 int32, 8 uint16), <Q sequence
  count S, <Q document-index count D, int32[S] lengths, int64[S] byte offsets, int64[D] document indices.
- nanoGPT: uint16 ids, no header.
- llm.c: int32[256] header (20240520, 1, n) for uint16 ids or (20240801, 7, n) for uint32 ids, then the ids.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from unbroken.data import formats
from unbroken.data.prepare import PrepareOptions, prepare
from unbroken.data.reader import detect_format, open_prepared
from unbroken.data.shards import read_index
from unbroken.data.tokenizer import EOT, train_bpe


def everything(corpus: object) -> np.ndarray:
    train, val = corpus.train, corpus.val  # type: ignore[attr-defined]
    return np.concatenate([train.read(0, len(train)), val.read(0, len(val))]).astype(np.int64)


def reference_megatron(prefix: Path, docs: list[list[list[int]]], code: int) -> None:
    """Megatron's layout, built by hand: ``docs`` is a list of documents, each a list of sequences."""
    dtype = {8: "<u2", 4: "<i4"}[code]
    seqs = [seq for doc in docs for seq in doc]
    np.concatenate([np.asarray(s, dtype=dtype) for s in seqs]).tofile(f"{prefix}.bin")
    lengths = np.array([len(s) for s in seqs], dtype="<i4")
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype("<i8") * np.dtype(dtype).itemsize
    doc_idx = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype("<i8")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes() + pointers.tobytes() + doc_idx.tobytes())


def parse_megatron(prefix: Path) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(dtype code, lengths, pointers, document indices, ids) parsed by hand from the documented layout."""
    raw = Path(f"{prefix}.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack("<Q", raw[9:17])
    (code,) = struct.unpack("<B", raw[17:18])
    num_seqs, num_docs = struct.unpack("<QQ", raw[18:34])
    assert version == 1 and len(raw) == 34 + 12 * num_seqs + 8 * num_docs
    lengths = np.frombuffer(raw, "<i4", num_seqs, 34)
    pointers = np.frombuffer(raw, "<i8", num_seqs, 34 + 4 * num_seqs)
    doc_idx = np.frombuffer(raw, "<i8", num_docs, 34 + 12 * num_seqs)
    ids = np.fromfile(f"{prefix}.bin", dtype={8: "<u2", 4: "<i4"}[code])
    return code, lengths, pointers, doc_idx, ids


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [8, 4])
def test_a_megatron_dataset_built_from_its_layout_is_read(tmp_path: Path, code: int) -> None:
    rng = np.random.default_rng(code)
    # 40 documents; some made of several sequences (Megatron's sentence splitting), each ending with id 1.
    docs = [
        [list(rng.integers(2, 900, size=rng.integers(1, 30))) + [1] for _ in range(rng.integers(1, 4))]
        for _ in range(40)
    ]
    reference_megatron(tmp_path / "corpus_text_document", docs, code)
    flat = np.array([i for doc in docs for seq in doc for i in seq])
    for source in (tmp_path, tmp_path / "corpus_text_document", tmp_path / "corpus_text_document.idx"):
        assert detect_format(source) == "megatron"
        corpus = open_prepared(source, val_fraction=0.2)
        assert np.array_equal(everything(corpus), flat)
        assert corpus.vocab_size == flat.max() + 1  # no tokenizer: the largest id + 1
    # The validation split starts at a document start (not a sequence start inside a document).
    doc_starts = np.cumsum([0] + [sum(len(s) for s in d) for d in docs])
    assert len(corpus.train) in set(doc_starts.tolist())
    assert len(corpus.train) >= np.ceil(0.8 * len(flat))


@pytest.mark.timeout(60)
def test_our_megatron_writer_matches_the_layout(tmp_path: Path) -> None:
    chunks = [
        (np.array([5, 6, 1, 7, 1, 8], dtype=np.uint16), np.array([3, 5])),
        (np.array([9, 9, 1], dtype=np.uint16), np.array([3])),
        (np.array([4, 4], dtype=np.uint16), np.array([], dtype=np.int64)),
    ]  # a last, open document
    assert formats.write_megatron(tmp_path / "x", iter(chunks), np.dtype(np.uint16)) == (11, 4)
    code, lengths, pointers, doc_idx, ids = parse_megatron(tmp_path / "x")
    assert code == 8
    assert lengths.tolist() == [3, 2, 4, 2]  # [5 6 1] [7 1] [8 9 9 1] [4 4]
    assert pointers.tolist() == [0, 6, 10, 18]
    assert doc_idx.tolist() == [0, 1, 2, 3, 4]
    assert ids.tolist() == [5, 6, 1, 7, 1, 8, 9, 9, 1, 4, 4]
    formats.write_megatron(
        tmp_path / "y", iter([(np.array([70000, 1], dtype=np.uint32), np.array([2]))]), np.dtype(np.uint32)
    )
    assert parse_megatron(tmp_path / "y")[0] == 4  # uint32 ids are written as int32, code 4


@pytest.mark.timeout(60)
def test_foreign_files_that_break_their_layout_are_refused(tmp_path: Path) -> None:
    reference_megatron(tmp_path / "m", [[[1, 2, 3]], [[4, 5]]], 8)
    idx = bytearray((tmp_path / "m.idx").read_bytes())
    (tmp_path / "bad.bin").write_bytes((tmp_path / "m.bin").read_bytes())
    (tmp_path / "bad.idx").write_bytes(b"MMIDIDX\x00\x00" + struct.pack("<Q", 2) + bytes(idx[17:]))
    with pytest.raises(ValueError, match="version 2"):
        formats.read_megatron_index(tmp_path / "bad.idx")
    (tmp_path / "m.bin").write_bytes((tmp_path / "m.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match="m.bin has 8 bytes"):
        open_prepared(tmp_path / "m", fmt="megatron")
    header = np.zeros(256, "<i4")
    header[:3] = (20240520, 1, 10)  # says 10 ids, holds 4
    (tmp_path / "l.bin").write_bytes(header.tobytes() + np.arange(4, dtype="<u2").tobytes())
    with pytest.raises(ValueError, match="header says 10 ids"):
        formats.llmc_segment(tmp_path / "l.bin")


@pytest.mark.timeout(60)
def test_nanogpt_files_round_trip(tmp_path: Path) -> None:
    train = np.arange(5000, dtype=np.uint16) % 777
    val = (np.arange(900, dtype=np.uint16) * 7) % 777
    (tmp_path / "nano").mkdir()
    train.tofile(tmp_path / "nano" / "train.bin")
    val.tofile(tmp_path / "nano" / "val.bin")
    assert detect_format(tmp_path / "nano") == "nanogpt"
    corpus = open_prepared(tmp_path / "nano")
    assert np.array_equal(corpus.train.read(0, len(corpus.train)), train)  # its own val.bin is the split
    assert np.array_equal(corpus.val.read(0, len(corpus.val)), val)
    formats.write_nanogpt(tmp_path / "ours.bin", [train[:3000], train[3000:]], vocab_size=777)
    assert np.array_equal(np.fromfile(tmp_path / "ours.bin", dtype=np.uint16), train)
    with pytest.raises(ValueError, match="uint16"):
        formats.write_nanogpt(tmp_path / "big.bin", [train], vocab_size=70_000)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("magic", "version", "dtype"), [(20240520, 1, "<u2"), (20240801, 7, "<u4")])
def test_llmc_files_round_trip(tmp_path: Path, magic: int, version: int, dtype: str) -> None:
    def reference(path: Path, ids: np.ndarray) -> None:
        header = np.zeros(256, dtype="<i4")
        header[0], header[1], header[2] = magic, version, len(ids)
        path.write_bytes(header.tobytes() + ids.astype(dtype).tobytes())

    rng = np.random.default_rng(version)
    parts = [rng.integers(0, 60000, size=n) for n in (3000, 2000, 700)]
    (tmp_path / "llmc").mkdir()
    reference(tmp_path / "llmc" / "fw_train_000001.bin", parts[0])
    reference(tmp_path / "llmc" / "fw_train_000002.bin", parts[1])
    reference(tmp_path / "llmc" / "fw_val_000000.bin", parts[2])
    assert detect_format(tmp_path / "llmc") == "llmc"
    corpus = open_prepared(tmp_path / "llmc")
    assert np.array_equal(corpus.train.read(0, len(corpus.train)), np.concatenate(parts[:2]))
    assert np.array_equal(corpus.val.read(0, len(corpus.val)), parts[2])
    ours = tmp_path / "ours.bin"
    formats.write_llmc(ours, [parts[0][:100], parts[0][100:]], len(parts[0]), np.dtype(dtype))
    header = np.fromfile(ours, dtype="<i4", count=256)
    assert header[:3].tolist() == [magic, version, len(parts[0])] and not header[3:].any()
    assert np.array_equal(np.fromfile(ours, dtype=dtype, offset=1024), parts[0])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fmt", ["megatron", "nanogpt", "llmc"])
def test_prepare_exports_each_format_with_the_same_ids(tmp_path: Path, fmt: str) -> None:
    tok = tmp_path / "tok.json"
    words = [f"w{i} x{i % 7}" for i in range(300)]
    train_bpe(words, 300).save(str(tok))
    (tmp_path / "a.jsonl").write_text("".join(f'{{"text": "{" ".join(words[i : i + 20])}"}}\n' for i in range(200)))
    common = {"tokenizer": str(tok), "procs": 1, "progress": "none", "shard_tokens": 2000}
    prepare(PrepareOptions((str(tmp_path / "a.jsonl"),), str(tmp_path / "ref"), **common))  # type: ignore[arg-type]
    prepare(PrepareOptions((str(tmp_path / "a.jsonl"),), str(tmp_path / fmt), format=fmt, **common))  # type: ignore[arg-type]
    index = read_index(tmp_path / "ref")
    ref_ids = np.concatenate([np.fromfile(tmp_path / "ref" / s.tokens, dtype=index.dtype) for s in index.shards])
    assert not list((tmp_path / fmt).glob("shard-*")), "the shards are removed after the export"
    assert detect_format(tmp_path / fmt) == fmt
    corpus = open_prepared(tmp_path / fmt, verify=True)
    assert np.array_equal(everything(corpus), ref_ids)
    assert corpus.vocab_size == 300 and corpus.eot_id == index.eot_id  # from the stored tokenizer.json
    if fmt == "megatron":  # one sequence per document, each ending with EOT
        code, lengths, _, doc_idx, ids = parse_megatron(tmp_path / fmt / "text_document")
        assert code == 8 and len(lengths) == index.num_docs == 200
        assert doc_idx.tolist() == list(range(201))
        assert (ids[np.cumsum(lengths) - 1] == corpus.eot_id).all()
    assert Path(tmp_path / fmt / "tokenizer.json").read_text().count(EOT) >= 1
