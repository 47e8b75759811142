"""The cluster simulator: bad input, determinism, analytic and hand-computed timings, the real planner behind
it, and one check against real runs (recover, drop and restart on one kill schedule, 4 CPU workers).

The oracles: the cost model's arithmetic for a failure-free run; a 4-replica step with one kill worked out
by hand for every policy; ``unbroken.core.plan`` itself for the assignments; and the metrics of real runs for
committed tokens and wall time, the simulator calibrated only from what those runs measured.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from unbroken.core import plan as planlib
from unbroken.sim.engine import finish_offsets, makespan
from unbroken.sim.planner import Planner
from unbroken.sim.report import PLOTS, run_simulate
from unbroken.sim.scenario import load_scenario
from unbroken.sim.simulate import simulate
from unbroken.sim.timeline import build_timeline

pytestmark = pytest.mark.timeout(60)
DEAD = "none comes back"

ROOT = Path(__file__).resolve().parent.parent
# 4 replicas of 1 GPU, M = 8, a microbatch takes 1 s and the reduction 0.5 s: a failure-free step is 2.5 s.
SMALL = [
    "--cluster.gpus=4",
    "--cluster.gpus_per_replica=1",
    "--model.flavour=tiny",
    "--model.microbatches=8",
    "--cost.microbatch_s=1",
    "--cost.allreduce_s=0.5",
    "--cost.detect_s=2",
    "--cost.reform_s=1",
    "--cost.restart_s=5",
    "--run.hours=0",
    "--run.steps=10",
    "--checkpoint.every=0",
    "--checkpoint.in_place_every=0",
    "--run.policies=recover,drop,restart,mecefo,mecefo-spread",
]


def run(*overrides: str, path: Path | None = None) -> dict[str, object]:
    res = simulate(load_scenario(path, [*SMALL, *overrides]))
    return {r.policy: r for r in res.policies}


def test_importing_the_simulator_does_not_import_torch() -> None:
    code = "import sys, unbroken.sim.simulate, unbroken.sim.report, unbroken.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("overrides", "trace", "message"),
    [
        (["--run.policies=recover,resume"], None, "run.policies = 'resume' is unknown; allowed: recover"),
        (["--cost.microbatch_s=-1"], None, "cost.microbatch_s = -1.0 must be a finite number >= 0"),
        (["--cost.detect_s=0"], None, "cost.detect_s = 0.0 must be a finite number > 0"),
        (["--cost.restart_s=-5"], None, "cost.restart_s = -5.0 must be a finite number > 0"),
        (["--failures.mttr_h=-1"], None, "failures.mttr_h = -1.0 must be >= 0"),
        (["--cluster.gpus=6", "--cluster.gpus_per_replica=4"], None, "must be a multiple of cluster.gpus_per_replica"),
        (["--failures.trace=TRACE"], "time_s,gpu,event\n10,1,fail\n20,7,fail\n", "line 3: gpu 7 does not exist"),
        (["--failures.trace=TRACE"], "10,1,repair\n", "line 1: gpu 1 is repaired but not failed"),
        (["--failures.schedule=kill:worker=4,step=2"], None, "worker 4 does not exist"),
        (["--failures.schedule=slow:worker=1,factor=2,steps=1-3"], None, "the simulator models kill, hang, cut"),
        # every GPU fails within hours and nothing is ever repaired: the run cannot reach its 10,000 steps
        (["--failures.mtbf_h=1", "--failures.mttr_h=inf", "--run.steps=10000", "--run.policies=recover"], None, DEAD),
        (["--failures.trace=TRACE"], "0,0,fail\n0,1,fail\n0,2,fail\n0,3,fail\n", DEAD),
        # a failure every ~1 ms: no step of any policy can ever commit
        (["--failures.mtbf_h=1e-6"], None, "no step would ever commit"),
        (["--run.nope=1"], None, "unknown config key run.nope"),
        (["--run.policies="], None, "run.policies is empty"),
    ],
)
def test_bad_input_is_a_one_line_value_error(
    tmp_path: Path, overrides: list[str], trace: str | None, message: str
) -> None:
    if trace is not None:
        (tmp_path / "trace.csv").write_text(trace)
        overrides = [o.replace("TRACE", str(tmp_path / "trace.csv")) for o in overrides]
    with pytest.raises(ValueError) as info:
        run(*overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_cli_refuses_bad_input_with_one_line_and_status_2_before_writing(tmp_path: Path) -> None:
    scenario = tmp_path / "bad.toml"
    scenario.write_text('[run]\npolicies = ["recover", "teleport"]\n')
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "unbroken", "simulate", str(scenario), "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "'teleport' is unknown" in lines[0], lines
    assert not out.exists()
    scenario.write_text('[run]\npolicies = "recover"\n')
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "run.policies = 'recover' has the wrong type; expected a list" in result.stderr


def test_failure_free_throughput_is_the_cost_model() -> None:
    """No failures: M microbatches, ceil(M / R) on the busiest replica, FLOPs / (GPUs x peak x MFU) each,
    plus a ring all-reduce of the gradient, plus the checkpoint saves."""
    overrides = [
        "--cluster.gpus=64",
        "--cluster.gpus_per_replica=8",
        "--model.flavour=1b",
        "--model.seq_len=1024",
        "--model.microbatches=20",
        "--run.steps=1000",
        "--checkpoint.in_place_every=100",
        "--cost.save_s=7",
    ]
    sc = load_scenario(None, [*overrides, "--run.policies=recover,drop,restart"])
    res = simulate(sc)
    # The 1b flavour by hand: dim 2048, 24 layers of (4 * 2048^2 attention + 3 * 2048 * 5461 SwiGLU + 2 * 2048
    # norms), untied 32000 x 2048 embedding and output, a final norm: 1,339,082,752 parameters; the FLOPs per
    # token are 6 x (those minus the embedding) + 12 * layers * dim * seq_len.
    params = 24 * (4 * 2048**2 + 3 * 2048 * 5461 + 2 * 2048) + 2 * 32000 * 2048 + 2048
    assert params == 1_339_082_752
    flops = 6 * (params - 32000 * 2048) + 12 * 24 * 2048 * 1024
    microbatch = flops * 1024 / (8 * 312e12 * 0.4)
    ring = 2 * 7 / 8 * 2.0 * params / 8 / 25e9 + 2 * 7 * 10e-6
    step = math.ceil(20 / 8) * microbatch + ring
    assert res.failure_free_step_s == pytest.approx(step, rel=1e-12)
    by = {r.policy: r for r in res.policies}
    assert by["recover"].wall_s == pytest.approx(1000 * step + 9 * 7, rel=1e-12)  # no save after the last step
    assert by["restart"].wall_s == pytest.approx(1000 * step + 0 * 7, rel=1e-12)  # checkpoint.every = 0 here
    for r in res.policies:
        assert r.committed_tokens == 1000 * 20 * 1024 and r.failures == r.restarts == r.dropped_microbatches == 0
        assert r.tokens_per_s == pytest.approx(r.committed_tokens / r.wall_s)


def test_one_kill_worked_out_by_hand_for_every_policy() -> None:
    """Worker 1 dies in the backward of its last microbatch of step 3 (t = 7.5 + 2 - 1/3). The survivors
    finish their own work at 9.5, learn of the death at 11.17, re-form by 12.17, and then:
    recover computes the 2 orphans on 2 survivors (1 s) and reduces (0.5 s): commit at 13.67, then 6 steps
    of 3 + 0.5 s (quotas 3, 3, 2) -> 34.67. drop reduces at once: 12.67 + 21 = 33.67, 2 microbatches dropped.
    mecefo: the neighbour (worker 2) runs both orphans in efficient mode (2 x 0.86), then it runs its own 2
    and the dead one's 2 every step (4 x 0.86 + 0.5). mecefo-spread: one efficient orphan each on 2
    survivors (0.86), then 2 + 0.86 + 0.5 per step. restart: stops at the kill, detection 2 s + restart 5 s,
    no checkpoint so back to step 0, 10 steps of 3.5 s on 3 workers: 16.17 + 35 = 51.17.
    """
    by = run("--failures.schedule=kill:worker=1,step=3,phase=backward")
    kill = 7.5 + 2 - 1 / 3
    reformed = kill + 2 + 1
    expected = {
        "recover": reformed + 1 + 0.5 + 6 * 3.5,
        "drop": reformed + 0.5 + 6 * 3.5,
        "mecefo": reformed + 2 * 0.86 + 0.5 + 6 * (4 * 0.86 + 0.5),
        "mecefo-spread": reformed + 0.86 + 0.5 + 6 * (2 + 0.86 + 0.5),
        "restart": kill + 2 + 5 + 10 * 3.5,
    }
    for policy, wall in expected.items():
        assert by[policy].wall_s == pytest.approx(wall, abs=1e-9), policy
        assert by[policy].failures == 1
    assert by["drop"].committed_microbatches == 78 and by["drop"].dropped_microbatches == 2
    for policy in ("recover", "mecefo", "mecefo-spread", "restart"):
        assert by[policy].committed_microbatches == 80 and by[policy].dropped_microbatches == 0
    assert by["restart"].restarts == 1 and by["restart"].recomputed_microbatches == 3 * 8
    assert by["restart"].lost_s["rollback"] == pytest.approx(kill)
    assert by["recover"].lost_s["detection"] == pytest.approx(kill + 2 - 9.5)
    assert by["recover"].lost_s["re-formation"] == pytest.approx(1.0)


def test_restart_rolls_back_to_the_last_checkpoint() -> None:
    by = run("--failures.schedule=kill:worker=1,step=7,phase=start", "--checkpoint.every=5", "--cost.save_s=0.25")
    r = by["restart"]
    # steps 0-4 (12.5 s), a save (0.25 s), steps 5-6 (5 s): the kill at 17.75 rolls back to step 5
    assert r.lost_s["rollback"] == pytest.approx(5.0)
    assert r.recomputed_microbatches == 2 * 8
    assert r.wall_s == pytest.approx(17.75 + 2 + 5 + 5 * 3.5)  # steps 5-9 on 3 workers, no save at the end


def test_recover_keeps_every_microbatch_and_drop_does_not() -> None:
    overrides = ["--run.steps=3000", "--failures.mtbf_h=0.5", "--failures.mttr_h=0.25", "--checkpoint.every=50"]
    by = run(*overrides)
    failure_free = run("--run.steps=3000")["recover"]
    assert by["recover"].failures > 10
    for policy in ("recover", "mecefo", "mecefo-spread", "restart"):
        assert by[policy].committed_microbatches == failure_free.committed_microbatches == 3000 * 8
        assert by[policy].wall_s > failure_free.wall_s
    assert by["recover"].recomputed_microbatches > 0
    assert by["drop"].dropped_microbatches > 0
    assert by["drop"].committed_microbatches == 3000 * 8 - by["drop"].dropped_microbatches


def test_same_seed_same_run_and_another_seed_another() -> None:
    overrides = ["--run.steps=0", "--run.hours=2", "--failures.mtbf_h=0.7", "--failures.mttr_h=0.2"]
    a, b = run(*overrides), run(*overrides)
    c = run(*overrides, "--failures.seed=1")
    for policy in a:
        assert a[policy].wall_s == b[policy].wall_s and a[policy].committed_tokens == b[policy].committed_tokens
        assert a[policy].lost_s == b[policy].lost_s
        assert np.array_equal(a[policy].series_t, b[policy].series_t)
    assert any(a[p].committed_tokens != c[p].committed_tokens for p in a)


def test_the_plans_are_unbroken_plan_s() -> None:
    """The canonical plans the simulator caches, relabelled, are exactly plan.plan_step / plan_ids."""
    rng = random.Random(0)
    for _ in range(200):
        num_microbatches = rng.randint(1, 40)
        planner = Planner(num_microbatches, 64)
        members = rng.sample(range(64), rng.randint(1, 20))
        step = rng.randint(0, 10**6)
        assert planner.assignment(step, members) == planlib.plan_step(step, members, num_microbatches)
        todo = rng.sample(range(num_microbatches), rng.randint(0, num_microbatches))
        assert planner.recovery(step, members, todo) == planlib.plan_ids(step, members, todo, num_microbatches)


def test_every_policy_calls_the_real_planner(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, int] = {}

    def spy(name: str):  # noqa: ANN202
        real = getattr(planlib, name)

        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)

        return wrapper

    overrides = ["--failures.schedule=kill:worker=1,step=3,phase=backward; kill:worker=3,step=5,phase=forward"]
    reference = run(*overrides)
    for name in ("plan_step", "plan_ids", "mecefo_plan"):
        monkeypatch.setattr(planlib, name, spy(name))
    spied = run(*overrides)
    assert calls["plan_step"] >= 2 and calls["plan_ids"] >= 1 and calls["mecefo_plan"] >= 4, calls
    assert {p: r.wall_s for p, r in spied.items()} == {p: r.wall_s for p, r in reference.items()}


def test_shared_cores_time_share_like_processes() -> None:
    work = np.array([2.0, 2.0, 2.0, 2.0])
    assert np.allclose(finish_offsets(work, 2), [4, 4, 4, 4])  # 4 jobs on 2 cores: half speed each
    assert np.allclose(finish_offsets(np.array([3.0, 3.0, 2.0]), 2), [4, 4, 3])  # 2/3 speed, then full
    assert makespan(np.array([3.0, 1.0]), 0) == 3.0  # own devices


def test_trace_spares_and_repairs_make_the_replica_timeline(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,gpu,event\n100,3,fail\n150,2,fail\n400,3,repair\n900,2,repair\n")
    pair = ["--cluster.gpus=8", "--cluster.gpus_per_replica=2", f"--failures.trace={trace}"]
    tl = build_timeline(load_scenario(None, pair), 10_000)
    # replica 1 (GPUs 2, 3) is down from the first failure until both are repaired
    assert list(zip(tl.times, tl.replicas, tl.up, strict=True)) == [(100, 1, False), (900, 1, True)]
    assert tl.gpu_hours(3600.0) == pytest.approx((8 * 3600 - 300 - 750) / 3600)
    tl = build_timeline(load_scenario(None, [*pair, "--cluster.spares=1", "--cost.spare_swap_s=60"]), 10_000)
    # the spare takes GPU 3's place at 160 s; GPU 3, repaired at 400 s, becomes the spare for GPU 2's place
    assert list(zip(tl.times, tl.replicas, tl.up, strict=True)) == [(100, 1, False), (460, 1, True)]
    assert list(zip(tl.count_times, tl.counts, strict=True)) == [(100, 7), (150, 6), (160, 7), (460, 8)]
    assert tl.gpu_hours(3600.0) == pytest.approx((8 * 3600 - 50 - 2 * 10 - 300) / 3600)


def test_recover_512_preset_and_the_cli_outputs(tmp_path: Path) -> None:
    for preset in sorted((ROOT / "configs" / "sim").glob("*.toml")):
        load_scenario(preset)
    pytest.importorskip("matplotlib")
    out = tmp_path / "sim"
    preset = ROOT / "configs" / "sim" / "recover_512.toml"
    assert run_simulate(str(preset), ["--run.hours=1", "--run.report_gpu_hours=100"], out) == 0
    for name in ("scenario.toml", "summary.md", "results.json", *PLOTS):
        assert (out / name).stat().st_size > 0, name
    assert load_scenario(out / "scenario.toml").run.hours == 1.0  # the resolved scenario reproduces the run
