"""Every baseline that a speed ratio of ``unbroken bench`` is measured against does unbroken's work (issue 64): run
for a few steps on the same config, data and initial weights as unbroken's fp32 path, it ends with the same
parameters, bit for bit, having trained in each step on the same microbatches and tokens (counted by the baseline
as it trains, and by unbroken's step records).

The pairs, each as its benchmark runs them (the bench module's own functions, asked to keep their final state):

- ``bench ddp``: the DDP loop (``bench.run_ddp``) against ``unbroken train`` (``bench.run_unbroken``), 2 workers;
- ``bench parallel``: FSDP2 HSDP, 2 replicas x 2 shards, and torch's 3-D mesh, 1 replica x 2 shards x 2 tensor
  ranks (``bench_parallel.run_hsdp``) against ``unbroken train`` with that layout (``bench_parallel.run_unbroken``);
- ``bench library``: examples/plain_loop.py's model under DDP (``bench_library.run_ddp``) against the example under
  ``unbroken launch`` (``bench_library.run_library``), 2 workers;
- ``bench gpu``: the plain loop (``bench_gpu.run_plain``), here on the CPU in float32, against one worker of
  ``unbroken train`` (``bench_gpu.run_train``).

Why bit for bit. Floating-point addition is commutative but not associative, so two systems give the same bits
when they add the same terms in the same grouping, and multiplying by a power of two is exact (short of overflow
and of values below float32's normal range, which these gradients never reach: such a case would fail loudly here,
not pass). Each pair is set up so that the grouping is the same:

- DDP (2 ranks, M = 4): each rank accumulates its microbatches' gradients in ``param.grad`` in id order, the ids
  of ``plan_step``'s contiguous blocks, as unbroken's worker of the same index does under the even workload.
  DDP scales each loss by W/M and averages (divides by W = 2), unbroken scales by 1/M and sums: the same values
  times powers of two. The all-reduce of two ranks is one addition (commutative). Clipping is torch's
  ``clip_grad_norm_`` and the optimizer ``build_optimizer``'s AdamW on both sides.
- HSDP (R = 2, k = 2, M = 4) and 3-D (R = 1, k = 2, t = 2, M = 2): one microbatch per (replica, shard) lane, so
  each replica's reduce-scatter adds the same pair (lane 2r + s computes microbatch 2r + s in the baseline's plan
  over lanes and in unbroken's rounds over its replica's block), then the replicas' all-reduce adds two terms.
  FSDP averages, dividing by powers of two; unbroken's FSDP sums. Tensor parallelism is ``apply_tensor_parallel``
  on both sides. (With more microbatches per lane the two pair them differently: (g0 + g2) + (g1 + g3) against
  (g0 + g1) + (g2 + g3); same work, other bits.)
- The plain loop against one worker: unbroken's all-reduce over one member leaves the sum as it is.

Clipping. Each baseline keeps the gradient norm its clipping computed in each step, compared with the one in
unbroken's step record: the same float where both sides call ``clip_grad_norm_`` on whole tensors (clipping acts
in the ``bench ddp`` and ``bench gpu`` pairs; in ``bench library``'s the example's norms stay below its 1.0).
Torch's clipping of DTensors combines the ranks' per-tensor norms in float32, unbroken's (``gradnorm.float_clip``)
in float64, so under FSDP and tensor parallelism the two clipping coefficients may differ in their last bit: in
the ``bench parallel`` pairs clipping is inactive (``train.grad_clip`` = 1e9, above any norm here: both sides
compute the norm and scale by nothing), the parameters are compared bit for bit, and the norms within
``norm_bound``.

Exact mode is not compared with a baseline: its gradient is the fixed-point sum, not any float32 sum, and no
useful bound on the parameters follows through AdamW (its update m / (sqrt(v) + eps) can move an element whose
gradient is near zero by up to twice the learning rate, however small the gradient's error); its work is the fp32
path's (the same trainer, plan and steps).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from runner import ROOT, RUN_TIMEOUT_S, TINY

from unbroken.core.config import load_config, to_toml
from unbroken.core.layout import ReplicaLayout
from unbroken.core.records import committed_steps, read_records
from unbroken.ft.checkpoint import schema as ckpt
from unbroken.lab import bench, bench_gpu, bench_library, bench_parallel

STEPS = 3
ONE_THREAD = "--train.threads=1"  # the same kernels on both sides, whatever the machine's cores
NO_CLIP = "--train.grad_clip=1e9"  # above every gradient norm here (about 2): norms computed, nothing scaled
U = 2.0**-24  # float32's unit roundoff: a correctly rounded operation's relative error is at most U
NORM_LEVELS = 4  # a norm tree's levels: per tensor list, across shards, across tensor ranks, across meshes

FIXTURE_RUNS = {"plain_unbroken": 1}  # conftest adds its time to each test's bound
PAIR_TIMEOUT_S = 2 * RUN_TIMEOUT_S  # a baseline and an unbroken run


def kept_ranks(folder: Path, workers: int) -> list[dict[str, Any]]:
    """What each baseline rank kept (``figures.keep_final``)."""
    return [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(workers)]


def unbroken_final(run_dir: Path) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """An unbroken run's final parameters (its last checkpoint) and its committed step records."""
    loaded = ckpt.load_latest(run_dir)
    assert loaded is not None, f"{run_dir}: no checkpoint"
    return loaded.state["model"], list(committed_steps(read_records(run_dir)).values())


