"""unbroken as a library: the examples (a user's own loop and model, a Hugging Face Llama) under ``unbroken
launch`` with kills, the Hugging Face model in the built-in trainer, and ``unbroken export``. The oracle is
the failure-free run: with exact reduction a run with kills (worker 0, the leader, included) must end with the
same final checkpoint, tensor for tensor. Exact reduction makes the trajectory independent of the number of
workers (tests/test_train.py: one intra-op thread each), so each reference is a one-worker run. A launch whose
claim is not about how a script's worker starts forks its workers (``--fork``) instead of starting them cold."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runner import EXACT, ONE_THREAD, ROOT, run_command, train

from unbroken.core.records import read_records
from unbroken.ft.checkpoint import schema as ckpt

pytestmark = pytest.mark.timeout(300)

PLAIN = ROOT / "examples" / "plain_loop.py"
HF = ROOT / "examples" / "hf_llama.py"


def launch(
    out: Path, script: Path, *args: str, workers: int = 4, fork: bool = False
) -> subprocess.CompletedProcess[str]:
    """``unbroken launch SCRIPT``; ``fork``: its workers forked from the launcher's zygote (``--fork``), for the
    tests whose claim is not about how a script's worker starts."""
    cmd = [sys.executable, "-m", "unbroken", "launch", "--workers", str(workers), "--out", str(out), "--quiet"]
    cmd += ["--fork"] if fork else []
    return run_command([*cmd, *args, str(script)], capture_output=True, text=True, timeout=280)


def same_final(a: Path, b: Path, step: int) -> None:
    sa, sb = ckpt.verify(a, step), ckpt.verify(b, step)
    assert sa["model"].keys() == sb["model"].keys()
    assert all(torch.equal(sa["model"][k], sb["model"][k]) for k in sa["model"])
    for i, state in sa["optimizer"]["state"].items():
        assert all(torch.equal(t, sb["optimizer"]["state"][i][n]) for n, t in state.items())


PLAIN_STEPS = 24
Alone = tuple[subprocess.CompletedProcess[str], Path]  # a run of the script in its own process, and its folder
PLAIN_COMMON = [EXACT, ONE_THREAD, f"--train.steps={PLAIN_STEPS}", "--checkpoint.every=8"]


@pytest.fixture(scope="module")
def plain_alone(tmp_path_factory: pytest.TempPathFactory) -> Alone:
    """``python examples/plain_loop.py`` with exact reduction, run in a folder of its own: its result and the
    folder. One worker, so it is also the failure-free run that the plain loop's runs with kills must equal."""
    cwd = tmp_path_factory.mktemp("plain_alone")
    cmd = [sys.executable, str(PLAIN), *PLAIN_COMMON]
    return run_command(cmd, cwd=cwd, capture_output=True, text=True, timeout=280), cwd


def alone_run(alone: Alone) -> Path:
    result, cwd = alone
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = (cwd / "runs").iterdir()  # a job of one worker, its run directory as unbroken train makes it
    return run


def test_the_plain_loop_is_short_and_runs_alone(plain_alone: Alone) -> None:
    """``python examples/plain_loop.py --train.steps=24``, as its docstring shows (with exact reduction and one
    thread: the run is the kill test's reference too): one worker in the script's own process, and nothing on
    stderr but log lines (it once ended with c10d's C++ stack for a store wait that its exit cut off)."""
    assert len(PLAIN.read_text().splitlines()) < 80
    result, _ = plain_alone
    run = alone_run(plain_alone)
    assert "frame #" not in result.stderr and "[c10d]" not in result.stderr, result.stderr[-3000:]
    final = read_records(run, "final")[0]
    assert final["step"] == PLAIN_STEPS and list(final["checksums"]) == ["0"]
    ckpt.verify(run, PLAIN_STEPS)


