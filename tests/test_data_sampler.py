"""Reading prepared data: the memory-mapped stream, the split, and the samplers' determinism.

What must hold: a microbatch is a pure function of (seed, step, microbatch id), the same in any process and
whichever worker computes it; an epoch uses every window once; no window straddles the train/validation
split, which falls on a document boundary; pickling a corpus sends no ids.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from unbroken.data.prepare import PrepareOptions, prepare
from unbroken.data.reader import open_prepared
from unbroken.data.sampler import EvalSampler, PreparedMicrobatchSampler, WindowPermutation
from unbroken.data.stream import Segment, TokenStream
from unbroken.data.tokenizer import train_bpe

REPO = Path(__file__).resolve().parents[1]
SEQ, B, M, SEED = 16, 3, 4, 1234

# In another interpreter: open the corpus and print the microbatches named on the command line.
SCRIPT = """
import json, sys
from unbroken.data.reader import open_prepared
from unbroken.data.sampler import PreparedMicrobatchSampler
corpus = open_prepared(sys.argv[1], val_fraction=0.1)
sampler = PreparedMicrobatchSampler(corpus.train, 16, 3, 4, seed=1234)
pairs = json.loads(sys.argv[2])
print(json.dumps({f"{s},{j}": [t.tolist() for t in sampler.microbatch(s, j)] for s, j in pairs}))
"""


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared corpus of several small shards (windows straddle shard boundaries)."""
    d = tmp_path_factory.mktemp("prepared")
    words = [f"w{i} v{i % 13} u{i % 5}" for i in range(500)]
    train_bpe(words, 300).save(str(d / "tok.json"))
    with open(d / "a.jsonl", "w") as f:
        for i in range(300):
            f.write(json.dumps({"text": " ".join(words[i : i + 1 + i % 30])}) + "\n")
    opts = PrepareOptions(
        (str(d / "a.jsonl"),),
        str(d / "out"),
        tokenizer=str(d / "tok.json"),
        procs=1,
        progress="none",
        shard_tokens=1000,
    )
    prepare(opts)
    return d / "out"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 255, 256, 1000, 4097])
def test_window_permutation_is_a_bijection(n: int) -> None:
    image = WindowPermutation(n, seed=7, epoch=3)(np.arange(n))
    assert sorted(image.tolist()) == list(range(n))
    assert np.array_equal(image, WindowPermutation(n, seed=7, epoch=3)(np.arange(n)))


@pytest.mark.timeout(60)
def test_window_permutation_depends_on_seed_and_epoch_only() -> None:
    n = 10_000
    a = WindowPermutation(n, 1, 0)(np.arange(n))
    assert not np.array_equal(a, WindowPermutation(n, 2, 0)(np.arange(n)))
    assert not np.array_equal(a, WindowPermutation(n, 1, 1)(np.arange(n)))
    assert np.array_equal(a[1234:1300], WindowPermutation(n, 1, 0)(np.arange(1234, 1300)))  # pointwise


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [17, 1000, 123_457])
def test_window_permutation_is_the_same_function_for_few_and_many_ids(n: int) -> None:
    perm = WindowPermutation(n, seed=5, epoch=1)
    ids = np.arange(min(n, 4096))
    few = np.concatenate([perm(ids[i : i + 16]) for i in range(0, len(ids), 16)])  # Python integers
    assert np.array_equal(perm(ids), few)  # numpy


@pytest.mark.timeout(60)
def test_token_stream_bounds_what_it_keeps_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from unbroken.data import stream as stream_module

    monkeypatch.setattr(stream_module, "MAP_BUDGET_BYTES", 1 << 16)
    ids = np.arange(1 << 16, dtype="<u2")
    ids.tofile(tmp_path / "a.bin")
    stream = TokenStream([Segment(str(tmp_path / "a.bin"), "<u2", 0, len(ids))], access="mmap")
    rng = np.random.default_rng(0)
    for start in rng.integers(0, len(ids) - 300, size=500):
        assert np.array_equal(stream.read(int(start), 257), ids[start : start + 257])
        assert stream._mapped_bytes <= (1 << 16) + 257 * 2 + 2 * stream_module._PAGE


