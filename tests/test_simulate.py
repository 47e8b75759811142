"""The cluster simulator: bad input, determinism, analytic and hand-computed timings, the real planner behind
it, and one check against real runs (recover, drop and restart on one kill schedule, 4 CPU workers).

The oracles: the cost model's arithmetic for a failure-free run and for replicas of 1 to 64 GPUs; a
4-replica step with one kill worked out by hand for every policy; one GPU failure in replicas of 1, 2 and 4
GPUs, and in replicas of 2 pipeline stages, worked out by hand; the replica timeline re-derived from the GPU
events; ``unbroken.core.plan`` itself for the assignments. (The comparison with real runs is
``unbroken bench simulator``.)
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from unbroken.cli import main
from unbroken.core import plan as planlib
from unbroken.core.goodput import Bucket
from unbroken.sim.engine import BUCKET_OF, LOST_CAUSES, finish_offsets, makespan
from unbroken.sim.planner import Planner
from unbroken.sim.report import PLOTS, run_simulate
from unbroken.sim.scenario import HOUR, Costs, load_scenario
from unbroken.sim.simulate import simulate
from unbroken.sim.sweep import format_sweep, parse_sweeps, run_points
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
        (["--checkpoint.every_s=-1"], None, "checkpoint.every_s = -1.0 must be a finite number >= 0"),
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
    # The same seconds in a real run's goodput buckets: detection, reformation, the rest of losing a worker.
    badput = by["recover"].badput()
    assert badput[Bucket.DETECTION] == pytest.approx(kill + 2 - 9.5) and badput[Bucket.REFORMATION] == 1.0
    assert sum(badput.values()) == pytest.approx(sum(by["recover"].lost_s.values()))
    assert by["restart"].badput()[Bucket.RESTART] == pytest.approx(
        sum(by["restart"].lost_s[c] for c in ("restart", "rollback", "idle"))
    )
    assert set(BUCKET_OF) == set(LOST_CAUSES)


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


# -- replicas of g GPUs: one GPU failure takes the whole replica down -------------------------------------


def _params_1b() -> int:
    """The 1b flavour's parameters by hand (as in test_failure_free_throughput_is_the_cost_model)."""
    return 24 * (4 * 2048**2 + 3 * 2048 * 5461 + 2 * 2048) + 2 * 32000 * 2048 + 2048


@pytest.mark.parametrize("g", [1, 8, 64])
def test_the_cost_model_shares_a_microbatch_the_gradient_and_the_state_over_a_replica_s_gpus(g: int) -> None:
    """A microbatch's FLOPs are spread over the replica's g GPUs; each GPU all-reduces its 1/g of the bf16
    gradient in its own ring over the R = 512 / g replicas; a rejoining GPU receives its 1/g of the 12 bytes
    per parameter of state (fp32 weights, two AdamW moments) from its peer, all g GPUs in parallel."""
    sc = load_scenario(None, ["--cluster.gpus=512", f"--cluster.gpus_per_replica={g}", "--model.flavour=1b"])
    c = Costs.of(sc)
    params, replicas = _params_1b(), 512 // g
    flops = (6 * (params - 32000 * 2048) + 12 * 24 * 2048 * 2048) * 2048
    assert c.microbatch_s == pytest.approx(flops / (g * 312e12 * 0.4), rel=1e-12)
    ring = 2 * (replicas - 1) / replicas * 2.0 * params / g / 25e9 + 2 * (replicas - 1) * 10e-6
    assert c.allreduce_s(replicas) == pytest.approx(ring, rel=1e-12)
    assert c.rejoin_s == pytest.approx(10.0 + 12.0 * params / g / 25e9, rel=1e-12)
    # M = 512 over 512 GPUs: 512 / R microbatches of 1/g of the FLOPs each, the same compute for every g
    one_step = ["--run.hours=0", "--run.steps=1", "--run.policies=recover"]
    res = simulate(
        load_scenario(None, ["--cluster.gpus=512", f"--cluster.gpus_per_replica={g}", "--model.flavour=1b", *one_step])
    )
    assert res.failure_free_step_s == pytest.approx(flops / (312e12 * 0.4) + ring, rel=1e-12)