def differing(baseline: dict[str, torch.Tensor], unbroken: dict[str, torch.Tensor]) -> dict[str, str]:
    """The parameters that are not bitwise the same (or held by one side only), each with how they differ."""
    out = {}
    for name in sorted(baseline.keys() | unbroken.keys()):
        a, b = baseline.get(name), unbroken.get(name)
        if a is None or b is None:
            out[name] = "only in " + ("unbroken" if a is None else "the baseline")
        elif a.shape != b.shape or not torch.equal(a, b):
            diff = float((a - b).abs().max()) if a.shape == b.shape else float("nan")
            out[name] = f"shapes {tuple(a.shape)} / {tuple(b.shape)}, max |difference| {diff:.3e}"
    return out


def check_same_parameters(ranks: list[dict[str, Any]], unbroken: dict[str, torch.Tensor]) -> None:
    """Every baseline rank holds the same whole model, and it is bitwise unbroken's."""
    for r, kept in enumerate(ranks[1:], 1):
        assert not (d := differing(kept["params"], ranks[0]["params"])), f"baseline rank {r} differs from rank 0: {d}"
    assert not (d := differing(ranks[0]["params"], unbroken)), f"the baseline's final parameters differ: {d}"


def check_same_work(ranks: list[dict[str, Any]], steps: list[dict[str, Any]], microbatches: int, tokens: int) -> None:
    """The baseline trained, in each of unbroken's committed steps, on each of the M microbatch ids once and on
    as many tokens as unbroken's step record counts (M x ``tokens`` a microbatch). The ranks of one lane (tensor
    ranks, stages) compute the same microbatches: each lane counts once."""
    lanes: dict[int, list[list[list[int]]]] = {}
    for r, kept in enumerate(ranks):
        first = lanes.setdefault(kept["lane"], kept["work"])
        assert kept["work"] == first, f"baseline rank {r} trained on other microbatches than its lane's first rank"
    assert [s["step"] for s in steps] == list(range(STEPS)), f"unbroken committed steps {[s['step'] for s in steps]}"
    assert all(len(work) == STEPS for work in lanes.values()), "the baseline ran another number of steps"
    for step, record in enumerate(steps):
        done = [mb for work in lanes.values() for mb in work[step]]
        ids = sorted(j for j, _ in done)
        assert ids == list(range(microbatches)), (
            f"step {step}: the baseline trained on microbatches {ids}, unbroken on each of 0..{microbatches - 1} once"
        )
        assert record["counted"] == microbatches and record["counted_once"], record
        trained = sum(n for _, n in done)
        assert trained == record["tokens"] == microbatches * tokens, (
            f"step {step}: the baseline trained on {trained} tokens, unbroken on {record['tokens']} "
            f"({microbatches} microbatches of {tokens})"
        )


def norm_bound(num_norms: int) -> float:
    """The largest relative difference between torch's float32 clipping norm and unbroken's float64 one, both
    combined from the same ``num_norms`` per-rank, per-tensor norms (the same kernel on the same gradient bits:
    the parameters' bitwise equality shows the gradients were the same at every step).

    Torch's side is a tree of float32 operations over those leaves, at most NORM_LEVELS deep: a node squares its
    m children, adds the squares and takes the square root. Write a node's value v as v^2 = S (1 + e), S the exact
    sum of the squares of the leaves below it (a leaf: e = 0). Squaring a child adds at most 2U to e (a square or
    ``pow``: within one ulp), adding m positive terms in any order at most (m - 1) U, and the root, within one
    ulp, at most 4U once squared: a node adds at most (m + 5) U to the largest e of its children. Along any path
    from the root the fan-ins m add up to at most num_norms + NORM_LEVELS - 1 (each child off the path holds a
    leaf at least), so at the root e <= (num_norms + 6 NORM_LEVELS) U, and the norm's relative error is half of
    that, to first order. Unbroken's side squares the float32 values exactly in float64 and adds them there: its
    error, num_norms x 2^-53, is below one U. The bound is e's, twice the norm's first-order figure, which
    covers the higher-order terms (below 1 % of it while num_norms U < 0.01), plus U for unbroken's error."""
    return (num_norms + 6 * NORM_LEVELS) * U + U