def test_the_plain_loop_with_kills_is_bitwise_the_failure_free_run(tmp_path: Path, plain_alone: Alone) -> None:
    schedule = "kill:worker=0,step=5,phase=backward,rejoin=1; kill:worker=2,step=11,phase=reduction,rejoin=1"
    killed = tmp_path / "killed"
    result = launch(killed, PLAIN, *PLAIN_COMMON, f"--failures.schedule={schedule}", workers=3, fork=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [f["worker"] for f in read_records(killed, "failure")] == [0, 2]
    same_final(alone_run(plain_alone), killed, PLAIN_STEPS)
    assert read_records(killed, "final")[0]["identical"]


def test_the_hugging_face_example_with_a_kill(tmp_path: Path) -> None:
    """Two workers (each imports transformers): worker 1 killed in a backward (its restart, due 1 s later, may
    come after the run's end: the claim is the survivor's); under MeCeFO its ring neighbour, worker 0, takes its
    microbatches in efficient mode."""
    common = [EXACT, ONE_THREAD, "--train.steps=10", "--checkpoint.every=0"]
    kill = "--failures.schedule=kill:worker=1,step=4,phase=backward,rejoin=1"
    reference, killed, mecefo = tmp_path / "reference", tmp_path / "killed", tmp_path / "mecefo"
    assert launch(reference, HF, *common, workers=1, fork=True).returncode == 0
    result = launch(killed, HF, *common, kill, workers=2, fork=True)
    assert result.returncode == 0, result.stderr[-3000:]
    same_final(reference, killed, 10)
    mecefo_args = ["--train.steps=10", "--recovery.policy=mecefo", "--mecefo.rank=8", kill]
    result = launch(mecefo, HF, *mecefo_args, workers=2, fork=True)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = read_records(mecefo, "step")
    assert sum(r["efficient"] for r in steps) >= 1  # the neighbour took worker 1's microbatches in efficient mode
    assert read_records(mecefo, "final")[0]["identical"]


def test_a_hugging_face_model_in_the_trainer_with_kills_is_the_failure_free_run(
    tmp_path: Path, data_cache_dir: Path
) -> None:
    common = [EXACT, ONE_THREAD, "--model.hf_config=llama-tiny"]
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    assert train(reference, data_cache_dir, *common, workers=1).returncode == 0
    schedule = "kill:worker=2,step=2,phase=forward,rejoin=0.5; kill:worker=0,step=5,phase=reduction"
    result = train(killed, data_cache_dir, *common, f"--failures.schedule={schedule}", workers=3)
    assert result.returncode == 0, result.stderr[-3000:]
    same_final(reference, killed, 8)


def test_export_gives_a_hugging_face_model_that_computes_the_same_function(
    tmp_path: Path, tiny_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our LLaMA, exported: in float64 the Hugging Face model's logits equal ours up to the rounding of a
    different order of the same operations (float64: relative 1e-12 is thousands of ulps of room). Hugging
    Face's RMSNorm computes in float32 even in a float64 model; for this comparison it computes the same
    formula in the model's dtype, so only the weights' layout is under test."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    def rms_norm(self: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm)

    from unbroken.train.model import Transformer, model_args

    run = tiny_run  # the session's finished run (tests/conftest.py): export only reads it
    out = tmp_path / "hf"
    result = run_command(
        [sys.executable, "-m", "unbroken", "export", str(run), str(out)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "tokenizer.json").is_file()
    state = ckpt.verify(run, 8)  # its last checkpoint, the one export converts
    ours = Transformer(model_args("tiny", vocab_size=state["metadata"]["vocab_size"], max_seq_len=64))
    ours.load_state_dict(state["model"])
    theirs = LlamaForCausalLM.from_pretrained(str(out))
    tokens = torch.randint(0, state["metadata"]["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ours.double()(tokens)
        b = theirs.double()(input_ids=tokens).logits
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-12 * float(a.abs().max()))
    refused = run_command(
        [sys.executable, "-m", "unbroken", "export", str(run), str(out)], capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == 2 and "is not empty" in refused.stderr


def test_launch_refuses_a_missing_script(tmp_path: Path) -> None:
    result = launch(tmp_path / "run", tmp_path / "nope.py")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "nope.py does not exist" in lines[0]
    assert not (tmp_path / "run").exists()


SCRIPT_HEAD = """import os
import torch
from torch import nn
import unbroken.ft as ft

ctx = ft.init()
print(f"hello from worker {os.environ['UNBROKEN_WORKER_ID']}", flush=True)
torch.manual_seed(0)
model = nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ctx.register_state(model, opt)
"""
SCRIPT_LOOP = """for step in ctx.steps():
    for mb in step.microbatches():
        x, y = data(step.index, mb)
        step.backward(nn.functional.mse_loss(model(x), y), **INPUTS)
    step.commit(opt)
    if ctx.rank == 0:
        print(f"committed step {step.index} on worker {ctx.worker_id}", flush=True)
"""


def test_the_leader_s_output_is_on_the_console_and_every_worker_s_in_its_log(tmp_path: Path) -> None:
    """As torchrun --tee: the console shows what the group's leader prints, tagged with the worker that printed
    it, and follows the leader when it changes (worker 0 killed: worker 1 leads); every worker's prints stay in
    its log."""
    script = tmp_path / "tee.py"
    script.write_text(
        SCRIPT_HEAD
        + "def data(step, mb):\n    g = torch.Generator().manual_seed(1000 * step + mb)\n"
        + "    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)\n\n"
        + SCRIPT_LOOP.replace("**INPUTS", "")
    )
    out = tmp_path / "run"
    kill = "--failures.schedule=kill:worker=0,step=2,phase=backward"
    # Started cold (no --fork), as a script's workers are by default: the output of that start is the claim.
    result = launch(out, script, ONE_THREAD, "--train.steps=5", "--checkpoint.every=0", kill, workers=3)
    assert result.returncode == 0, result.stderr[-3000:]
    tagged = [re.match(r"^\[worker (\d)\] ((hello|committed) .*)$", line) for line in result.stdout.splitlines()]
    console = [m[2] for m in tagged if m]
    for m in filter(None, tagged):
        assert m[2].endswith(f"worker {m[1]}"), m[0]  # tagged with the worker that printed it
    logs = {w: (out / "logs" / f"worker-{w}.log").read_text() for w in range(3)}
    for w in range(3):
        assert f"hello from worker {w}\n" in logs[w]  # each worker's prints are in its log
    assert console[:1] == ["hello from worker 0"], result.stdout[-3000:]  # before the group forms: worker 0
    assert "hello from worker 1" not in console and "hello from worker 2" not in console
    committed = [(int(line.split()[2]), int(line.split()[-1])) for line in console[1:]]
    assert [s for s, _ in committed] == list(range(5)), console  # each step once, by whoever led
    leaders = [w for _, w in committed]
    assert leaders == sorted(leaders) and set(leaders) == {0, 1}, console  # worker 0 led, then worker 1
    for w in (0, 1):  # what each printed as the leader, all of it and nothing else
        printed = [line for line in logs[w].splitlines() if line.startswith("committed")]
        assert printed == [line for line in console[1:] if line.endswith(f"worker {w}")]


def test_launch_warns_of_idle_workers_and_of_data_seeded_with_python_hash(tmp_path: Path) -> None:
    """3 workers for M = 2: worker 2 computes nothing in a step (one line at launch). The script seeds its data
    with Python's hash() of a string, different in every process (PYTHONHASHSEED unset): the data check (the
    idle worker 2 computes worker 0's microbatch 0 again) says so in one line."""
    script = tmp_path / "hashed.py"
    script.write_text(
        SCRIPT_HEAD
        + "def data(step, mb):\n    g = torch.Generator().manual_seed(hash(f'{step}/{mb}') % 2**63)\n"
        + "    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)\n\n"
        + SCRIPT_LOOP.replace("**INPUTS", "inputs=(x, y)")
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    cmd = [sys.executable, "-m", "unbroken", "launch", "--workers", "3", "--out", str(tmp_path / "run"), "--quiet"]
    cmd += [ONE_THREAD, "--train.steps=2", "--train.microbatches=2", "--checkpoint.every=0", str(script)]
    result = run_command(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("unbroken: warning: ")]
    assert len(warnings) == 2, result.stderr[-3000:]
    assert "train.microbatches = 2: worker 2 computes nothing" in warnings[0]
    assert "step 0: microbatch 0 has different inputs on worker 0 and worker 2" in warnings[1]
    assert "not a pure function of (seed, step, microbatch id)" in warnings[1]
