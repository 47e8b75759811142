"""The simulator's replica layout (issue 30): ``[cluster] shard x pipeline x tensor`` GPUs per replica, and the
cost model's use of each degree.

The oracles: the product itself; the rule that ``gpus_per_replica`` is the same number spelt once (a
contradiction is one line); properties that follow from first principles rather than from the formulas'
code: a GPU's gradient and rejoin state are its 1/(k p t) of the model whatever the split; a tensor split
whose traffic is hidden costs what an FSDP split does, so a whole run with failures is the same; a pipeline
of p stages over m microbatches idles (p - 1) / (m + p - 1) of its compute. (One GPU failure in pipelined
replicas, worked out by hand, is in tests/test_simulate.py beside the unpipelined one.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.cli import main
from unbroken.sim.scenario import Costs, load_scenario
from unbroken.sim.simulate import simulate

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent

CLUSTER = ["--cluster.gpus=512", "--model.flavour=1b"]


def _layout(*overrides: str) -> list[str]:
    return [*CLUSTER, *(f"--cluster.{o}" for o in overrides)]


@pytest.mark.parametrize(
    ("overrides", "degrees"),
    [
        ([], (1, 1, 1)),
        (["gpus_per_replica=8"], (8, 1, 1)),  # the one-number spelling: an FSDP shard group, as before issue 30
        (["tensor=8"], (1, 1, 8)),
        (["shard=2", "pipeline=2", "tensor=2"], (2, 2, 2)),
        (["gpus_per_replica=8", "tensor=2"], (4, 1, 2)),  # shard takes the rest
        (["gpus_per_replica=64", "pipeline=4", "tensor=8"], (2, 4, 8)),
        (["gpus_per_replica=8", "shard=1", "tensor=8"], (1, 1, 8)),  # both spellings, agreeing
    ],
)
def test_the_replica_is_shard_x_pipeline_x_tensor_gpus(overrides: list[str], degrees: tuple[int, int, int]) -> None:
    cluster = load_scenario(None, _layout(*overrides)).cluster
    k, p, t = degrees
    assert cluster.degrees == degrees
    assert cluster.replica_gpus == k * p * t
    assert cluster.replicas == 512 // (k * p * t)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["gpus_per_replica=8", "shard=2", "tensor=8"],
            "cluster.gpus_per_replica = 8 contradicts cluster.shard x pipeline x tensor = 2 x 1 x 8 = 16",
        ),
        (["gpus_per_replica=8", "tensor=3"], "cluster.gpus_per_replica = 8 must be a multiple of cluster.pipeline"),
        (["shard=3"], "cluster.gpus = 512 must be a multiple of cluster.gpus_per_replica = 3 (shard x pipeline"),
        (["tensor=0"], "cluster.tensor = 0 must be >= 1"),
        (["shard=-1"], "cluster.shard = -1 must be >= 1 (or 0"),
    ],
)
def test_a_contradictory_layout_is_a_one_line_value_error(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        load_scenario(None, [o if o.startswith("--") else f"--cluster.{o}" for o in [*CLUSTER, *overrides]])
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_the_cli_refuses_a_contradiction_with_one_line_and_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    preset = ROOT / "configs" / "sim" / "tp_512.toml"  # gpus_per_replica = 8, tensor = 8
    assert main(["simulate", str(preset), "--cluster.shard=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "contradicts cluster.shard x pipeline x tensor = 2 x 1 x 8 = 16" in err[0], err


LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 4), (2, 2, 2), (4, 2, 8), (1, 8, 8)]


def test_a_gpu_s_gradient_and_rejoin_state_are_its_1_over_kpt_of_the_model() -> None:
    """Each GPU holds a distinct slice of the parameters (an FSDP shard of a TP slice of a stage's layers), so
    how they are split does not matter, only into how many: the bytes a GPU all-reduces and the time a
    rejoining GPU spends receiving state, times k p t, are the same for every layout."""
    whole_grad, whole_state = None, None
    for k, p, t in LAYOUTS:
        c = Costs.of(load_scenario(None, _layout(f"shard={k}", f"pipeline={p}", f"tensor={t}")))
        grad, state = c.grad_bytes_per_gpu * k * p * t, (c.rejoin_s - c.reform_s) * k * p * t
        whole_grad, whole_state = whole_grad or grad, whole_state or state
        assert grad == pytest.approx(whole_grad, rel=1e-12) and state == pytest.approx(whole_state, rel=1e-12)
    assert whole_grad == 2.0 * c.params  # bf16, the whole model on one GPU
    assert whole_state == pytest.approx(12.0 * c.params / 25e9, rel=1e-12)  # fp32 weights + 2 moments at 25 GB/s


def test_tensor_parallel_all_reduces_are_four_per_layer_of_the_stage_s_tokens() -> None:
    """Megatron-LM's two all-reduces in the forward and two in the backward of each layer, of the activations
    (tokens x dim, bf16) of a TP group's 1/k of the tokens, over the p-th of the layers its stage holds: a ring
    moves 2 (t - 1) / t of the bytes. The 1b flavour: dim 2048, 24 layers; 2048 tokens per microbatch."""

    def tensor_s(k: int, p: int, t: int, bandwidth: float = 300.0) -> float:
        overrides = [*_layout(f"shard={k}", f"pipeline={p}", f"tensor={t}"), f"--cost.tensor_bandwidth_gbs={bandwidth}"]
        hidden = [*overrides, "--cost.tensor_bandwidth_gbs=0"]
        return (
            Costs.of(load_scenario(None, overrides)).microbatch_s - Costs.of(load_scenario(None, hidden)).microbatch_s
        )

    one = 4 * 24 * 2 * 7 / 8 * 2048 * 2048 * 2.0 / 300e9
    assert tensor_s(1, 1, 8) == pytest.approx(one, rel=1e-9)
    assert tensor_s(1, 1, 8, bandwidth=600.0) == pytest.approx(one / 2, rel=1e-9)
    assert tensor_s(1, 2, 8) == pytest.approx(one / 2, rel=1e-9)  # half the layers per stage
    assert tensor_s(2, 1, 8) == pytest.approx(one / 2, rel=1e-9)  # half the tokens per TP group
    assert tensor_s(1, 1, 2) == pytest.approx(one * (1 / 2) / (7 / 8), rel=1e-9)
    assert tensor_s(8, 1, 1) == 0.0


# 64 GPUs, 1b, M = 64, 8 s to detect: enough failures (and repairs) in 30 simulated hours to exercise every path
FAILING = [
    "--cluster.gpus=64",
    "--model.flavour=1b",
    "--model.microbatches=64",
    "--run.hours=30",
    "--failures.mtbf_h=300",
    "--failures.mttr_h=2",
    "--failures.random_repair=true",
    "--checkpoint.every_s=600",
    "--checkpoint.in_place_every_s=600",
    "--cost.tensor_bandwidth_gbs=0",
    "--run.policies=recover,drop,restart",
]


def test_a_hidden_tensor_split_costs_what_a_shard_split_does() -> None:
    """With TP's traffic hidden inside the MFU (cost.tensor_bandwidth_gbs = 0), as FSDP's is, the model has no
    way to tell a replica's 8 GPUs sharded from tensor-split: every layout of 8 sees the same GPU failures
    and runs every policy to the same result."""
    results = []
    for layout in (["gpus_per_replica=8"], ["tensor=8"], ["shard=2", "tensor=4"]):
        res = simulate(load_scenario(None, [*FAILING, *(f"--cluster.{o}" for o in layout)]))
        results.append(res)
        assert res.timeline.gpu_failures > 5
    for res in results[1:]:
        assert res.failure_free_step_s == results[0].failure_free_step_s
        for r, r0 in zip(res.policies, results[0].policies, strict=True):
            assert (r.wall_s, r.committed_tokens, r.failures, r.restarts) == (
                r0.wall_s,
                r0.committed_tokens,
                r0.failures,
                r0.restarts,
            )
            assert r.lost_s == r0.lost_s


@pytest.mark.parametrize("m", [1, 8, 32])
def test_a_pipeline_idles_p_minus_1_of_m_plus_p_minus_1_of_its_compute(m: int) -> None:
    """8 GPUs a replica, as 8 FSDP shards or as 8 pipeline stages, M = m microbatches per replica: the same
    FLOPs per GPU and the same all-reduce, but the pipeline's compute takes (m + 7) / m as long."""
    steps = {}
    for layout in ("shard=8", "pipeline=8"):
        overrides = [*_layout(layout), f"--model.microbatches={64 * m}", "--run.hours=0", "--run.steps=1"]
        sc = load_scenario(None, [*overrides, "--run.policies=recover"])
        steps[layout] = simulate(sc).failure_free_step_s - Costs.of(sc).allreduce_s(64)
    assert 1 - steps["shard=8"] / steps["pipeline=8"] == pytest.approx(7 / (m + 7), rel=1e-12)