def check_norms(baseline: list[float], steps: list[dict[str, Any]], bound: float = 0.0) -> None:
    """The baseline's clipping computed a gradient norm in each step, unbroken's within the relative ``bound``
    (0: the same float)."""
    unbroken = [s["grad_norm"] for s in steps]
    assert len(baseline) == len(unbroken), f"the baseline computed {len(baseline)} clipping norms in {len(steps)} steps"
    for step, (a, b) in enumerate(zip(baseline, unbroken, strict=True)):
        assert abs(a - b) <= bound * b, f"step {step}: gradient norm {a} (baseline) against {b}, bound {bound * b:.3e}"


def tiny_tokens(cfg: Any) -> int:
    return cfg.data.microbatch_size * cfg.data.seq_len


# -- bench ddp ------------------------------------------------------------------------------------------
@pytest.mark.timeout(PAIR_TIMEOUT_S)
def test_the_ddp_baseline_of_bench_ddp_does_unbrokens_work(tmp_path: Path, data_cache_dir: Path) -> None:
    cfg = bench._bench_config(TINY, [f"--train.steps={STEPS}", f"--data.cache_dir={data_cache_dir}", ONE_THREAD])
    bench.run_ddp(cfg, 2, keep=tmp_path)
    bench.run_unbroken(cfg, 2, keep=tmp_path)
    ranks = kept_ranks(tmp_path, 2)
    params, steps = unbroken_final(tmp_path / "run")
    check_same_work(ranks, steps, cfg.train.microbatches, tiny_tokens(cfg))
    assert all(s["grad_norm"] > cfg.train.grad_clip for s in steps), "clipping must act for this test to show it"
    check_same_parameters(ranks, params)
    for kept in ranks:
        check_norms(kept["norms"], steps)


# -- bench parallel -------------------------------------------------------------------------------------
@pytest.mark.timeout(PAIR_TIMEOUT_S)
@pytest.mark.parametrize(
    ("layout", "microbatches"),
    [(["--parallel.shard=2"], 4), (["--parallel.shard=2", "--parallel.tensor=2"], 2)],
    ids=["hsdp-2x2", "3d-1x2x2"],
)
def test_the_torch_baselines_of_bench_parallel_do_unbrokens_work(
    tmp_path: Path, data_cache_dir: Path, layout: list[str], microbatches: int
) -> None:
    overrides = [*layout, f"--train.microbatches={microbatches}", f"--data.cache_dir={data_cache_dir}", ONE_THREAD]
    cfg = bench_parallel._config(TINY, [*overrides, NO_CLIP], STEPS)
    bench_parallel.run_hsdp(cfg, 4, keep=tmp_path)
    _, _, run_dir = bench_parallel.run_unbroken(cfg, 4, keep=tmp_path)
    ranks = kept_ranks(tmp_path, 4)
    params, steps = unbroken_final(run_dir)
    check_same_work(ranks, steps, microbatches, tiny_tokens(cfg))
    check_same_parameters(ranks, params)
    per_replica = ReplicaLayout.of(cfg.parallel).size  # each tensor's norm: one leaf per rank of the replica
    for kept in ranks:
        check_norms(kept["norms"], steps, norm_bound(per_replica * len(params)))


def test_the_norm_check_holds_at_its_bound_and_fires_past_it() -> None:
    bound = norm_bound(84)  # the tiny model's 21 tensors over a replica of 4 ranks
    steps = [{"grad_norm": 2.0}]
    check_norms([2.0 * (1 + bound)], steps, bound)
    with pytest.raises(AssertionError, match="gradient norm"):
        check_norms([2.0 * (1 + 2 * bound)], steps, bound)
    with pytest.raises(AssertionError, match="gradient norm"):  # one shard's half of the squares
        check_norms([2.0 * 0.5**0.5], steps, bound)
    with pytest.raises(AssertionError, match="gradient norm"):  # bound 0 (the same float): one ulp apart fires
        check_norms([math.nextafter(2.0, 3.0)], steps)


