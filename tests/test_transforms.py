"""Precision, activation checkpointing, torch.compile and the device: ``[train] precision``,
``activation_checkpointing``, ``compile`` and ``device`` (unbroken/ft/transforms.py, ``Context.autocast``,
``Context.device``).

- checkpointing recomputes the same ops on the same inputs: gradients bitwise those without it, in float32
  and under bf16 autocast, exact and MeCeFO-efficient microbatches alike (in one process);
- bf16 autocast: the losses of a real run within a bound derived from bf16's rounding of the float32 run's;
  exact mode with bf16 and a kill is bitwise its own failure-free run;
- compile with a kill (MeCeFO, so the survivor's efficient microbatches run under compile too): the run
  completes and every replica ends with the same parameters;
- bad values of the new keys, and ``train.device = cuda`` without CUDA: one line, exit 2.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from runner import EXACT, ONE_THREAD, ROOT, TINY, run_command, train

from unbroken.core.config import load_config
from unbroken.core.records import read_records, step_losses
from unbroken.ft.mecefo import EfficientConfig, apply_efficient_backward
from unbroken.ft.transforms import apply_activation_checkpointing, apply_compile, transformer_blocks
from unbroken.train.model import Transformer, model_args

pytestmark = pytest.mark.timeout(300)

STEPS = 4


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(model_args("tiny", vocab_size=512, max_seq_len=32))


def gradients(model: Transformer, efficient: bool | None, bf16: bool) -> dict[str, torch.Tensor | None]:
    """One microbatch's loss and gradients (``efficient``: None, no efficient transform; else its switch)."""
    eb = apply_efficient_backward(model, EfficientConfig(rank=8)) if efficient is not None else None
    if eb is not None:
        eb.refresh(0)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (2, 33), generator=gen)
    with eb.enabled(bool(efficient)) if eb is not None else contextlib.nullcontext():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
    return {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("efficient", [None, False, True], ids=["plain", "efficient-off", "efficient-on"])
def test_activation_checkpointing_gives_bitwise_the_same_gradients(efficient: bool | None, bf16: bool) -> None:
    """The recomputation in the backward runs the same ops, in the same order, on the same inputs and under the
    same autocast state as the forward did, so on the CPU's deterministic kernels every gradient (and the
    loss) is bitwise the same. With MeCeFO's efficient transform on top (switch on or off) as well."""
    want = gradients(tiny_model(), efficient, bf16)
    model = tiny_model()
    apply_activation_checkpointing(model)
    got = gradients(model, efficient, bf16)
    assert want.keys() == got.keys()
    for name, grad in want.items():
        assert (grad is None) == (got[name] is None), name
        assert grad is None or torch.equal(grad, got[name]), name


def test_transforms_keep_the_state_dict_and_refuse_what_they_cannot_do() -> None:
    model = tiny_model()
    keys = list(model.state_dict())
    apply_activation_checkpointing(model)
    apply_compile(model)  # lazy: nothing is compiled before a forward
    assert list(model.state_dict()) == keys and len(transformer_blocks(model)) == 2
    with pytest.raises(ValueError, match="checkpointing applied twice"):
        apply_activation_checkpointing(model)
    with pytest.raises(ValueError, match="compile applied twice"):
        apply_compile(model)
    with pytest.raises(ValueError, match="no transformer blocks"):
        apply_compile(torch.nn.Sequential(torch.nn.Linear(2, 2)))


# -- real runs ------------------------------------------------------------------------------------------------

U = 2.0**-8  # bfloat16's relative rounding error (8 significand bits)


def forward_roundings(n_layers: int) -> int:
    """bf16 roundings on the longest path from the embedding to the logits under CPU autocast. A linear rounds
    its input, its weight and its output (3; 2 when its input is already bf16); rotary embedding computes in
    float32 and rounds its output (1); scaled_dot_product_attention rounds its probabilities and output (2);
    SiLU and the gate product round their outputs (1 each); norms, residual adds and the loss are float32.
    Attention: wq 3, rope 1, attention 2, wo 2 = 8; FFN: w1 3, SiLU 1, product 1, w2 2 = 7; the output
    projection 3."""
    return 15 * n_layers + 3


def test_bf16_losses_are_within_bf16_rounding_of_fp32_and_exact_bf16_survives_a_kill_bitwise(
    tmp_path: Path, data_cache_dir: Path
) -> None:
    """bf16 autocast against float32 from the same weights and data (exact reduction, so each run is
    deterministic): step s's loss differs by at most

        u * (K_f * L_s + 3 * K_b * sum_{k<s} |L_{k+1} - L_k|),   u = 2^-8, K_b = 2 K_f,

    to first order in u. The first term is the forward's rounding at the same weights: K_f roundings
    (``forward_roundings``), each moving the value it rounds by at most u relative, not amplified to first
    order, bound the loss's relative error by K_f u. The second is the trajectory: the gradient carries at
    most K_b = 2 K_f roundings (each forward rounding mirrored once in the backward, plus those the saved
    activations carry), so a relative error of at most K_b u; AdamW's update is scale-free per coordinate,
    so its error is at most K_b u relative, or a flipped sign where |g_i| <= K_b u |g_i| (2 lr |g_i|, i.e. at
    most 2 K_b u of that coordinate's first-order decrease); the loss change it causes is at most
    3 K_b u times the first-order decrease of the step, whose sum over the steps the float32 run's loss path
    measures. bf16 must have been used: step 0 (same weights) differs.

    Then the bf16 run again with worker 1 killed in the backward of step 2 (worker 0 recomputes its
    microbatches within the step): in exact mode it is bitwise its own failure-free run (losses, final
    parameters)."""
    fp32, bf16, killed = tmp_path / "fp32", tmp_path / "bf16", tmp_path / "bf16-kill"
    common = (EXACT, ONE_THREAD, f"--train.steps={STEPS}")
    for out, extra in (
        (fp32, ()),
        (bf16, ("--train.precision=bf16",)),
        (killed, ("--train.precision=bf16", "--failures.schedule=kill:worker=1,step=2,phase=backward")),
    ):
        # fp32 is the bound's reference only: one worker (exact reduction: the same trajectory as two)
        result = train(out, data_cache_dir, *common, *extra, workers=1 if out == fp32 else 2)
        assert result.returncode == 0, result.stderr[-3000:]
    want, got = step_losses(fp32), step_losses(bf16)
    assert sorted(want) == sorted(got) == list(range(STEPS))
    k_f = forward_roundings(model_args(load_config(TINY).model.flavour).n_layers)
    k_b = 2 * k_f
    path = 0.0
    for s in range(STEPS):
        bound = U * (k_f * want[s] + 3 * k_b * path)
        assert abs(got[s] - want[s]) <= bound, (s, got[s], want[s], bound)
        if s + 1 < STEPS:
            path += abs(want[s + 1] - want[s])
    assert got[0] != want[0]  # autocast was in effect

    assert step_losses(killed) == got
    reference, survivor = (read_records(run, "final")[0] for run in (bf16, killed))
    assert reference["identical"] and len(reference["checksums"]) == 2 and list(survivor["checksums"]) == ["0"]
    assert survivor["checksums"]["0"] == reference["checksums"]["0"]
    kill_steps = {r["step"]: r for r in read_records(killed, "step")}
    # The kill landed inside step 2: the step was recovered in and committed by worker 0 alone. (How many of its
    # ids count as recomputed depends on how far worker 0 had got: none if it had finished no microbatch of the
    # step when worker 1 died, as happened under load in r133, and the step was then planned afresh.)
    assert kill_steps[2]["recoveries"] == 1 and kill_steps[2]["alive"] == 1


def test_compile_with_a_kill_completes_with_identical_replicas(tmp_path: Path, data_cache_dir: Path) -> None:
    """Every block compiled, MeCeFO, 3 workers: worker 1 dies in step 2's backward, its ring neighbour computes
    its microbatches in efficient mode (the efficient sub-modules run eagerly inside the compiled blocks)
    within the same step. The run completes; both survivors end with bitwise the same parameters."""
    out = tmp_path / "compiled"
    result = train(
        out,
        data_cache_dir,
        "--train.compile=true",
        "--recovery.policy=mecefo",
        "--mecefo.rank=8",
        f"--train.steps={STEPS}",
        "--failures.schedule=kill:worker=1,step=2,phase=backward",
        workers=3,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    final = read_records(out, "final")[0]
    assert final["identical"] and sorted(final["checksums"]) == ["0", "2"]
    steps = {r["step"]: r for r in read_records(out, "step")}
    assert steps[2]["recoveries"] >= 1 and steps[2]["efficient"] >= 1


# -- user mistakes ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--train.precision=fp16", "train.precision = 'fp16' is unknown; allowed: fp32, bf16"),
        ("--train.activation_checkpointing=full", "train.activation_checkpointing = 'full' is unknown"),
        ("--train.compile=maybe", "train.compile = 'maybe' has the wrong type; expected bool"),
        ("--train.device=tpu", "train.device = 'tpu' is unknown; allowed: auto, cpu, cuda"),
    ],
)
def test_bad_values_of_the_new_keys_are_one_line_errors(override: str, message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        load_config(TINY, [override])


@pytest.mark.parametrize(
    "override",
    [
        "--train.precision=fp16",
        pytest.param(
            "--train.device=cuda",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA"),
        ),
    ],
)
def test_bad_values_exit_2_with_one_line(tmp_path: Path, data_cache_dir: Path, override: str) -> None:
    cmd = [sys.executable, "-m", "unbroken", "train", TINY, "--out", str(tmp_path / "run"), "--quiet"]
    result = run_command(
        [*cmd, f"--data.cache_dir={data_cache_dir}", override], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unbroken: error: "), lines
    assert ("no CUDA GPU" if "cuda" in override else "train.precision") in lines[0]
    assert not (tmp_path / "run").exists()
