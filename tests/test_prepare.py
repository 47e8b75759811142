"""Tests for ``unbroken prepare`` (unbroken.data.prepare and the modules it drives).

What must hold, from first principles:
- every document comes back: the ids between two document ends decode to the document, and end in EOT;
- the output is a function of the inputs and settings only (not of --procs, not of a crash and rerun);
- bad input is exit status 2 and one line ``unbroken: error: ...`` and leaves no files behind;
- memory stays under the issue's 1 GB bound.
The CLI is run as ``python -m unbroken.data.command`` (``unbroken prepare`` calls the same
``unbroken.data.command.run_prepare``).
"""

from __future__ import annotations

import ctypes
import gzip
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from unbroken.data import sources
from unbroken.data.command import parse_size
from unbroken.data.prepare import PrepareOptions, prepare
from unbroken.data.progress import Progress
from unbroken.data.reader import open_prepared
from unbroken.data.shards import INDEX, JOURNAL, read_index
from unbroken.data.sources import resolve_sources, sample_texts, split_text
from unbroken.data.tokenizer import EOT, load_tokenizer, train_bpe

REPO = Path(__file__).resolve().parents[1]
PREPARE = [sys.executable, "-m", "unbroken.data.command"]
SYLLABLES = ["ka", "lo", "mi", "ren", "sto", "vu", "el", "ra", "thi", "on", "qua", "zé", "nö", "日", "本"]