# -- bench library --------------------------------------------------------------------------------------
@pytest.mark.timeout(PAIR_TIMEOUT_S)
def test_the_ddp_loop_of_bench_library_does_the_examples_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # bench library runs examples/plain_loop.py from the checkout
    microbatches = 4
    bench_library.run_ddp(2, STEPS, microbatches, keep=tmp_path)
    bench_library.run_library(2, STEPS, microbatches, exact=False, keep=tmp_path)
    ranks = kept_ranks(tmp_path, 2)
    params, steps = unbroken_final(tmp_path / "run")
    check_same_work(ranks, steps, microbatches, 8 * 32)  # batch_for: 8 sequences of 32 tokens
    check_same_parameters(ranks, params)
    for kept in ranks:  # clipping at 1.0 does not act here (norms of about 0.9), but both compute the norm
        check_norms(kept["norms"], steps)


# -- bench gpu's plain loop, on the CPU -----------------------------------------------------------------
SHAKESPEARE = Path("shakespeare")  # bench gpu's data argument: here the embedded corpus, by name


def plain_overrides(cache: Path, *extra: str) -> list[str]:
    """tests/tiny.toml's few steps on the CPU (fp32, not compiled), for ``run_train`` and the plain loop alike
    (each adds bench gpu's ``train_overrides`` before them)."""
    return [
        f"--train.steps={STEPS}",
        "--checkpoint.every=0",
        f"--data.cache_dir={cache}",
        ONE_THREAD,
        "--train.device=cpu",
        *extra,
    ]


@pytest.fixture(scope="module")
def plain_unbroken(tmp_path_factory: pytest.TempPathFactory, data_cache_dir: Path) -> Path:
    """One worker of ``unbroken train``, as bench gpu starts it (``run_train``)."""
    run_dir = tmp_path_factory.mktemp("plain") / "run"
    outcome = bench_gpu.run_train(run_dir, SHAKESPEARE, 1, plain_overrides(data_cache_dir), TINY)
    assert outcome["exit"] == 0, outcome["error"]
    return run_dir


def run_plain(folder: Path, cache: Path, *extra: str) -> tuple[Any, list[dict[str, Any]]]:
    """The plain loop as bench gpu starts it (``run_plain``): its config and what it kept."""
    cfg = load_config(TINY, bench_gpu.train_overrides(SHAKESPEARE, plain_overrides(cache, *extra)))
    folder.mkdir()
    result = bench_gpu.run_plain(to_toml(cfg), folder, keep=folder)
    assert "error" not in result, result["error"]
    return cfg, kept_ranks(folder, 1)


@pytest.mark.timeout(120)
def test_the_plain_loop_of_bench_gpu_does_unbrokens_work_on_the_cpu(
    tmp_path: Path, data_cache_dir: Path, plain_unbroken: Path
) -> None:
    cfg, ranks = run_plain(tmp_path / "plain", data_cache_dir)
    assert str(cfg.train.precision) == "fp32" and not cfg.train.compile and str(cfg.train.device) == "cpu"
    params, steps = unbroken_final(plain_unbroken)
    check_same_work(ranks, steps, cfg.train.microbatches, tiny_tokens(cfg))
    assert all(s["grad_norm"] > cfg.train.grad_clip for s in steps), "clipping must act for this test to show it"
    assert len({s["lr"] for s in steps}) == STEPS, "the learning rate must change for this test to show the schedule"
    check_same_parameters(ranks, params)
    check_norms(ranks[0]["norms"], steps)


@pytest.mark.timeout(120)
def test_the_checks_fire_on_a_loop_that_does_less(tmp_path: Path, data_cache_dir: Path, plain_unbroken: Path) -> None:
    """The plain loop without clipping (the same microbatches: only the parameters show it); its real work log
    with a microbatch left out, one trained on half its tokens, or one counted twice."""
    cfg, ranks = run_plain(tmp_path / "unclipped", data_cache_dir, "--train.grad_clip=0")
    params, steps = unbroken_final(plain_unbroken)
    M, tokens = cfg.train.microbatches, tiny_tokens(cfg)
    check_same_work(ranks, steps, M, tokens)  # the work is the same ...
    with pytest.raises(AssertionError, match="final parameters differ"):
        check_same_parameters(ranks, params)  # ... the update is not
    with pytest.raises(AssertionError, match="computed 0 clipping norms"):
        check_norms(ranks[0]["norms"], steps)
    work = ranks[0]["work"]
    left_out = [mbs[:-1] if s == 1 else mbs for s, mbs in enumerate(work)]
    fewer_tokens = [[[j, n // 2 if (s, j) == (2, 0) else n] for j, n in mbs] for s, mbs in enumerate(work)]
    twice = [[*mbs[:-1], mbs[0]] if s == 0 else mbs for s, mbs in enumerate(work)]
    for edited, message in ((left_out, "trained on microbatches"), (fewer_tokens, "tokens"), (twice, "microbatches")):
        with pytest.raises(AssertionError, match=message):
            check_same_work([{**ranks[0], "work": edited}], steps, M, tokens)
