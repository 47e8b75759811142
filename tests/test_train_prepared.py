"""Training on prepared data (``[data] source = DIR``), end to end with real processes.

``unbroken prepare`` tokenizes a small multi-file JSONL corpus (training its own BPE on a sample); then
``unbroken train configs/tiny.toml --data.source=DIR`` must train on it with the index's vocabulary and
tokenizer, give bit for bit the same run with 1 and 2 workers (exact reduction: a microbatch's tokens
depend on (seed, step, microbatch id) only), and refuse damaged shards or another tokenizer with one line
and exit status 2 before anything is written.
"""

from __future__ import annotations

import json
import logging
import random
import sys
from pathlib import Path

import pytest
import torch
from runner import ROOT, final_params, run_command, train

from unbroken.core.config import DataConfig
from unbroken.core.records import read_records, step_losses
from unbroken.data.corpus import eval_sampler, open_corpus, tokenizer_sha256, train_sampler
from unbroken.data.reader import PreparedCorpus
from unbroken.data.sampler import PreparedMicrobatchSampler
from unbroken.data.shards import read_index
from unbroken.data.tokenizer import train_bpe
from unbroken.ft.checkpoint import schema as ckpt

VOCAB = 512


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``unbroken prepare`` (the command) on three JSONL files with --train-tokenizer."""
    d = tmp_path_factory.mktemp("prepared")
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(400)]
    files = []
    for k in range(3):
        path = d / f"part-{k}.jsonl"
        with open(path, "w") as f:
            for _ in range(600):
                f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 120)))}) + "\n")
        files.append(str(path))
    out = d / "out"
    cmd = [sys.executable, "-m", "unbroken", "prepare", *files, "--out", str(out), "--train-tokenizer"]
    cmd += ["--vocab-size", str(VOCAB), "--sample-bytes", "100K", "--procs", "2", "--shard-tokens", "40000"]
    result = run_command(cmd, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr
    assert len(read_index(out).shards) > 5
    return out


EXACT = ("--train.steps=3", "--train.threads=1", "--recovery.reduction=exact", "--train.eval_every=0")


@pytest.mark.timeout(200)
def test_train_on_prepared_data_with_2_workers_matches_1_worker(
    tmp_path: Path, data_cache_dir: Path, prepared: Path
) -> None:
    runs = {}
    for workers in (2, 1):
        out = tmp_path / f"w{workers}"
        result = train(out, data_cache_dir, f"--data.source={prepared}", *EXACT, workers=workers)
        assert result.returncode == 0, result.stderr[-2000:]
        runs[workers] = out
    index = read_index(prepared)
    params = final_params(runs[2])
    assert params["tok_embeddings.weight"].shape[0] == index.vocab_size == VOCAB  # the vocabulary of the index
    metadata = ckpt.load_latest(runs[2]).state["metadata"]
    assert metadata["tokenizer_sha256"] == index.tokenizer_sha256
    assert sorted(step_losses(runs[2])) == [0, 1, 2]
    assert step_losses(runs[2]) == step_losses(runs[1])
    other = final_params(runs[1])
    assert all(torch.equal(other[name], tensor) for name, tensor in params.items())
    assert read_records(runs[2], "final")[0]["identical"]


def _damage(prepared: Path, work: Path, how: str) -> tuple[list[str], str]:
    """A damaged copy of ``prepared`` (or another tokenizer): (overrides, what the one line must say)."""
    copy = work / "data"
    copy.mkdir()
    for p in prepared.iterdir():
        copy.joinpath(p.name).write_bytes(p.read_bytes())
    shard = copy / "shard-00002.bin"
    data = bytearray(shard.read_bytes())
    if how == "flipped byte":
        data[123] ^= 0x01
        shard.write_bytes(bytes(data))
        return [f"--data.source={copy}"], "shard-00002.bin fails its checksum"
    if how == "truncated shard":
        shard.write_bytes(bytes(data[:-2]))
        return [f"--data.source={copy}", "--data.verify=false"], "shard-00002.bin has"
    assert how == "other tokenizer", how
    other = work / "other.json"
    train_bpe(["some other text to train on"] * 20, 300).save(str(other))
    return [f"--data.source={copy}", f"--data.tokenizer={other}"], "is not the one the data in"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["flipped byte", "truncated shard", "other tokenizer"])
def test_damaged_data_or_another_tokenizer_is_one_line_and_exit_2(
    tmp_path: Path, data_cache_dir: Path, prepared: Path, how: str
) -> None:
    overrides, message = _damage(prepared, tmp_path, how)
    result = train(tmp_path / "run", data_cache_dir, *overrides, workers=2)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unbroken: error: ") and message in lines[0], lines
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(60)
def test_open_corpus_reads_prepared_data_in_place(prepared: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = DataConfig(source=str(prepared), seq_len=32, microbatch_size=2, val_fraction=0.1)
    corpus = open_corpus(cfg)
    assert isinstance(corpus, PreparedCorpus) and corpus.vocab_size == VOCAB
    assert tokenizer_sha256(corpus) == read_index(prepared).tokenizer_sha256
    sampler = train_sampler(corpus, cfg, microbatches=4, seed=3)
    assert isinstance(sampler, PreparedMicrobatchSampler)
    expected = PreparedMicrobatchSampler(corpus.train, 32, 2, 4, 3).microbatch(5, 1)
    assert all(torch.equal(a, b) for a, b in zip(sampler.microbatch(5, 1), expected, strict=True))
    x, y = eval_sampler(corpus, cfg, count=2).microbatch(1)
    assert x.shape == y.shape == (2, 32) and int(x.max()) < VOCAB
    with caplog.at_level(logging.WARNING, logger="unbroken.data.corpus"):
        open_corpus(DataConfig(source=str(prepared), vocab_size=1000, seq_len=32, microbatch_size=2))
    assert "data.vocab_size do not apply to prepared data" in caplog.text
    with pytest.raises(ValueError, match="fewer than data.microbatch_size"):
        open_corpus(DataConfig(source=str(prepared), seq_len=100_000))


@pytest.mark.timeout(60)
def test_a_run_on_prepared_data_records_its_vocabulary(prepared: Path, tmp_path: Path) -> None:
    """data.vocab_size is the size of a BPE trained on text; a run on prepared data trains none, so the config it
    records (config.toml, the checkpoints' metadata) says the data's vocabulary, not the key's default."""
    from unbroken.control.launcher import plan_launch
    from unbroken.core.config import dump_config, load_config
    from unbroken.train.launch import trainer_worker
    from unbroken.train.trainer import validate_launch

    cfg = load_config(ROOT / "configs" / "tiny.toml", [f"--data.source={prepared}"])
    assert cfg.data.vocab_size == 8192
    plan = plan_launch(cfg, tmp_path / "run", 1, False, "127.0.0.1", 0, trainer_worker, validate_launch)
    plan.sock.close()
    assert plan.cfg.data.vocab_size == VOCAB
    (tmp_path / "run").mkdir()
    assert load_config(dump_config(plan.cfg, tmp_path / "run")).data.vocab_size == VOCAB


@pytest.mark.timeout(60)
def test_a_script_reads_prepared_data_as_the_trainer_does(prepared: Path) -> None:
    """The public way for a loop of its own (docs/library.md): the same microbatches the built-in trainer reads."""
    from unbroken.data import EvalSampler, PreparedMicrobatchSampler, open_prepared

    corpus = open_prepared(prepared, val_fraction=0.1)
    train = PreparedMicrobatchSampler(corpus.train, 32, 2, microbatches_per_step=4, seed=3)
    cfg = DataConfig(source=str(prepared), seq_len=32, microbatch_size=2, val_fraction=0.1)
    trainer = train_sampler(open_corpus(cfg), cfg, microbatches=4, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(train.microbatch(5, 1), trainer.microbatch(5, 1), strict=True))
    x, y = EvalSampler(corpus.val, 32, 2, count=2).microbatch(1)
    assert x.shape == y.shape == (2, 32) and int(x.max()) < corpus.vocab_size == VOCAB
