"""One starting state: before the first step every member takes the leader's parameters, buffers and optimizer
state if its own differ (as DDP broadcasts rank 0's at construction), a ``start_state`` record says which
workers differed, and in exact mode the console warns at step 0. The script is examples/plain_loop.py with its
``torch.manual_seed`` line replaced: each worker then builds its own random weights. Each worker prints a
checksum of its parameters after every commit into its own log, so "identical at every step" is read from the
workers themselves, not from the library's final record alone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from runner import EXACT, ONE_THREAD, ROOT, run_command

from unbroken.core.records import read_records
from unbroken.ft.checkpoint import schema as ckpt

pytestmark = pytest.mark.timeout(240)

PLAIN = ROOT / "examples" / "plain_loop.py"
SEED_LINE = "    torch.manual_seed(seed)  # every worker starts from the same weights\n"
STEPS = 4
COMMON = [ONE_THREAD, f"--train.steps={STEPS}", "--checkpoint.every=0"]
CHECKSUM = (
    "        print('params', step.index, __import__('hashlib').sha256(b''.join("
    "p.detach().numpy().tobytes() for p in model.parameters())).hexdigest(), flush=True)\n"
)


def script(tmp_path: Path, seeding: str) -> Path:
    """plain_loop.py with ``seeding`` in place of its seed line, printing its parameters' checksum per step."""
    text = PLAIN.read_text()
    assert SEED_LINE in text
    text = text.replace(SEED_LINE, seeding)
    commit = "        result = step.commit(optimizer, clip_grad_norm=1.0)\n"
    assert commit in text
    text = text.replace(commit, commit + CHECKSUM)
    path = tmp_path / "loop.py"
    path.write_text(text)
    return path


def launch(out: Path, loop: Path, *args: str) -> tuple[str, str]:
    cmd = [sys.executable, "-m", "unbroken", "launch", "--workers", "3", "--out", str(out), "--quiet"]
    result = run_command([*cmd, *COMMON, *args, str(loop)], capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, result.stderr


def per_step_checksums(out: Path) -> dict[int, list[str]]:
    """Each worker's printed parameter checksums, by worker, in step order."""
    sums: dict[int, list[str]] = {}
    for w in range(3):
        lines = (out / "logs" / f"worker-{w}.log").read_text().splitlines()
        sums[w] = [line.split()[2] for line in lines if line.startswith("params ")]
    return sums


def test_unseeded_workers_start_from_the_leaders_state_and_exact_mode_warns_at_step_0(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _, stderr = launch(out, script(tmp_path, "    pass  # no seed: each worker draws its own weights\n"), EXACT)
    (start,) = read_records(out, "start_state")
    assert start["differed"] == [1, 2] and start["source"] == 0 and start["warn"]
    assert start["state_bytes"] > 0
    warnings = [line for line in stderr.splitlines() if "starting state" in line]
    assert len(warnings) == 1 and warnings[0].startswith("unbroken: warning: step 0:"), stderr[-3000:]
    assert "without a fixed seed" in warnings[0]
    sums = per_step_checksums(out)
    assert len(sums[0]) == STEPS and sums[0] == sums[1] == sums[2]  # identical after every step
    (final,) = read_records(out, "final")
    assert final["identical"]


def test_a_run_whose_leader_alone_is_seeded_is_the_seeded_run(tmp_path: Path) -> None:
    """Worker 0 (the leader at the start) seeds as the example does, the others do not: the run is bitwise the
    example's, where every worker seeds; there, nothing differs and nothing is sent."""
    seeded, leader_only = tmp_path / "seeded", tmp_path / "leader_only"
    launch(seeded, script(tmp_path, SEED_LINE), EXACT)
    (start,) = read_records(seeded, "start_state")
    assert start["differed"] == [] and start["state_bytes"] == 0 and not start["warn"]
    only = "    if os.environ['UNBROKEN_WORKER_ID'] == '0':\n    " + SEED_LINE
    loop = script(tmp_path, "    import os\n" + only)
    launch(leader_only, loop, EXACT)
    assert read_records(leader_only, "start_state")[0]["differed"] == [1, 2]
    a, b = ckpt.verify(seeded, STEPS), ckpt.verify(leader_only, STEPS)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert [r["loss"] for r in read_records(seeded, "step")] == [r["loss"] for r in read_records(leader_only, "step")]


def test_without_exact_mode_the_difference_is_healed_without_a_warning(tmp_path: Path) -> None:
    out = tmp_path / "run"
    stdout, stderr = launch(out, script(tmp_path, "    pass\n"))
    (start,) = read_records(out, "start_state")
    assert start["differed"] == [1, 2] and not start["warn"]
    assert "starting state" not in stderr, stderr[-3000:]
    sums = per_step_checksums(out)
    assert len(sums[0]) == STEPS and sums[0] == sums[1] == sums[2]
