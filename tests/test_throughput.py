"""Throughput in the field's units (unbroken.core.throughput): tokens/s per worker and per GPU, and MFU, against
computations done by hand; and what a real run's step records carry."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from runner import TINY, train

from unbroken.core.config import load_config
from unbroken.core.flavours import FLAVOURS, flops_per_token, model_args
from unbroken.core.records import committed_steps, read_records
from unbroken.core.throughput import gpus_in_use, mfu, run_throughput, step_throughput, table_peak_tflops

pytestmark = pytest.mark.timeout(300)


def test_flops_per_token_of_tiny_by_hand() -> None:
    # tiny: dim 128, 2 layers, 4 heads of 32, 2 kv heads (kv width 64), SwiGLU 352, vocabulary 8192.
    # Per block: wq + wo = 2 * 128 * 128 = 32,768; wk + wv = 2 * 128 * 64 = 16,384; w1, w2, w3 = 3 * 128 * 352
    # = 135,168; two norms 256: 184,576. Non-embedding N = 2 * 184,576 + final norm 128 + output 8192 * 128
    # (1,048,576) = 1,417,856. At sequence 64: 6 N = 8,507,136 and 12 * 2 * 128 * 64 = 196,608.
    assert flops_per_token(FLAVOURS["tiny"], 64) == 8_703_744


def test_mfu_by_hand() -> None:
    # 10,000 tokens/s per GPU x 2e9 FLOPs per token = 2e13 FLOP/s of a 989.4 TFLOP/s peak: 2.0214 %.
    assert mfu(10_000, 2e9, 989.4) == pytest.approx(2e13 / 989.4e12, rel=1e-15)
    assert math.isnan(mfu(10_000, 2e9, 0.0)) and math.isnan(mfu(10_000, 0.0, 989.4))


def test_a_steps_throughput_fields_by_hand() -> None:
    # 65,536 tokens in 0.5 s by 8 workers sharing 4 GPUs (2 per GPU): 131,072 tokens/s, 16,384 per worker,
    # 32,768 per GPU; at 1e9 FLOPs per token and a 312 TFLOP/s peak, MFU = 3.2768e13 / 3.12e14 = 0.105.
    fields = step_throughput(65_536, 0.5, 8, gpus_in_use(8, 2), 1e9, 312.0)
    assert fields["gpus"] == 4 and fields["workers"] == 8
    assert fields["tokens_per_s_per_worker"] == 16_384 and fields["tokens_per_s_per_gpu"] == 32_768
    assert fields["mfu"] == pytest.approx(0.105025641025641, rel=1e-12)
    cpu = step_throughput(65_536, 0.5, 8, 0, 1e9, 0.0)  # no GPU: no per-GPU rate, no MFU
    assert math.isnan(cpu["tokens_per_s_per_gpu"]) and math.isnan(cpu["mfu"])
    assert gpus_in_use(3, 2) == 2 and gpus_in_use(1, 4) == 1


def test_a_runs_throughput_weights_each_step_by_its_time() -> None:
    # Step A: 1,000 tokens in 1 s on 2 workers / 2 GPUs; step B: 1,000 tokens in 3 s on 1 worker / 1 GPU (after
    # a death). Tokens/s: 2,000 / 4 s = 500. Worker-seconds 2 + 3 = 5: 400 per worker; GPU-seconds the same.
    # MFU at 1e9 FLOPs per token, 100 TFLOP/s: 2e12 FLOPs / (5 GPU-s x 1e14) = 0.004.
    base = {"tokens": 1_000, "flops_per_token": 1e9, "peak_tflops": 100.0}
    steps = [
        {**base, "step_time_s": 1.0, "workers": 2, "gpus": 2},
        {**base, "step_time_s": 3.0, "workers": 1, "gpus": 1},
        {**base, "step_time_s": math.nan, "workers": 1, "gpus": 1},  # a republished record: no timing
    ]
    run = run_throughput(steps)
    assert run["tokens_per_s"] == 500 and run["tokens_per_s_per_worker"] == 400
    assert run["tokens_per_s_per_gpu"] == 400 and run["mfu"] == pytest.approx(0.004, rel=1e-12)


def test_the_peak_table_matches_cuda_device_names() -> None:
    assert table_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert table_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.5
    assert table_peak_tflops("NVIDIA H200", "tf32") == 494.7
    assert table_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert table_peak_tflops("NVIDIA A10", "bf16") == 125.0  # not the A100's
    assert table_peak_tflops("NVIDIA L4", "bf16") == 121.0  # not the L40S's
    assert table_peak_tflops("NVIDIA GeForce GTX 1080", "bf16") is None


def test_step_records_carry_the_throughput_of_a_real_run(tmp_path: Path, data_cache_dir: Path) -> None:
    """Two CPU workers of tiny: per worker is half the step's rate; no GPU, so no per-GPU rate and no MFU; the
    FLOPs per token are the model's; with a peak given, still no MFU on a CPU."""
    result = train(tmp_path / "run", data_cache_dir, "--train.steps=3", "--train.peak_tflops=1", workers=2)
    assert result.returncode == 0, result.stderr[-2000:]
    steps = list(committed_steps(read_records(tmp_path / "run")).values())
    assert len(steps) == 3
    data = load_config(TINY).data  # the model's vocabulary is its tokenizer's
    model_flops = flops_per_token(model_args("tiny", vocab_size=data.vocab_size), data.seq_len)
    for r in steps:
        assert r["workers"] == 2 and r["gpus"] == 0
        assert r["tokens_per_s_per_worker"] == pytest.approx(r["tokens_per_s"] / 2, rel=1e-12)
        assert math.isnan(r["tokens_per_s_per_gpu"]) and math.isnan(r["mfu"])
        assert r["flops_per_token"] == model_flops