def make_docs(n: int, seed: int) -> list[str]:
    """``n`` documents of 1-8 lines of made-up words (some not ASCII)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    docs = []
    for _ in range(n):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 15))) for _ in range(rng.randint(1, 8))]
        docs.append("\n".join(lines))
    return docs


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({field: doc, "id": len(doc)}, ensure_ascii=False) + "\n")
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE of 400 ids (EOT included) trained on made-up text."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(make_docs(300, 99), 400).save(str(path))
    return path


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PREPARE, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env or os.environ.copy()
    )


def opts(srcs: list[Path], out: Path, tokenizer: Path, **kw: object) -> PrepareOptions:
    base: dict[str, object] = {"procs": 1, "progress": "none", "shard_tokens": 4096}
    base.update(kw)
    return PrepareOptions(tuple(map(str, srcs)), str(out), tokenizer=str(tokenizer), **base)  # type: ignore[arg-type]


def decoded_docs(out: Path) -> list[str]:
    """The documents of a prepared folder, read back from the shards and the document ends."""
    index = read_index(out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = np.concatenate([np.fromfile(out / s.tokens, dtype=index.dtype) for s in index.shards]).astype(np.int64)
    starts = np.cumsum([0] + [s.num_tokens for s in index.shards])
    ends = np.concatenate(
        [starts[k] + np.fromfile(out / s.docs, dtype="<i8") for k, s in enumerate(index.shards)]
    ).astype(np.int64)
    assert len(ends) == index.num_docs and ends[-1] == len(ids) == index.num_tokens
    docs, prev = [], 0
    for end in ends:
        assert ids[end - 1] == index.eot_id, "every document ends with the end-of-text id"
        docs.append(tokenizer.decode(ids[prev : end - 1].tolist(), skip_special_tokens=False))
        prev = int(end)
    return docs


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("unbroken: error: "), lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------------------------
# The command and its result


@pytest.mark.timeout(60)
def test_help_lists_the_flags() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for flag in (
        "SRC",
        "--out",
        "--tokenizer",
        "--train-tokenizer",
        "--vocab-size",
        "--sample-bytes",
        "--field",
        "--column",
        "--procs",
        "--shard-tokens",
        "--dtype",
        "--format",
        "--errors",
        "--progress",
    ):
        assert flag in result.stdout, flag


@pytest.mark.timeout(180)
def test_multi_file_jsonl_round_trips_in_fixed_shards_under_1_gb(tmp_path: Path, tok: Path) -> None:
    from unbroken.lab.bench_data import run_measured

    docs = [make_docs(1500, seed) for seed in range(4)]
    files = [write_jsonl(tmp_path / f"part-{k}.jsonl", d) for k, d in enumerate(docs)]
    out = tmp_path / "out"
    cmd = [
        *PREPARE,
        *map(str, files),
        "--tokenizer",
        str(tok),
        "--out",
        str(out),
        "--procs",
        "2",
        "--shard-tokens",
        "50000",
        "--progress",
        "lines",
    ]
    m = run_measured(cmd, cwd=REPO, timeout=170)
    assert m.returncode == 0, m.stderr
    assert m.peak_rss_sum < 2**30, f"prepare's processes peaked at {m.peak_rss_sum / 2**20:.0f} MiB together"
    assert decoded_docs(out) == [d for part in docs for d in part]
    index = read_index(out)
    assert all(s.num_tokens == 50000 for s in index.shards[:-1]) and 0 < index.shards[-1].num_tokens <= 50000
    assert index.dtype == "uint16" and index.vocab_size == 400
    assert index.tokenizer_sha256 == load_tokenizer(str(tok)).sha256
    assert not (out / JOURNAL).exists() and not list(out.glob("*.tmp*"))
    assert "prepared" in m.stdout and "prepare:" in m.stderr  # a summary; plain progress lines (no terminal)


@pytest.mark.timeout(120)
def test_output_does_not_depend_on_the_number_of_processes(tmp_path: Path, tok: Path) -> None:
    files = [write_jsonl(tmp_path / f"p{k}.jsonl", make_docs(400, 10 + k)) for k in range(3)]
    one = prepare(opts(files, tmp_path / "one", tok, procs=1))
    three = prepare(opts(files, tmp_path / "three", tok, procs=3))
    assert read_index(tmp_path / "one").shards == read_index(tmp_path / "three").shards
    assert one.num_tokens == three.num_tokens and one.num_shards == three.num_shards > 3


@pytest.mark.timeout(240)
def test_kill_9_mid_run_then_rerun_gives_the_uninterrupted_result(tmp_path: Path, tok: Path) -> None:
    files = [write_jsonl(tmp_path / f"p{k}.jsonl", make_docs(3000, 20 + k)) for k in range(3)]
    args = [*map(str, files), "--tokenizer", str(tok), "--shard-tokens", "5000", "--procs", "2", "--progress", "none"]
    reference = tmp_path / "reference"
    assert run_cli(*args, "--out", str(reference)).returncode == 0

    out = tmp_path / "out"
    proc = subprocess.Popen(
        [*PREPARE, *args, "--out", str(out)],
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:  # wait until at least two shards are finished, then kill everything
            try:
                if len(json.loads((out / JOURNAL).read_text())["shards"]) >= 2:
                    break
            except (OSError, ValueError):
                pass
            assert proc.poll() is None, "prepare ended before it could be killed"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert not (out / INDEX).exists(), "killed before the end"
    kept = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("shard-*.bin")}
    listed = json.loads((out / JOURNAL).read_text())["shards"]
    assert len(listed) >= 2

    result = run_cli(*args, "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "continued" in result.stdout
    assert read_index(out).shards == read_index(reference).shards  # byte-identical (checksums)
    for shard in listed:  # finished shards were kept, not rewritten
        p = out / shard["tokens"]
        assert (p.stat().st_ino, p.stat().st_mtime_ns) == kept[shard["tokens"]]
    assert not list(out.glob("*.tmp*")) and not (out / JOURNAL).exists()

    again = run_cli(*args, "--out", str(out))  # a finished preparation: checked, nothing else
    assert again.returncode == 0 and "already holds this preparation" in again.stdout


# ---------------------------------------------------------------------------------------------------------
# Sources


@pytest.mark.timeout(120)
def test_text_folders_globs_and_compressed_files(tmp_path: Path, tok: Path) -> None:
    import pyarrow as pa

    texts = make_docs(6, 1)
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text(texts[0], encoding="utf-8")
    (src / "sub" / "b.md").write_text(texts[1], encoding="utf-8")
    with gzip.open(src / "c.txt.gz", "wt", encoding="utf-8") as f:
        f.write(texts[2])
    jsonl = "".join(json.dumps({"text": t}) + "\n" for t in texts[3:5])
    with pa.output_stream(str(src / "d.jsonl.zst"), compression="zstd") as f:
        f.write(jsonl.encode())
    (src / ".hidden.txt").write_text("not read", encoding="utf-8")
    (src / "notes.csv").write_text("not read", encoding="utf-8")
    (tmp_path / "e.txt").write_text("\ufeff" + texts[5], encoding="utf-8")  # a byte order mark is not text

    prepare(opts([src, tmp_path / "e*.txt"], tmp_path / "out", tok))
    # A folder is read in the order of its relative paths (sub/b.md after d.jsonl.zst), then the glob.
    assert decoded_docs(tmp_path / "out") == [texts[0], texts[2], texts[3], texts[4], texts[1], texts[5]]


@pytest.mark.timeout(120)
def test_parquet_and_datasets_folders(tmp_path: Path, tok: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = make_docs(50, 2)
    body = rows[:20] + [None, "   "] + rows[20:30]  # a null and a blank row are skipped
    pq.write_table(pa.table({"body": body, "n": list(range(len(body)))}), tmp_path / "t.parquet", row_group_size=7)
    datasets.Dataset.from_dict({"text": rows[30:40]}).save_to_disk(str(tmp_path / "ds"))
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": rows[40:45]}),
            "test": datasets.Dataset.from_dict({"text": rows[45:50]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))

    prepare(opts([tmp_path / "t.parquet"], tmp_path / "o1", tok, column="body"))
    assert decoded_docs(tmp_path / "o1") == rows[:30]
    prepare(opts([tmp_path / "ds", tmp_path / "dd"], tmp_path / "o2", tok))
    assert decoded_docs(tmp_path / "o2") == rows[30:50]


@pytest.mark.timeout(120)
def test_long_documents_are_cut_where_the_tokens_do_not_change(
    tmp_path: Path, tok: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sources, "PIECE_CHARS", 500)
    monkeypatch.setattr(sources, "READ_BYTES", 333)  # blocks of any size cut in the same places
    text = "\n".join(make_docs(60, 3))
    assert len(split_text(text)) > 10
    (tmp_path / "long.txt").write_text(text, encoding="utf-8")
    write_jsonl(tmp_path / "long.jsonl", [text])
    tokenizer = Tokenizer.from_file(str(tok))
    eot = tokenizer.token_to_id(EOT)
    expected = tokenizer.encode(text, add_special_tokens=False).ids + [eot]
    for name in ("long.txt", "long.jsonl"):
        out = tmp_path / f"out-{name}"
        prepare(opts([tmp_path / name], out, tok, shard_tokens=10**6))
        index = read_index(out)
        assert np.fromfile(out / index.shards[0].tokens, dtype=index.dtype).tolist() == expected
    # The cut is a function of the text: the same whatever the block size or the text after 4 * limit.
    cuts = [sources.next_cut(text[:n], final=False, limit=500) for n in (2000, 2500, 5000)]
    assert cuts[0] == cuts[1] == cuts[2] is not None
    spaceless = "x" * 1300
    assert "".join(split_text(spaceless, 500)) == spaceless


# ---------------------------------------------------------------------------------------------------------
# Tokenizers


@pytest.mark.timeout(120)
def test_a_hugging_face_tokenizer_by_name_from_the_local_cache(tmp_path: Path, tok: Path) -> None:
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = cache / "models--testorg--tiny-bpe" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").write_bytes(tok.read_bytes())
    (cache / "models--testorg--tiny-bpe" / "refs").mkdir()
    (cache / "models--testorg--tiny-bpe" / "refs" / "main").write_text(commit)
    src = write_jsonl(tmp_path / "a.jsonl", make_docs(30, 4))

    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    result = run_cli(str(src), "--tokenizer", "testorg/tiny-bpe", "--out", str(tmp_path / "out"), env=env)
    assert result.returncode == 0, result.stderr
    assert read_index(tmp_path / "out").tokenizer_sha256 == load_tokenizer(str(tok)).sha256
    line = one_error_line(run_cli(str(src), "--tokenizer", "testorg/absent", "--out", str(tmp_path / "o2"), env=env))
    assert "local cache" in line and not (tmp_path / "o2").exists()


@pytest.mark.timeout(120)
def test_train_tokenizer_on_a_bounded_sample(tmp_path: Path) -> None:
    files = [write_jsonl(tmp_path / f"p{k}.jsonl", make_docs(500, 30 + k)) for k in range(3)]
    units = resolve_sources(list(map(str, files)))
    assert sum(len(t) for t in sample_texts(units, 20_000)) <= 20_000  # never the whole corpus
    out = tmp_path / "out"
    result = run_cli(
        *map(str, files),
        "--train-tokenizer",
        "--vocab-size",
        "300",
        "--sample-bytes",
        "20K",
        "--out",
        str(out),
        "--procs",
        "1",
    )
    assert result.returncode == 0, result.stderr
    trained = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert trained.get_vocab_size() == 300 and trained.token_to_id(EOT) is not None
    assert decoded_docs(out) == [d for k in range(3) for d in make_docs(500, 30 + k)]
    assert parse_size("20K") == 20 * 1024 and parse_size("1.5M") == 1536 * 1024


@pytest.mark.timeout(60)
def test_progress_draws_a_bar_on_a_terminal_and_lines_elsewhere() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, plain = Tty(), io.StringIO()
    with Progress(1000, "auto", stream=tty) as p:
        p.update(3, 100, 500)
    with Progress(1000, "auto", interval_s=0.0, stream=plain) as p:
        p.update(3, 100, 500)
    assert "prepare" in tty.getvalue()
    lines = plain.getvalue().splitlines()
    assert lines[0].startswith("prepare: 3 docs, 100 tokens") and "ETA" in lines[0] and "done" in lines[-1]


# ---------------------------------------------------------------------------------------------------------
# Bad input: one line, exit status 2, nothing left behind


def _big_vocab_tokenizer(path: Path) -> Path:
    vocab = {f"w{i}": i for i in range(70_000)}
    vocab[EOT] = 70_000
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


BAD_INPUTS = {
    # name: (how to make the source, extra flags, what the message names)
    "missing file": (lambda d: d / "absent.jsonl", [], "does not exist"),
    "empty file": (lambda d: _write(d / "e.txt", b""), [], "is empty"),
    "blank file": (lambda d: _write(d / "b.txt", b"  \n\n  "), [], "holds no text"),
    "binary file": (lambda d: _write(d / "bin.txt", b"abc\x00def"), [], "binary"),
    "invalid UTF-8 text": (lambda d: _write(d / "l.txt", "caf\xe9 ok".encode("latin-1")), [], "not UTF-8"),
    "invalid UTF-8 JSONL": (lambda d: _write(d / "l.jsonl", b'{"text": "caf\xe9"}\n'), [], "not UTF-8"),
    "JSONL without the field": (lambda d: _jsonl_then(d, b'{"body": "x"}\n'), [], "line 5001 has no field 'text'"),
    "JSONL field not text": (lambda d: _write(d / "n.jsonl", b'{"text": 3}\n'), [], "not a string"),
    "invalid JSON": (lambda d: _write(d / "j.jsonl", b'{"text": \n'), [], "not valid JSON"),
    "lone surrogate": (lambda d: _write(d / "s.jsonl", b'{"text": "a \\udc80 b"}\n'), [], "cannot be tokenized"),
    "parquet without the column": (lambda d: _parquet(d, {"body": ["x"]}), [], "no column 'text'"),
    "parquet column not text": (lambda d: _parquet(d, {"text": [1, 2]}), [], "not text"),
    "datasets without the column": (lambda d: _datasets(d), [], "no column 'text'"),
    "corrupt gzip": (lambda d: _write(d / "c.txt.gz", b"this is not gzip data"), [], "gzip"),
    "corrupt zstd": (lambda d: _write(d / "c.jsonl.zst", b"this is not zstd data"), [], "zstd"),
    "vocabulary beyond uint16": (lambda d: _write(d / "v.txt", b"w1 w2"), ["--dtype", "uint16", "BIG"], "uint16"),
    "nanoGPT needs uint16": (lambda d: _write(d / "v.txt", b"w1 w2"), ["--format", "nanogpt", "BIG"], "nanogpt"),
    "two tokenizers": (lambda d: _write(d / "t.txt", b"text"), ["--train-tokenizer"], "exactly one"),
    "unknown --errors": (lambda d: _write(d / "t.txt", b"text"), ["--errors", "ignore"], "invalid choice"),
}


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _jsonl_then(d: Path, last: bytes) -> Path:
    """5000 good lines (more than one task: shards are written before the error), then ``last``."""
    path = write_jsonl(d / "late.jsonl", make_docs(5000, 5))
    with open(path, "ab") as f:
        f.write(last)
    return path


def _parquet(d: Path, columns: dict[str, list[object]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), d / "t.parquet")
    return d / "t.parquet"


def _datasets(d: Path) -> Path:
    import datasets

    datasets.Dataset.from_dict({"body": ["x"]}).save_to_disk(str(d / "ds"))
    return d / "ds"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_nothing_left(case: str, tmp_path: Path, tok: Path) -> None:
    make, extra, expected = BAD_INPUTS[case]
    src = make(tmp_path)
    tokenizer = str(tok)
    if "BIG" in extra:
        extra = [x for x in extra if x != "BIG"]
        tokenizer = str(_big_vocab_tokenizer(tmp_path / "big.json"))
    out = tmp_path / "out"
    # --progress none: on a loaded machine a late error can come after a periodic progress line (stderr)
    result = run_cli(
        str(src), "--tokenizer", tokenizer, "--out", str(out), "--shard-tokens", "2000", "--procs", "1",
        "--progress", "none", *extra,
    )  # fmt: skip
    if case == "unknown --errors":  # argparse's own usage error: also exit status 2
        assert result.returncode == 2 and expected in result.stderr
        return
    line = one_error_line(result)
    assert expected in line, line
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def _honour_permissions() -> None:
    """``preexec_fn`` for root: drop the capabilities that let root read any file (CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH) from the bounding set, so the program it executes (still uid 0, so it can reach an
    interpreter under /root, which ``nobody`` cannot) is refused what a file's mode refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {capability})")