@pytest.mark.timeout(60)
def test_token_stream_reads_many_windows_as_one_read_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``read_many`` (one indexing of a whole mapped file, as the text cache is read) gives each window's ``read``,
    in a view too, and counts what it reads against the mapping budget."""
    from unbroken.data import stream as stream_module

    monkeypatch.setattr(stream_module, "MAP_BUDGET_BYTES", 1 << 16)
    ids = np.random.default_rng(1).integers(0, 60_000, size=20_000).astype("<u2")
    ids.tofile(tmp_path / "a.bin")
    rng = np.random.default_rng(2)
    for access in ("pread", "mmap"):
        whole = TokenStream([Segment(str(tmp_path / "a.bin"), "<u2", 0, len(ids))], access=access)
        for stream, flat in ((whole, ids), (whole.view(1000, 15_000), ids[1000:15_000])):
            for _ in range(200):
                starts = rng.integers(0, len(flat) - 129, size=int(rng.integers(1, 9)))
                rows = stream.read_many(starts, 129)
                assert rows.shape == (len(starts), 129) and rows.dtype == np.dtype("<u2")
                assert all(np.array_equal(row, flat[s : s + 129]) for row, s in zip(rows, starts, strict=True))
                assert stream._mapped_bytes <= (1 << 16) + 8 * (129 * 2 + 2 * stream_module._PAGE)
            assert stream.read_many(np.zeros(0, dtype=np.int64), 129).shape == (0, 129)


@pytest.mark.timeout(60)
def test_token_stream_reads_across_files(tmp_path: Path) -> None:
    parts = [np.arange(k * 100, k * 100 + n, dtype="<u2") for k, n in enumerate([7, 0, 13, 1, 40])]
    segments = []
    for k, part in enumerate(parts):
        path = tmp_path / f"{k}.bin"
        header = b"\x00" * 6 if k == 2 else b""  # a segment may start at an offset (a header)
        path.write_bytes(header + part.tobytes())
        segments.append(Segment(str(path), "<u2", len(header), len(part)))
    flat = np.concatenate(parts)
    for access in ("pread", "mmap"):
        stream = TokenStream(segments, access=access)
        assert len(stream) == len(flat)
        for start in range(len(flat)):
            for count in (0, 1, 5, len(flat) - start):
                if start + count <= len(flat):
                    assert np.array_equal(stream.read(start, count), flat[start : start + count])
        view = stream.view(5, 30)
        assert np.array_equal(view.read(0, 25), flat[5:30])
        again = pickle.loads(pickle.dumps(view))
        assert np.array_equal(again.read(3, 10), flat[8:18])
        stream.close()
    (tmp_path / "4.bin").write_bytes(parts[4].tobytes()[:-2])  # shorter than its segment says
    with pytest.raises(ValueError, match="shorter than its index says"):
        TokenStream(segments).read(len(flat) - 3, 3)


@pytest.mark.timeout(60)
def test_split_is_at_a_document_boundary_and_windows_stay_on_their_side(prepared: Path) -> None:
    corpus = open_prepared(prepared, val_fraction=0.1)
    n = len(corpus.train) + len(corpus.val)
    assert len(corpus.train) >= np.ceil(0.9 * n)
    assert corpus.train.read(len(corpus.train) - 1, 1)[0] == corpus.eot_id  # train ends a document
    sampler = PreparedMicrobatchSampler(corpus.train, SEQ, B, M, SEED)
    assert (sampler.num_windows - 1) * SEQ + SEQ + 1 <= len(corpus.train)  # the last window ends in train
    evals = EvalSampler(corpus.val, SEQ, B, 3)
    val = corpus.val.read(0, len(corpus.val))
    for k in range(3):
        x, y = evals.microbatch(k)
        for row, w in zip(x, evals.window_ids(k), strict=True):
            assert np.array_equal(row.numpy(), val[w * SEQ : w * SEQ + SEQ])  # read from the val side only


@pytest.mark.timeout(60)
def test_microbatches_are_windows_of_the_split_and_an_epoch_uses_each_once(prepared: Path) -> None:
    corpus = open_prepared(prepared, val_fraction=0.1)
    train = corpus.train.read(0, len(corpus.train)).astype(np.int64)
    sampler = PreparedMicrobatchSampler(corpus.train, SEQ, B, M, SEED)
    seen = []
    steps = -(-sampler.num_windows // (M * B))
    for step in range(steps):
        for j in range(M):
            x, y = sampler.microbatch(step, j)
            assert x.shape == y.shape == (B, SEQ) and x.dtype == y.dtype == torch.int64
            for row_x, row_y, w in zip(x, y, sampler.window_ids(step, j), strict=True):
                assert np.array_equal(row_x.numpy(), train[w * SEQ : w * SEQ + SEQ])
                assert np.array_equal(row_y.numpy(), train[w * SEQ + 1 : w * SEQ + SEQ + 1])
            seen.extend(sampler.window_ids(step, j).tolist())
    first_epoch = seen[: sampler.num_windows]
    assert sorted(first_epoch) == list(range(sampler.num_windows))


@pytest.mark.timeout(120)
def test_microbatches_are_the_same_in_other_processes_and_for_any_worker_split(prepared: Path) -> None:
    corpus = open_prepared(prepared, val_fraction=0.1)
    sampler = PreparedMicrobatchSampler(corpus.train, SEQ, B, M, SEED)
    pairs = [(s, j) for s in (0, 1, 7, 500) for j in range(M)]
    here = {f"{s},{j}": [t.tolist() for t in sampler.microbatch(s, j)] for s, j in pairs}
    for workers in (1, 2, 3):  # worker w computes the microbatch ids j with j % workers == w
        got: dict[str, object] = {}
        for w in range(workers):
            mine = [(s, j) for s, j in pairs if j % workers == w]
            result = subprocess.run(
                [sys.executable, "-c", SCRIPT, str(prepared), json.dumps(mine)],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            got.update(json.loads(result.stdout))
        assert got == here, f"{workers} workers"


@pytest.mark.timeout(60)
def test_a_corpus_pickles_without_its_ids(prepared: Path) -> None:
    corpus = open_prepared(prepared, val_fraction=0.1)
    sampler = PreparedMicrobatchSampler(corpus.train, SEQ, B, M, SEED)
    sampler.microbatch(0, 0)  # maps some shards
    blob = pickle.dumps(corpus)
    assert len(blob) < 10_000 < 2 * len(corpus.train)
    copy = pickle.loads(blob)
    other = PreparedMicrobatchSampler(copy.train, SEQ, B, M, SEED)
    for s, j in ((0, 0), (3, 2)):
        assert all(torch.equal(a, b) for a, b in zip(sampler.microbatch(s, j), other.microbatch(s, j), strict=True))


@pytest.mark.timeout(60)
def test_too_little_data_is_a_value_error(prepared: Path) -> None:
    corpus = open_prepared(prepared, val_fraction=0.1)
    with pytest.raises(ValueError, match="fewer than microbatch_size"):
        PreparedMicrobatchSampler(corpus.train.view(0, 40), SEQ, B, M, SEED)
    with pytest.raises(ValueError, match="less than one window"):
        EvalSampler(corpus.val.view(0, SEQ), SEQ, B, 1)
    with pytest.raises(ValueError, match="seed"):
        PreparedMicrobatchSampler(corpus.train, SEQ, B, M, -1)
    with pytest.raises(ValueError, match="no prepared data"):
        open_prepared(prepared.parent)