# 8 GPUs in replicas of g: a microbatch takes 1 GPU-second, so 1/g s on a replica; M = 8 gives each of the 8/g
# replicas g microbatches, 1 s of compute, and with the 0.5 s reduction a failure-free step takes 1.5 s.
GPU_FAILURE = [
    "--cluster.gpus=8",
    "--model.flavour=tiny",
    "--model.microbatches=8",
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


@pytest.mark.parametrize("g", [1, 2, 4])
def test_one_gpu_failure_takes_its_whole_replica_down_worked_out_by_hand(tmp_path: Path, g: int) -> None:
    """GPU 5 fails at 4.75 s, a quarter into step 3 (which starts at 4.5 s), and is never repaired. It takes
    down replica 5 // g and with it that replica's g GPUs and g microbatches; the other R - 1 = 8 / g - 1
    replicas go on. recover: they finish their own work (5.5 s), learn of the death (6.75 s), re-form
    (7.75 s), recompute the g orphans (ceil(g / (R - 1)) on the busiest, 1/g s each) and reduce; then 6 steps
    with ceil(8 / (R - 1)) microbatches on the busiest. drop: the same without the orphans (g dropped).
    restart: stops at 4.75 s, detection 2 s + restart 5 s, no checkpoint: all 10 steps again on R - 1.
    mecefo and mecefo-spread lose the same replica (their timing is worked out in the 4-replica test)."""
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,gpu,event\n4.75,5,fail\n")
    overrides = [*GPU_FAILURE, f"--cluster.gpus_per_replica={g}", f"--cost.microbatch_s={1 / g}"]
    res = simulate(load_scenario(None, [*overrides, f"--failures.trace={trace}"]))
    by = {r.policy: r for r in res.policies}
    survivors = 8 // g - 1
    step_after = math.ceil(8 / survivors) / g + 0.5
    reformed = 4.75 + 2 + 1
    expected = {
        "recover": reformed + math.ceil(g / survivors) / g + 0.5 + 6 * step_after,
        "drop": reformed + 0.5 + 6 * step_after,
        "restart": 4.75 + 2 + 5 + 10 * step_after,
    }
    tl = res.timeline
    assert list(zip(tl.times, tl.replicas, tl.up, strict=True)) == [(4.75, 5 // g, False)]
    assert tl.gpu_failures == tl.replica_failures == 1
    for policy, wall in expected.items():
        assert by[policy].wall_s == pytest.approx(wall, abs=1e-9), policy
    for policy, r in by.items():
        assert r.failures == 1 and r.series_members[-1] == survivors, policy
        # the g - 1 healthy GPUs of the dead replica stay held (idle); only GPU 5 stops counting
        assert r.gpu_hours == pytest.approx((8 * r.wall_s - (r.wall_s - 4.75)) / HOUR), policy
    for policy in ("recover", "mecefo", "mecefo-spread"):
        assert by[policy].recomputed_microbatches == g and by[policy].committed_microbatches == 80, policy
    assert by["drop"].dropped_microbatches == g and by["drop"].committed_microbatches == 80 - g
    assert by["restart"].recomputed_microbatches == 3 * 8 and by["restart"].restarts == 1
    assert by["restart"].lost_s["rollback"] == pytest.approx(4.75)


def test_one_gpu_failure_in_pipelined_replicas_worked_out_by_hand(tmp_path: Path) -> None:
    """Issue 30: 8 GPUs in 4 replicas of 2 stages, M = 8, a stage's microbatch 0.5 s, reduction 0.5 s: a replica's pass
    over its 2 microbatches is (2 + 1) x 0.5 s, a failure-free step 2 s. GPU 5 fails at 6.5 s, a quarter into
    step 3, and takes replica 2 down for good. recover: the 3 survivors finish their own pass (7.5 s), learn
    of the death (8.5 s), re-form (9.5 s), and run the 2 orphans as a pass of their own, one on each of two
    survivors ((1 + 1) x 0.5 s), then reduce (11 s); then 6 steps of 3 microbatches on the busiest,
    (3 + 1) x 0.5 + 0.5 = 2.5 s. mecefo: the neighbour, replica 3, runs both orphans efficiently as a pass
    ((2 x 0.86 + 1) x 0.5 s), then its own 2 and the dead one's 2, all efficient, every step
    ((4 x 0.86 + 1) x 0.5 + 0.5 s). mecefo-spread: one efficient orphan on each of two survivors
    ((0.86 + 1) x 0.5 s), then 2 exact and 1 efficient on those two every step ((2 + 0.86 + 1) x 0.5 + 0.5 s).
    restart: stops at 6.5 s, detection 2 s + restart 5 s, no checkpoint: all 10 steps again, 2.5 s each."""
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,gpu,event\n6.5,5,fail\n")
    overrides = [*GPU_FAILURE, "--cluster.pipeline=2", "--cost.microbatch_s=0.5"]
    overrides.append(f"--failures.trace={trace}")
    res = simulate(load_scenario(None, overrides))
    assert res.failure_free_step_s == pytest.approx(2.0)
    by = {r.policy: r for r in res.policies}
    assert by["recover"].wall_s == pytest.approx(9.5 + 1.0 + 0.5 + 6 * 2.5)
    assert by["mecefo"].wall_s == pytest.approx(9.5 + (2 * 0.86 + 1) * 0.5 + 0.5 + 6 * ((4 * 0.86 + 1) * 0.5 + 0.5))
    assert by["mecefo-spread"].wall_s == pytest.approx(9.5 + (0.86 + 1) * 0.5 + 0.5 + 6 * ((2.86 + 1) * 0.5 + 0.5))
    assert by["drop"].wall_s == pytest.approx(9.5 + 0.5 + 6 * 2.5)
    assert by["restart"].wall_s == pytest.approx(6.5 + 2 + 5 + 10 * 2.5)
    assert by["recover"].recomputed_microbatches == 2 and by["recover"].committed_microbatches == 80


@pytest.mark.parametrize("random_repair", [False, True])
def test_every_replica_size_sees_the_same_gpu_failures(random_repair: bool) -> None:
    """512 GPUs failing and being repaired at random (per-GPU MTBF 3,000 h, back after 4 h, 30 days): the GPU
    events do not depend on gpus_per_replica, and a replica of g GPUs is down from the first failure of one of
    its GPUs to the repair of the last; re-derived here from the 1-GPU timeline, whose replicas are the GPUs."""
    base = ["--cluster.gpus=512", "--failures.mtbf_h=3000", "--failures.mttr_h=4"]
    base.append(f"--failures.random_repair={str(random_repair).lower()}")
    horizon = 720 * HOUR
    per_gpu = build_timeline(load_scenario(None, [*base, "--cluster.gpus_per_replica=1"]), horizon)
    assert per_gpu.gpu_failures > 100
    for g in (8, 64):
        tl = build_timeline(load_scenario(None, [*base, f"--cluster.gpus_per_replica={g}"]), horizon)
        assert tl.gpu_failures == per_gpu.gpu_failures
        assert np.array_equal(tl.count_times, per_gpu.count_times) and np.array_equal(tl.counts, per_gpu.counts)
        down = np.zeros(512 // g, dtype=int)
        expected = []
        for t, gpu, up in zip(per_gpu.times, per_gpu.replicas, per_gpu.up, strict=True):
            replica = int(gpu) // g
            down[replica] += -1 if up else 1
            if down[replica] == (0 if up else 1):
                expected.append((float(t), replica, bool(up)))
        assert list(zip(tl.times.tolist(), tl.replicas.tolist(), tl.up.tolist(), strict=True)) == expected
        assert tl.replica_failures == sum(1 for e in expected if not e[2]) <= tl.gpu_failures
    # with 64-GPU replicas some GPUs fail in a replica that is already down: they take nothing more down
    assert tl.replica_failures < tl.gpu_failures


def _repair_times(random_repair: bool, hours: float) -> tuple[list[tuple[float, int, bool]], list[float]]:
    """The 1-GPU timeline's events (GPU = replica) and each repair's duration."""
    overrides = ["--cluster.gpus=512", "--cluster.gpus_per_replica=1", "--failures.mtbf_h=3000"]
    overrides += ["--failures.mttr_h=4", f"--failures.random_repair={str(random_repair).lower()}"]
    tl = build_timeline(load_scenario(None, overrides), hours * HOUR)
    events = list(zip(tl.times.tolist(), tl.replicas.tolist(), tl.up.tolist(), strict=True))
    failed_at: dict[int, float] = {}
    durations = []
    for t, gpu, up in events:
        if up:
            durations.append(t - failed_at.pop(gpu))
        else:
            failed_at[gpu] = t
    return events, durations


def test_random_repairs_are_exponential_and_a_longer_horizon_only_adds_events() -> None:
    """Fixed repairs take exactly mttr_h. Random ones are exponential of mean mttr_h: their sample mean lies
    within 5 standard errors (4 h / sqrt(n)) of 4 h, and about 1 - 1/e of them are shorter than the mean.
    Each GPU's repair draws do not depend on the horizon, so the first 360 h are the same in a 720 h run."""
    _, fixed = _repair_times(False, 720)
    assert fixed and all(d == pytest.approx(4 * HOUR) for d in fixed)
    events, durations = _repair_times(True, 720)
    n = len(durations)
    assert n > 100
    assert abs(np.mean(durations) - 4 * HOUR) < 5 * 4 * HOUR / math.sqrt(n)
    shorter = sum(d < 4 * HOUR for d in durations) / n
    assert abs(shorter - (1 - math.exp(-1))) < 5 * math.sqrt(0.25 / n)
    half, _ = _repair_times(True, 360)
    assert half == [e for e in events if e[0] < 360 * HOUR]


def test_checkpoint_intervals_in_seconds_are_whole_failure_free_steps() -> None:
    """The 4-replica scenario's failure-free step is 2.5 s: 12 s is 5 steps (4.8 rounded), 0.1 s at least 1."""
    kill = "--failures.schedule=kill:worker=1,step=7,phase=start"
    in_steps = run(kill, "--checkpoint.every=5", "--cost.save_s=0.25", "--checkpoint.in_place_every=5")
    res = simulate(
        load_scenario(
            None, [*SMALL, kill, "--checkpoint.every_s=12", "--cost.save_s=0.25", "--checkpoint.in_place_every_s=12"]
        )
    )
    assert (res.scenario.checkpoint.every, res.scenario.checkpoint.in_place_every) == (5, 5)
    assert {r.policy: r.wall_s for r in res.policies} == {p: r.wall_s for p, r in in_steps.items()}
    assert res.policies[2].lost_s["rollback"] == pytest.approx(5.0)  # restart: back to step 5, as in steps
    tiny = simulate(load_scenario(None, [*SMALL, "--checkpoint.every_s=0.1"]))
    assert tiny.scenario.checkpoint.every == 1


def test_a_sweep_runs_the_scenario_at_every_point(tmp_path: Path) -> None:
    """Each point of a sweep is the plain simulation with the swept value as an override (the first axis
    varies slowest), and the table has one row per point and policy with the hand-worked walls above."""
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,gpu,event\n4.75,5,fail\n")
    overrides = [o for o in GPU_FAILURE if not o.startswith("--run.policies=")]
    overrides += [f"--failures.trace={trace}", "--cost.microbatch_s=0.5"]
    axes = parse_sweeps(["cluster.gpus_per_replica=1,2,4", "--run.policies=recover,restart"], overrides)
    points = run_points(None, overrides, axes)
    assert [p.settings for p in points] == [
        (("cluster.gpus_per_replica", g), ("run.policies", policies))
        for g in ("1", "2", "4")
        for policies in ("recover", "restart")
    ]
    for p in points:
        alone = simulate(load_scenario(None, [*overrides, *(f"--{k}={v}" for k, v in p.settings)]))
        assert [r.wall_s for r in p.result.policies] == [r.wall_s for r in alone.policies]
    table = format_sweep(points).splitlines()
    assert len(table) == 2 + 6  # header, rule, one row per point (one policy each)
    # g = 2, recover: a 0.5 s microbatch, 4 replicas of 2 microbatches; the dead one's 2 on 2 of the 3
    # survivors (0.5 s), then 3 on the busiest (1.5 s) for 6 steps
    assert table[4].startswith("| 2 | recover | 4 | recover |")
    assert points[2].result.policies[0].wall_s == pytest.approx(7.75 + 0.5 + 0.5 + 6 * 2.0)


@pytest.mark.parametrize(
    ("sweeps", "overrides", "message"),
    [
        (["cluster.gpus_per_replica"], [], "is malformed; expected SECTION.KEY=V1,V2"),
        (["gpus_per_replica=1,8"], [], "is malformed"),
        (["cluster.gpus_per_replica=1,,8"], [], "has an empty value"),
        (["cluster.gpus_per_replica=8,8"], [], "repeats a value"),
        (["cluster.gpus_per_replica=1", "cluster.gpus_per_replica=8"], [], "is given twice"),
        (["cluster.gpus_per_replica=1,8"], ["--cluster.gpus_per_replica=2"], "also given as the override"),
        (["cluster.gpus_per_copy=1,8"], [], "--sweep at cluster.gpus_per_copy = 1: unknown config key"),
        (["cluster.gpus_per_replica=1,3"], [], "--sweep at cluster.gpus_per_replica = 3: cluster.gpus = 8 must"),
    ],
)
def test_a_bad_sweep_is_a_one_line_value_error(sweeps: list[str], overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        run_points(None, [*GPU_FAILURE, *overrides], parse_sweeps(sweeps, [*GPU_FAILURE, *overrides]))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_simulate_sweep_cli_prints_the_comparison_and_writes_a_folder_per_point(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    preset = ROOT / "configs" / "sim" / "replicas_512.toml"
    out = tmp_path / "sweep"
    argv = ["simulate", str(preset), "--sweep", "cluster.gpus_per_replica=1,8,64", "--run.hours=100", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "## The sweep: cluster.gpus_per_replica" in printed
    table = (out / "sweep.md").read_text().splitlines()
    assert [row.split(" | ")[:3] for row in table[2:]] == [
        ["| 1", "512", "recover"],
        ["| 1", "512", "restart"],
        ["| 8", "64", "recover"],
        ["| 8", "64", "restart"],
        ["| 64", "8", "recover"],
        ["| 64", "8", "restart"],
    ]
    summary = json.loads((out / "sweep.json").read_text())
    assert len({p["gpu_failures"] for p in summary["points"]}) == 1  # one GPU-failure timeline for every g
    for g in (1, 8, 64):
        folder = out / f"cluster.gpus_per_replica={g}"
        assert load_scenario(folder / "scenario.toml").cluster.gpus_per_replica == g
        assert all((folder / name).stat().st_size > 0 for name in ("summary.md", "results.json", *PLOTS))
    assert main(["simulate", str(preset), "--sweep", "cluster.gpus_per_replica=1,7"]) == 2
    assert "cluster.gpus = 512 must be a multiple" in capsys.readouterr().err