@pytest.mark.timeout(60)
def test_unreadable_file_is_one_line(tmp_path: Path, tok: Path) -> None:
    """Run as root too (as CI does): the command then runs without root's power to read any file."""
    src = _write(tmp_path / "secret.txt", b"text")
    src.chmod(0)
    cmd = [*PREPARE, str(src), "--tokenizer", str(tok), "--out", str(tmp_path / "out")]
    preexec = _honour_permissions if os.geteuid() == 0 else None
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, preexec_fn=preexec)
    line = one_error_line(result)
    assert "cannot be read" in line and not (tmp_path / "out").exists()
    src.chmod(0o644)  # the same command on the readable file gets past reading it: the refusal was the mode's
    readable = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, preexec_fn=preexec)
    assert readable.returncode == 0, readable.stderr


@pytest.mark.timeout(60)
def test_errors_replace_substitutes_invalid_bytes(tmp_path: Path, tok: Path) -> None:
    _write(tmp_path / "l.txt", "caf\xe9 ok".encode("latin-1"))
    _write(tmp_path / "s.jsonl", b'{"text": "a \\udc80 b"}\n')  # a lone surrogate, escaped in JSON
    prepare(opts([tmp_path / "l.txt", tmp_path / "s.jsonl"], tmp_path / "out", tok, errors="replace"))
    assert decoded_docs(tmp_path / "out") == ["caf\ufffd ok", "a \ufffd b"]


