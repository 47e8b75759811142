"""``unbroken report`` on real runs: a kill-and-rejoin run against its failure-free reference (exact
reduction, so the report must claim bitwise equality), a ``drop`` run against the same reference (it must
not), and bad input, which exits 2 with one line and writes nothing."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from runner import RECOVERY_SCHEDULE, RECOVERY_STEPS, ROOT, recomputed_by_the_recoveries, run_command

from unbroken.cli import main
from unbroken.core.failures import FailureSchedule
from unbroken.core.goodput import Bucket, account
from unbroken.core.records import read_records
from unbroken.lab.report import PLOTS, load_run, render_markdown

pytestmark = pytest.mark.timeout(300)

KILL = FailureSchedule.parse(RECOVERY_SCHEDULE).events[0].describe()  # worker 2's kill; it rejoins


@pytest.fixture(scope="module")
def runs(recovery_runs: dict[str, Path]) -> dict[str, Path]:
    """Three real runs of tests/conftest.py (shared with tests/test_recovery.py), all with ``reduction =
    exact``: the failure-free reference, two kills and a rejoin, and the same kills under ``drop``."""
    return {
        "ref": recovery_runs["exact_ref"],
        "kill": recovery_runs["exact_failures"],
        "drop": recovery_runs["drop_failures"],
    }


def _check_png(path: Path, colours: list[str]) -> None:
    """A real PNG of a drawn plot: the signature, a sensible size, many colours, and the given line colours."""
    from matplotlib.colors import to_rgb
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    pixels = imread(path)[..., :3]
    assert pixels.shape[0] >= 200 and pixels.shape[1] >= 600, (path, pixels.shape)
    flat = pixels.reshape(-1, 3)
    assert len(np.unique(flat, axis=0)) > 100, f"{path} is nearly blank"
    for colour in colours:
        assert (np.abs(flat - to_rgb(colour)).max(axis=1) < 0.05).sum() > 20, f"{path}: nothing drawn in {colour}"


def _report(*args: str | Path) -> tuple[int, str]:
    """``unbroken report ...`` in a fresh interpreter, so the test also sees that the report imports no torch."""
    code = (
        "import sys\nfrom unbroken.cli import main\nrc = main(sys.argv[1:])\n"
        "assert 'torch' not in sys.modules, 'unbroken report imported torch'\nsys.exit(rc)"
    )
    result = run_command(
        [sys.executable, "-c", code, "report", *map(str, args)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    return result.returncode, result.stdout + result.stderr


def test_importing_the_report_imports_neither_torch_nor_matplotlib() -> None:
    code = "import sys, unbroken.lab.report; assert not {'torch', 'matplotlib'} & set(sys.modules), sorted(sys.modules)"
    result = run_command([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]


def test_report_of_a_kill_and_rejoin_run_claims_bitwise_equality_with_its_reference(runs: dict[str, Path]) -> None:
    rc, output = _report(runs["kill"], runs["ref"])
    assert rc == 0, output
    out = runs["kill"] / "report"
    _check_png(out / "loss.png", ["C0", "C1"])  # the run's loss and the difference curve
    _check_png(out / "throughput.png", ["C0", "C3"])  # throughput and the failure line
    _check_png(out / "membership.png", ["C3", "C1"])  # fault-injected and detected markers
    _check_png(out / "goodput.png", ["C3"])  # the badput bars
    md = (out / "report.md").read_text()
    goodput = account(read_records(runs["kill"]))
    assert goodput.line() + "." in md  # the run's account, and each of its buckets in the table
    assert f"| detection | {goodput.buckets[Bucket.DETECTION]:.2f} |" in md and goodput.buckets[Bucket.DETECTION] > 0

    failures = [f for f in read_records(runs["kill"], "failure") if f["worker"] == 2]
    assert len(failures) == 1 and "detection_s" in failures[0], failures
    row = next(line for line in md.splitlines() if f"`{KILL}`" in line)
    assert f"| {failures[0]['detection_s'] * 1000:.0f} ms |" in row, row  # the detection time, in ms
    recovery = next(r for r in read_records(runs["kill"], "recovery") if r["epoch"] >= failures[0]["epoch"])
    published = next(m["time"] for m in read_records(runs["kill"], "membership") if m["epoch"] == recovery["epoch"])
    formed = f"{(recovery['time_reformed'] - published) * 1000:.0f} ms"
    assert f"| {recovery['step']} | {recovery['reform_s'] * 1000:.0f} ms | {formed} |" in row, row
    rejoined = [m for m in read_records(runs["kill"], "membership") if m["reason"].startswith("joined")]
    assert md.count("| worker 2 |") == len(rejoined)
    assert f"2 recovered in-step, {len(rejoined)} rejoined" in md  # two kills; a rejoin is not a recovery
    assert f"| microbatches | {recomputed_by_the_recoveries(runs['kill'])} recomputed in-step, 0 dropped" in md, md
    assert "validation | loss " in md and f"| steps | {RECOVERY_STEPS} of {RECOVERY_STEPS} " in md
    assert "loss trajectories bitwise equal: **yes**" in md
    assert "max |loss difference|: 0\n" in md
    assert "final parameters identical (checksums): **yes**" in md


def test_report_of_a_drop_run_says_it_is_not_the_reference(runs: dict[str, Path], tmp_path: Path) -> None:
    assert main(["report", str(runs["drop"]), str(runs["ref"]), "--out", str(tmp_path / "drop")]) == 0
    assert not (runs["drop"] / "report").exists()  # --out replaces the default location
    for name in PLOTS:
        _check_png(tmp_path / "drop" / name, [])
    md = (tmp_path / "drop" / "report.md").read_text()
    assert f"{RECOVERY_STEPS} steps in common" in md  # the same steps: the difference is in the values
    assert "loss trajectories bitwise equal: **no**" in md
    worst = re.search(r"max \|loss difference\|: ([0-9.e-]+) \(step (\d+)\)", md)
    assert worst and float(worst[1]) > 0 and int(worst[2]) >= 5, md  # identical until work was dropped
    assert "final parameters identical (checksums): **no**" in md
    assert re.search(r"0 recomputed in-step, [1-9]\d* dropped", md), md


def test_report_without_a_reference_has_no_comparison(runs: dict[str, Path], tmp_path: Path) -> None:
    assert main(["report", str(runs["ref"]), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    assert "## Failures survived: 0" in md and "reference" not in md
    _check_png(tmp_path / "loss.png", ["C0"])


def _copy_run(src: Path, dst: Path) -> Path:
    dst.mkdir()
    shutil.copy(src / "metrics.jsonl", dst / "metrics.jsonl")
    shutil.copy(src / "config.toml", dst / "config.toml")
    return dst


def test_malformed_metrics_exit_2_and_write_nothing(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _copy_run(runs["kill"], tmp_path / "bad")
    lines = (bad / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[5] = lines[5][: len(lines[5]) // 2] + "\n"
    (bad / "metrics.jsonl").write_text("".join(lines))
    capsys.readouterr()
    assert main(["report", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("unbroken: error: ") and "metrics.jsonl:6: malformed JSON" in err and "\n" not in err
    # A bad reference also leaves the (good) run untouched.
    assert main(["report", str(runs["ref"]), str(bad)]) == 2
    assert "metrics.jsonl:6" in capsys.readouterr().err
    assert sorted(p.name for p in bad.iterdir()) == ["config.toml", "metrics.jsonl"]
    assert not (runs["ref"] / "report").exists()


def test_a_torn_last_line_is_ignored_and_noted(runs: dict[str, Path], tmp_path: Path) -> None:
    """What a killed coordinator leaves behind: half a line and no newline. The run is still reported."""
    torn = _copy_run(runs["kill"], tmp_path / "torn")
    text = (torn / "metrics.jsonl").read_text()
    (torn / "metrics.jsonl").write_text(text + text.splitlines()[-1][:20])
    assert main(["report", str(torn)]) == 0
    assert "the last line of metrics.jsonl was cut off" in (torn / "report" / "report.md").read_text()


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "no such directory"),
        ("empty", "not a run directory (no metrics.jsonl)"),
        ("no-steps", "records no training step"),
    ],
)
def test_bad_run_directories_exit_2_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str, message: str
) -> None:
    run = tmp_path / "run"
    if setup != "missing":
        run.mkdir()
    if setup == "no-steps":  # a run that died before its first step: only its first epoch was recorded
        (run / "metrics.jsonl").write_text(
            '{"elapsed_s": 9.2, "epoch": 1, "members": [0, 1], "reason": "start", "time": 1.0, "type": "membership"}\n'
        )
    out = tmp_path / "out"
    assert main(["report", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_the_configuration_line_names_the_model_that_was_trained(tmp_path: Path) -> None:
    """A Hugging Face run keeps the default ``model.flavour`` in its config: the report names the Hugging Face
    config it trained, not the flavour it ignored."""
    run = tmp_path / "run"
    run.mkdir()
    step = {"type": "step", "step": 0, "loss": 9.0, "time": 2.0, "tokens": 512, "step_time_s": 0.5}
    (run / "metrics.jsonl").write_text(json.dumps(step) + "\n")
    (run / "config.toml").write_text('[model]\nflavour = "small"\nhf_config = "llama-tiny"\n')
    md = render_markdown(load_run(run), None)
    assert "model: Hugging Face `llama-tiny`" in md and "small" not in md
    (run / "config.toml").write_text('[model]\nflavour = "tiny"\nhf_config = ""\n')
    assert "model.flavour `tiny`" in render_markdown(load_run(run), None)
