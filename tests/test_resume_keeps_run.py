"""A resume keeps its run: ``--resume`` compares the session's config with the run's own, refuses a change of what
the run computes (one line naming the key, exit status 2, nothing written) unless ``--resume-with-changes`` is
given, lets ``train.steps`` grow with the LR schedule kept (``train.schedule_steps``: the final LR held past its
end), and records every change (``config_change`` record, the earlier config kept as ``config.N.toml``, the run's
summary and report).

The real runs resume the session's finished tiny run (``tiny_run``: 8 steps by 2 workers, checkpoints at steps 4 and
8) by the same 2 workers. That an unchanged resume reproduces the uninterrupted run bit for bit is
tests/test_train.py's ``test_resume_after_ctrl_c_and_corrupt_checkpoint_reproduces_the_run``; here the steps an
extension trains again (4-7) must equal the first session's too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import fields, replace
from enum import Enum
from pathlib import Path

import pytest
from runner import ROOT, TINY, run_command

from unbroken.control.store.gateway import TOKEN_ENV, new_token
from unbroken.core.config import (
    RESUME_FREE,
    KeyChange,
    RunConfig,
    TrainConfig,
    config_changes,
    dump_config,
    dump_resumed_config,
    load_config,
    resume_config,
)
from unbroken.core.records import RecordKind, committed_steps, decode, encode, make, read_records, sessions
from unbroken.ft.process import Job
from unbroken.lab.report import load_run, render_markdown
from unbroken.train.trainer import lr_at

pytestmark = pytest.mark.timeout(240)

# The keys that change what a run computes (its trajectory): the specification the comparison is held to. Any other
# key may change on a resume. A key added to the config is free here until named: the exhaustive test below then
# fails until it is classified in core.config.RESUME_FREE or here.
TRAJECTORY = (
    {"model.flavour", "model.vocab_size", "model.n_kv_heads", "model.hf_config"}
    | {f"data.{k}" for k in ("source", "text_field", "tokenizer", "vocab_size", "seq_len", "microbatch_size")}
    | {"data.val_fraction"}  # the held-out tail: the training split
    | {f"train.{k}" for k in ("schedule_steps", "microbatches", "lr", "warmup_fraction", "min_lr_ratio", "seed")}
    | {f"train.{k}" for k in ("weight_decay", "beta1", "beta2", "eps", "grad_clip", "precision")}
    | {"recovery.policy", "recovery.reduction"}
    | {"mecefo.rank", "mecefo.refresh_every", "mecefo.oversample", "mecefo.power_iters"}
)
# String keys whose values are checked: another allowed value (the others are found by type).
OTHER_TEXT = {
    "model.flavour": "small",
    "model.hf_config": "llama-tiny",
    "data.source": "my_texts/",
    "data.text_field": "body",
    "data.tokenizer": "tok.json",
    "data.cache_dir": "elsewhere",
    "train.out_dir": "elsewhere",
    "failures.schedule": "kill:worker=1,step=3",
    "failures.scenario": "low",
    "coordinator.state": "etcd://127.0.0.1:2379",
    "coordinator.status_host": "0.0.0.0",
    "metrics.alert_command": "true",
    "metrics.alert_webhook": "http://127.0.0.1:1/",
}


def _override(key: str, value: object) -> list[str]:
    """``--key=...`` giving ``key`` another valid value than ``value`` (with what it needs beside it)."""
    if key == "parallel.sequence_parallel":
        return [f"--{key}=true", "--parallel.tensor=2"]  # needs tensor ranks (parallel: a free section anyway)
    if key in OTHER_TEXT:
        candidates: list[object] = [OTHER_TEXT[key]]
    elif isinstance(value, bool):
        candidates = [str(not value).lower()]
    elif isinstance(value, Enum):
        candidates = [m.value for m in type(value) if m != value]
    elif isinstance(value, int):
        candidates = [value + 1, value + 2]
    elif isinstance(value, float):
        candidates = [value * 2, value / 2, 0.5]
    else:
        raise AssertionError(f"no other value for {key} = {value!r}: add one to OTHER_TEXT")
    for candidate in candidates:
        if candidate == value:
            continue
        try:
            load_config(TINY, [f"--{key}={candidate}"])
            return [f"--{key}={candidate}"]
        except ValueError:
            continue
    raise AssertionError(f"no valid other value for {key} among {candidates}")


def test_which_keys_a_resume_may_change() -> None:
    """Every key of the config, changed alone on a resume: refused (the key, its old and new value, the flag that
    allows it) exactly when it changes what the run computes; train.steps changes freely, its schedule kept."""
    stored = load_config(TINY)
    keys = [(s.name, f.name) for s in fields(RunConfig) for f in fields(getattr(stored, s.name))]
    assert len(keys) > 80 and TRAJECTORY <= {f"{s}.{k}" for s, k in keys}
    for section, name in keys:
        key = f"{section}.{name}"
        override = _override(key, getattr(getattr(stored, section), name))
        requested = load_config(TINY, override)
        if key in TRAJECTORY:
            with pytest.raises(ValueError, match="--resume-with-changes") as refused:
                resume_config(stored, requested, 8, False, "--resume RUN")
            message = str(refused.value)
            assert "\n" not in message and f"{key} = " in message and " -> " in message, message
            assert message.startswith("--resume RUN: "), message
        else:
            resume_config(stored, requested, 8, False, "--resume RUN")  # free: no error
        allowed = resume_config(stored, requested, 8, True, "--resume RUN")
        changed = {c.key: c for c in config_changes(stored, allowed)}
        assert changed[key].trajectory == (key in TRAJECTORY), key
        assert all(not c.trajectory for k, c in changed.items() if k != key), (key, changed)


def test_train_steps_keeps_the_schedule_and_may_not_go_below_the_steps_done() -> None:
    stored = load_config(TINY)  # 8 steps, schedule_steps 0
    longer = resume_config(stored, load_config(TINY, ["--train.steps=12"]), 8, False, "--resume RUN")
    assert (longer.train.steps, longer.train.schedule_steps) == (12, 8)
    assert [c.key for c in config_changes(stored, longer)] == ["train.steps", "train.schedule_steps"]
    assert not any(c.trajectory for c in config_changes(stored, longer))
    # An interrupted run (4 steps done) ended earlier keeps its schedule too; below the steps done is refused.
    shorter = resume_config(stored, load_config(TINY, ["--train.steps=6"]), 4, False, "--resume RUN")
    assert (shorter.train.steps, shorter.train.schedule_steps) == (6, 8)
    with pytest.raises(ValueError, match=r"^--resume RUN: train.steps = 3 is fewer than the 4 steps the run has done"):
        resume_config(stored, load_config(TINY, ["--train.steps=3"]), 4, False, "--resume RUN")
    # A second extension, the config given whole again (a coordinator's): the schedule stays the first one's.
    again = resume_config(longer, load_config(TINY, ["--train.steps=16"]), 12, False, "--resume RUN")
    assert (again.train.steps, again.train.schedule_steps) == (16, 8)
    same = resume_config(longer, load_config(TINY, ["--train.steps=12"]), 12, False, "--resume RUN")
    assert config_changes(longer, same) == []
    # Stretching the schedule is a change of what the run computes.
    with pytest.raises(ValueError, match=r"train.schedule_steps = 8 -> 16"):
        resume_config(longer, load_config(TINY, ["--train.steps=16", "--train.schedule_steps=16"]), 12, False, "R")


def test_lr_follows_the_schedule_then_holds_its_final_lr() -> None:
    """The reported case: a 40-step run extended to 60. The LR of steps 0-39 is the original schedule's and from
    step 40 on its final LR; recomputing the cosine over 60 steps (the bug) moves step 40 from 3.0e-4 to 1.1e-3."""
    tc = TrainConfig(steps=40, lr=3e-3)
    extended = replace(tc, steps=60, schedule_steps=40)
    assert [lr_at(s, extended) for s in range(40)] == [lr_at(s, tc) for s in range(40)]
    final = tc.lr * tc.min_lr_ratio
    assert [lr_at(s, extended) for s in range(40, 60)] == [final] * 20
    assert lr_at(39, tc) > final and f"{lr_at(39, tc):.2e}" == "3.05e-04"
    assert f"{lr_at(40, replace(tc, steps=60)):.2e}" == "1.12e-03"  # what the check above catches
    assert all(lr_at(s, replace(tc, schedule_steps=40)) == lr_at(s, tc) for s in range(40))  # 0 = train.steps
    with pytest.raises(ValueError, match="train.schedule_steps = -1 must be >= 0"):
        TrainConfig(schedule_steps=-1)


def test_a_config_change_record_round_trips_and_opens_its_session(tmp_path: Path) -> None:
    changes = [
        KeyChange("train.steps", 8, 12, False),
        KeyChange("recovery.reduction", "fp32", "exact", True),
        KeyChange("train.lr", 0.003, 0.001, True),
    ]
    assert [KeyChange.from_json(json.loads(json.dumps(c.as_json()))) for c in changes] == changes
    record = make(RecordKind.CONFIG_CHANGE, 5.0, changes=[c.as_json() for c in changes], kept="config.1.toml")
    assert decode(encode(record)) == record
    with pytest.raises(AssertionError, match="lacks"):
        make(RecordKind.CONFIG_CHANGE, 5.0, changes=[])
    # The record is written before the resumed session's coordinator starts: it belongs to that session.
    coordinator = {"incarnation": "a", "restored_epoch": 0, "address": "-", "status": "-"}
    records = [
        make(RecordKind.COORDINATOR, 1.0, **coordinator),
        make(RecordKind.USER, 2.0),
        record,
        make(RecordKind.COORDINATOR, 6.0, **coordinator),
        make(RecordKind.COORDINATOR, 7.0, **{**coordinator, "restored_epoch": 3}),  # a takeover: same session
    ]
    assert [[r["time"] for r in s] for s in sessions(records)] == [[1.0, 2.0], [5.0, 6.0, 7.0]]
    assert [[r["time"] for r in s] for s in sessions(records[2:])] == [[5.0, 6.0, 7.0]]


def test_every_config_of_the_run_is_kept(tmp_path: Path) -> None:
    configs = [load_config(TINY, [f"--train.steps={n}"]) for n in (8, 12, 16)]
    dump_config(configs[0], tmp_path)
    for before, after in zip(configs, configs[1:], strict=False):
        dump_resumed_config(after, tmp_path, config_changes(before, after))
    assert [load_config(tmp_path / name).train.steps for name in ("config.1.toml", "config.2.toml")] == [8, 12]
    assert load_config(tmp_path / "config.toml") == configs[2]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.1.toml",
        "config.2.toml",
        "config.toml",
        "metrics.jsonl",
    ]
    records = read_records(tmp_path, RecordKind.CONFIG_CHANGE)
    assert [r["kept"] for r in records] == ["config.1.toml", "config.2.toml"]
    assert [[KeyChange.from_json(c).words() for c in r["changes"]] for r in records] == [
        ["train.steps = 8 -> 12"],
        ["train.steps = 12 -> 16"],
    ]


def test_the_readme_names_every_key_a_resume_may_change() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("### Resuming a run", 1)[1].split("\n## ", 1)[0]
    for entry in RESUME_FREE:
        section_name, _, key = entry.partition(".")
        assert (f"{key}`" if key else f"`[{section_name}]`") in section or entry.startswith("recovery.slow"), entry
    assert "`recovery.slow*`" in section and "--resume-with-changes" in section


def _copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy, symlinks=True)
    return copy


def _unbroken(cache: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "unbroken", *args]
    if args[0] == "train":
        cmd.append(f"--data.cache_dir={cache}")
    return run_command(cmd, capture_output=True, text=True, timeout=200, env={**os.environ, **(env or {})})


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_change_of_what_the_run_computes_is_refused_and_nothing_is_written(
    tmp_path: Path, data_cache_dir: Path, tiny_run: Path
) -> None:
    run = _copy(tiny_run, tmp_path)
    before = _snapshot(run)
    token = {TOKEN_ENV: new_token()}
    plain = str(ROOT / "examples" / "plain_loop.py")
    cache = f"--data.cache_dir={data_cache_dir}"
    for args, env, message in (
        (("train", "--resume", str(run), "--train.lr=1e-3"), None, "train.lr = 0.003 -> 0.001"),
        (("train", "--resume", str(run), "--dry-run", "--train.lr=1e-3"), None, "train.lr = 0.003 -> 0.001"),
        (("launch", "--resume", str(run), "--train.lr=1e-3", plain), None, "train.lr = 0.003 -> 0.001"),
        (("coordinator", TINY, "--workers", "2", "--run-dir", str(run), "--resume", cache, "--train.seed=1"), token,
         "train.seed = 0 -> 1"),
        (("train", "--resume", str(run), "--train.steps=6"), None, "train.steps = 6 is fewer than the 8 steps"),
    ):  # fmt: skip
        result = _unbroken(data_cache_dir, *args, env=env)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, (args, result.returncode, result.stderr[-2000:])
        assert lines[0].startswith(f"unbroken: error: --resume {run}: ") and message in lines[0], (args, lines)
        assert "train.steps" in message or "add --resume-with-changes" in lines[0], lines
        assert result.stdout == "", (args, result.stdout)
    # A script run again in its run directory (``python my_train.py``: a job of one worker) resumes it: the same check.
    with pytest.raises(ValueError, match=r"train.lr = 0.003 -> 0.001 would change what the run computes"):
        Job.standalone(load_config(run / "config.toml", ["--train.lr=1e-3"]), run)
    assert _snapshot(run) == before  # config.toml, metrics.jsonl and every other file: the same bytes

    # A dry run that is allowed the change says so in its one line, and writes nothing either.
    result = _unbroken(
        data_cache_dir, "train", "--resume", str(run), "--dry-run", "--resume-with-changes", "--train.lr=1e-3"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (line,) = result.stdout.splitlines()
    assert "its config changed: train.lr = 0.003 -> 0.001 (changing what the run computes)" in line, line
    assert _snapshot(run) == before


def _steps(run: Path, session: int) -> dict[int, dict]:
    return committed_steps(sessions(read_records(run))[session])


def test_an_extension_keeps_the_schedule_and_is_recorded(tmp_path: Path, data_cache_dir: Path, tiny_run: Path) -> None:
    """The run as if interrupted after its checkpoint of step 4 (the one of step 8 removed), resumed with
    ``--train.steps=12``: steps 4-7 are trained again as they were (LR and loss, bit for bit) and steps 8-11 at the
    schedule's final LR; the change is recorded and the first config kept."""
    run = _copy(tiny_run, tmp_path)
    for path in (run / "checkpoints").glob("step_00000008*"):
        path.unlink()
    original = (run / "config.toml").read_bytes()
    tc = load_config(run / "config.toml").train
    result = _unbroken(data_cache_dir, "train", "--resume", str(run), "--workers", "2", "--quiet", "--train.steps=12")
    assert result.returncode == 0, result.stderr[-3000:]

    first, resumed = _steps(run, 0), _steps(run, 1)
    assert sorted(resumed) == list(range(4, 12)), sorted(resumed)
    assert [(resumed[s]["lr"], resumed[s]["loss"]) for s in range(4, 8)] == [
        (first[s]["lr"], first[s]["loss"]) for s in range(4, 8)
    ]
    final = lr_at(tc.steps, tc)  # the original schedule past its end
    assert final == tc.lr * tc.min_lr_ratio
    assert [resumed[s]["lr"] for s in range(8, 12)] == [final] * 4
    assert lr_at(8, replace(tc, steps=12)) != final  # the schedule recomputed over 12 steps would fail the line above

    (record,) = read_records(run, RecordKind.CONFIG_CHANGE)
    assert [KeyChange.from_json(c) for c in record["changes"]] == [
        KeyChange("train.steps", 8, 12, False),
        KeyChange("train.schedule_steps", 0, 8, False),
    ]
    assert record["kept"] == "config.1.toml" and (run / "config.1.toml").read_bytes() == original
    now = load_config(run / "config.toml").train
    assert (now.steps, now.schedule_steps) == (12, 8)
    assert sessions(read_records(run))[1][0]["type"] == RecordKind.CONFIG_CHANGE