@pytest.mark.timeout(60)
def test_an_occupied_output_folder_is_refused_and_left_alone(tmp_path: Path, tok: Path) -> None:
    src = write_jsonl(tmp_path / "a.jsonl", make_docs(10, 6))
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    line = one_error_line(run_cli(str(src), "--tokenizer", str(tok), "--out", str(out)))
    assert "not empty" in line and (out / "mine.txt").read_text() == "keep me"


@pytest.mark.timeout(120)
def test_a_damaged_shard_is_one_line_and_exit_2(tmp_path: Path, tok: Path) -> None:
    src = write_jsonl(tmp_path / "a.jsonl", make_docs(300, 7))
    out = tmp_path / "out"
    args = [str(src), "--tokenizer", str(tok), "--out", str(out), "--shard-tokens", "3000", "--procs", "1"]
    assert run_cli(*args).returncode == 0
    shard = out / "shard-00001.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    line = one_error_line(run_cli(*args))  # a rerun checks the finished preparation
    assert "shard-00001.bin" in line and "checksum" in line
    with pytest.raises(ValueError, match="shard-00001.bin fails its checksum"):
        open_prepared(out, verify=True)
    shard.write_bytes(bytes(data[:-2]))  # a short shard is caught without reading it
    with pytest.raises(ValueError, match="shard-00001.bin has"):
        open_prepared(out)