def test_the_views_and_the_summary_show_tokens_per_gpu_and_mfu() -> None:
    """Step records of a GPU run (synthetic: the fields step_throughput gives) through the status view, the
    terminal view and the run summary: medians of the recent steps' per-GPU rate and MFU; none on a CPU run."""
    import io

    from rich.console import Console

    from unbroken.control.status.model import RunView
    from unbroken.control.status.progress import summary_rows
    from unbroken.control.status.terminal import render
    from unbroken.core.runfacts import RunFacts

    def step(k: int, tokens_per_s: float, gpus: int) -> dict[str, object]:
        fields = step_throughput(int(tokens_per_s), 1.0, 2, gpus, 1e9, 100.0)
        return {"type": "step", "step": k, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 1.0,
                "tokens": int(tokens_per_s), "tokens_per_s": tokens_per_s, "alive": 2, "epoch": 1,
                "microbatches": 4, "committed": True, "recomputed": 0, "dropped": 0, "recoveries": 0,
                "efficient": 0, "time": 100.0 + k, **fields}  # fmt: skip

    gpu = [step(k, tps, gpus=2) for k, tps in enumerate((2_000.0, 4_000.0, 6_000.0))]
    view = RunView(total_steps=3)
    view.extend(gpu)
    run = view.snapshot()["run"]
    assert run["tokens_per_s_per_gpu"] == 2_000  # the median of 1,000, 2,000, 3,000
    assert run["mfu"] == pytest.approx(2_000 * 1e9 / 100e12, rel=1e-12)
    out = io.StringIO()
    Console(file=out, width=80).print(render(view.snapshot(), width=80))
    assert "2,000 tokens/s (median), MFU 2.0 %" in out.getvalue()
    s = run_throughput(step.throughput() for step in RunFacts.of(gpu).steps.values())
    # 12,000 tokens over 3 s of 2 GPUs: 2,000 per GPU; 1.2e13 FLOPs over 6 GPU-seconds of 1e14: 0.02
    assert s["tokens_per_s_per_gpu"] == 2_000 and s["mfu"] == pytest.approx(0.02, rel=1e-12)
    assert dict(summary_rows(RunFacts.of(gpu), 3))["per device"].endswith("2,000 per GPU, MFU 2.0 %")

    cpu = [step(k, 2_000.0, gpus=0) for k in range(3)]
    view = RunView(total_steps=3)
    view.extend(cpu)
    assert view.snapshot()["run"]["tokens_per_s_per_gpu"] is None and view.snapshot()["run"]["mfu"] is None
    assert math.isnan(run_throughput(step.throughput() for step in RunFacts.of(cpu).steps.values())["mfu"])
    assert "MFU" not in dict(summary_rows(RunFacts.of(cpu), 3))["per device"]