def test_resume_with_changes_records_them_in_metrics_summary_and_report(
    tmp_path: Path, data_cache_dir: Path, tiny_run: Path
) -> None:
    run = _copy(tiny_run, tmp_path)
    original = (run / "config.toml").read_bytes()
    # Not --quiet: the summary is part of the test.
    args = ["train", "--resume", str(run), "--workers", "2", "--resume-with-changes", "--train.lr=1e-3"]
    result = _unbroken(data_cache_dir, *args, "--train.steps=10", env={"COLUMNS": "250"})
    assert result.returncode == 0, result.stderr[-3000:]

    (record,) = read_records(run, RecordKind.CONFIG_CHANGE)
    changes = {c.key: c for c in map(KeyChange.from_json, record["changes"])}
    assert changes["train.lr"] == KeyChange("train.lr", 0.003, 0.001, True)
    assert not changes["train.steps"].trajectory and set(changes) == {"train.lr", "train.steps", "train.schedule_steps"}
    assert (run / record["kept"]).read_bytes() == original  # the first session's config, kept
    tc = load_config(run / "config.toml").train
    assert (tc.lr, tc.steps, tc.schedule_steps) == (1e-3, 10, 8)
    assert [r["lr"] for r in _steps(run, 1).values()] == [lr_at(8, tc), lr_at(9, tc)] == [tc.lr * tc.min_lr_ratio] * 2

    expected = (
        "at step 8: train.steps = 8 -> 10, train.schedule_steps = 0 -> 8, train.lr = 0.003 -> 0.001 (changing what "
        "the run computes)"
    )
    rows = [line for line in result.stdout.splitlines() if "config changed" in line]
    assert len(rows) == 1 and expected in rows[0] and "the earlier config is config.1.toml" in rows[0], rows
    report = render_markdown(load_run(run), None)
    assert sum(line.startswith(f"| config changed | {expected}") for line in report.splitlines()) == 1, report