@pytest.mark.timeout(120)
def test_a_different_tokenizer_is_refused(tmp_path: Path, tok: Path) -> None:
    src = write_jsonl(tmp_path / "a.jsonl", make_docs(100, 8))
    out = tmp_path / "out"
    prepare(opts([src], out, tok))
    other = tmp_path / "other.json"
    train_bpe(make_docs(100, 1), 350).save(str(other))
    with pytest.raises(ValueError, match="is not the one the data in"):
        open_prepared(out, tokenizer=str(other))
    reformatted = tmp_path / "same.json"  # the same tokenizer, formatted otherwise: accepted
    reformatted.write_text(json.dumps(json.loads(tok.read_text()), indent=4))
    assert open_prepared(out, tokenizer=str(reformatted)).vocab_size == 400
    # Continuing a preparation with another tokenizer is refused too, and leaves the earlier run alone.
    line = one_error_line(run_cli(str(src), "--tokenizer", str(other), "--out", str(out)))
    assert "other inputs or settings" in line and "tokenizer" in line
    assert (out / INDEX).is_file()


@pytest.mark.timeout(60)
def test_an_unfinished_preparation_is_refused_by_the_reader(tmp_path: Path, tok: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / JOURNAL).write_text(json.dumps({"plan": {}, "shards": []}))
    with pytest.raises(ValueError, match="unfinished"):
        open_prepared(out)
