"""Hostile input: each gets a one-line error (exit 2) or a documented fallback, and nothing on disk is lost.

Damaged checkpoints (every one of them), a checkpoint of another model shape or trained on another
tokenizer, data files that are empty or not text, a tokenizer swapped inside the token cache, and failure
schedules that name nothing real. (One damaged newest checkpoint falls back to the previous one:
tests/test_train.py and tests/test_checkpoint.py.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from runner import TINY, run_command, train

from unbroken.core.config import DataConfig
from unbroken.core.failures import FailureSchedule
from unbroken.data.corpus import open_corpus
from unbroken.ft.checkpoint import schema as ckpt

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, data_cache_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "run"
    result = train(out, data_cache_dir, "--train.steps=6", "--checkpoint.every=2", workers=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ckpt.list_checkpoints(out) == [6, 4, 2]
    return out


def _snapshot(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _resume(run_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "unbroken", "train", "--resume", str(run_dir), "--workers", "2", "--quiet", *extra]
    return run_command(cmd, capture_output=True, text=True, timeout=100)


def _one_line_error(result: subprocess.CompletedProcess[str], message: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unbroken: error: ") and message in lines[0], lines


def test_resume_with_every_checkpoint_damaged_refuses_and_keeps_the_files(tmp_path: Path, finished: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    directory = ckpt.checkpoint_dir(run)
    newest, middle, oldest = (directory / f"step_{s:08d}.pt" for s in (6, 4, 2))
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated
    raw = bytearray(middle.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit flipped
    middle.write_bytes(bytes(raw))
    oldest.with_suffix(".json").write_text("{]")  # garbage manifest
    before = _snapshot(run)
    _one_line_error(_resume(run), "none of the 3 checkpoints is usable")
    assert _snapshot(run) == before


def test_resume_without_a_checkpoint_refuses(tmp_path: Path, finished: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    shutil.rmtree(ckpt.checkpoint_dir(run))
    before = _snapshot(run)
    _one_line_error(_resume(run), "no checkpoint in")
    assert _snapshot(run) == before


def test_resume_with_another_model_shape_refuses(tmp_path: Path, finished: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = _snapshot(run)
    # --resume-with-changes lets the other model past the config's own check, to the checkpoint's
    _one_line_error(_resume(run, "--resume-with-changes", "--model.flavour=small"), "is for a different model shape")
    assert _snapshot(run) == before  # config.toml is not overwritten by the refused override


def test_resume_with_a_checkpoint_of_another_tokenizer_refuses(tmp_path: Path, finished: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    loaded = ckpt.load_latest(run)
    assert loaded is not None and len(loaded.state["metadata"]["tokenizer_sha256"]) == 64
    metadata = {**loaded.state["metadata"], "tokenizer_sha256": "0" * 64}  # as if trained on another tokenization
    state = {**loaded.state, "metadata": metadata}
    ckpt.save_checkpoint(run, loaded.step, state, keep=3)
    before = _snapshot(run)
    _one_line_error(_resume(run), "was trained with another tokenizer")
    assert _snapshot(run) == before


def test_data_file_that_is_not_text_is_refused(tmp_path: Path, data_cache_dir: Path) -> None:
    # (Empty, blank, binary and non-UTF-8 files are each refused by open_corpus: tests/test_data.py.)
    content = b"\x00\x01\x02binary" * 50
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(content)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "unbroken", "train", TINY, "--workers", "2", "--out", str(out), "--quiet"]
    cmd += [f"--data.source={corpus}", f"--data.cache_dir={tmp_path / 'cache'}"]
    result = run_command(cmd, capture_output=True, text=True, timeout=100)
    _one_line_error(result, "is binary")
    assert not out.exists() and not (tmp_path / "cache").exists()
    assert corpus.read_bytes() == content


def test_tokenizer_swapped_inside_the_cache_is_detected_and_rebuilt(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    words = "the king queen crown sword night day love war speak hath thou art good my lord".split()
    text = "".join(" ".join(rng.choice(words, size=rng.integers(3, 12))).capitalize() + ".\n" for _ in range(600))
    (tmp_path / "corpus.txt").write_text(text)
    small = {"seq_len": 16, "microbatch_size": 2, "val_fraction": 0.1}
    cfg = DataConfig(source=str(tmp_path / "corpus.txt"), cache_dir=str(tmp_path / "cache"), vocab_size=300, **small)
    first = open_corpus(cfg)
    train_tokens = first.train.read(0, len(first.train))
    other = open_corpus(
        DataConfig(source=str(tmp_path / "corpus.txt"), cache_dir=str(tmp_path / "other"), vocab_size=280, **small)
    )
    shutil.copy(other.tokenizer_path, first.tokenizer_path)  # the cached tokens no longer match it
    again = open_corpus(cfg)
    assert again.vocab_size == first.vocab_size
    assert np.array_equal(again.train.read(0, len(again.train)), train_tokens)


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ("pause:worker=1,step=2", "pause needs seconds="),
        ("pause:worker=1,step=2,seconds=0", "must be > 0"),
        ("cut:worker=9,step=2", "worker 9 does not exist"),
        ("cut:worker=1,step=2,factor=3", "unknown key 'factor'"),
        ("kill:worker=1,step=2,phase=during", "unknown phase 'during'"),
        ("cut:worker=0,step=1; kill:worker=1,step=1", "kills every worker"),
    ],
)
def test_schedules_that_name_nothing_real(schedule: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        FailureSchedule.parse(schedule).validate(2, 10)
    assert "\n" not in str(info.value)


def test_new_phases_fire_from_their_step_on() -> None:
    schedule = FailureSchedule.parse(
        "kill:worker=1,step=5,phase=receive; kill:worker=1,step=9,phase=receive; kill:worker=0,step=4,phase=checkpoint"
    )
    assert schedule.injections(1, 3, "receive") == []
    assert [e.step for e in schedule.injections(1, 7, "receive")] == [5]
    assert [e.step for e in schedule.injections(1, 12, "receive")] == [5, 9]
    assert schedule.injection(0, 10, "checkpoint") is not None and schedule.injection(0, 3, "checkpoint") is None
    assert FailureSchedule.parse(schedule.describe()) == schedule
