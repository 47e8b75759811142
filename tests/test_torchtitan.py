"""unbroken as torchtitan's fault-tolerance layer (issue 66): torchtitan's Llama 3 debug model, trained by torchtitan's
own Trainer, model registry, ``parallelize_fn`` (FSDP2 and tensor parallelism inside a replica) and optimizer and
LR-schedule containers, under ``unbroken launch`` (``examples/torchtitan_train.py``, ``unbroken.integrations.
torchtitan``), real processes on gloo, exact mode.

The oracle is parity. torchtitan initialises its weights through DTensor's RNG, so they depend on the replica's
layout (the shard count, the tensor degree): a run is compared with the failure-free run of one replica of the
same layout, which exact mode makes bitwise the same whatever the number of replicas and failures. The runs are
shared by the tests (module fixtures): one failure-free replica of 2 FSDP shards and one of 2 tensor ranks (each
saving a checkpoint at step 3), 2 replicas of each with a rank killed mid-backward and one mid-reduction (FSDP:
the killed replicas restart and rejoin; tensor ranks: a warm spare replica takes each killed replica's place),
and 1 replica of 2 shards x 2 tensor ranks resumed from the tensor-parallel reference's step-3 checkpoint (its
layout changes the sharding, not the arithmetic). Workers are forked (``--fork``): how a worker starts is not
what is tested here.

Skipped, in one line, where torchtitan is not installed (``pip install 'unbroken[torchtitan]'``; ``make test``
installs it).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runner import EXACT, ONE_THREAD, ROOT, run_command

from unbroken.core.records import read_records
from unbroken.ft.checkpoint import schema as ckpt

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("torchtitan") is None,
        reason="torchtitan is not installed (pip install 'unbroken[torchtitan]'; make test installs it)",
    ),
    pytest.mark.timeout(300),
]
FIXTURE_RUNS = {"fsdp_reference": 1, "fsdp_kills": 1, "tp_reference": 1, "tp_kills": 1}

SCRIPT = ROOT / "examples" / "torchtitan_train.py"
STEPS, M = 6, 4
# torchtitan's side: its debug model and config function, a short sequence, float32 parameters under FSDP.
TITAN = [
    "--module",
    "llama3",
    "--config",
    "llama3_debugmodel",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--training.mixed_precision_param",
    "float32",
]
# unbroken's side. Up to 6 processes of torchtitan beside another test on 2 cores: a 10 s heartbeat bound keeps a
# starved heartbeat from passing for a failure (the kills are seen from the process exits at once).
COMMON = [EXACT, ONE_THREAD, f"--train.steps={STEPS}", f"--train.microbatches={M}", "--comm.heartbeat_timeout_s=10"]
SHARD, TENSOR = "--parallel.shard=2", "--parallel.tensor=2"
# Replica 1's rank 1 dies mid-backward at step 1, replica 0's rank 0 mid-reduction at step 4; the steps after each
# are slow (a sleep: wall time, not CPU) so that the replaced replica is back before the next kill and the end.
KILLS = (
    "--failures.schedule=kill:worker=3,step=1,phase=backward{rejoin}; slow:worker=0,factor=8,steps=2-3; "
    "kill:worker=0,step=4,phase=reduction{rejoin}; slow:worker=2,factor=8,steps=5"
)
RUN_TIMEOUT_S = 600  # a run of up to 6 processes with 4 restarts on a loaded 2-core machine


def launch(
    out: Path, cache: Path, *args: str, workers: int, titan: list[str] = TITAN
) -> subprocess.CompletedProcess[str]:
    """``unbroken launch --fork ... examples/torchtitan_train.py TITAN`` into ``out``."""
    cmd = [sys.executable, "-m", "unbroken", "launch", "--workers", str(workers), "--out", str(out), "--quiet"]
    cmd += ["--fork", f"--data.cache_dir={cache}", *args, str(SCRIPT), *titan]
    return run_command(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def succeeded(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def corpus(data_cache_dir: Path) -> Path:
    """The text the runs train on (the embedded corpus, tokenized by a BPE of the debug model's 2,048 tokens: the
    wheel ships no torchtitan tokenizer), tokenized once here rather than by every worker at its start."""
    from unbroken.core.config import DataConfig
    from unbroken.data import open_corpus

    open_corpus(DataConfig(cache_dir=str(data_cache_dir), vocab_size=2048, seq_len=64, microbatch_size=2))
    return data_cache_dir


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """One replica of 2 FSDP shards, no failure."""
    out = tmp_path_factory.mktemp("titan") / "fsdp-reference"
    succeeded(launch(out, corpus, *COMMON, SHARD, "--checkpoint.every=3", workers=2))
    return out


@pytest.fixture(scope="module")
def fsdp_kills(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> tuple[Path, str]:
    """2 replicas of 2 FSDP shards, the two kills; each killed replica restarts and rejoins. (run, console)."""
    out = tmp_path_factory.mktemp("titan") / "fsdp-kills"
    kills = KILLS.format(rejoin=",rejoin=0.5")
    result = succeeded(launch(out, corpus, *COMMON, SHARD, "--checkpoint.every=0", kills, workers=4))
    return out, result.stdout + result.stderr


@pytest.fixture(scope="module")
def tp_reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """One replica of 2 tensor ranks, no failure."""
    out = tmp_path_factory.mktemp("titan") / "tp-reference"
    succeeded(launch(out, corpus, *COMMON, TENSOR, "--checkpoint.every=3", workers=2))
    return out


@pytest.fixture(scope="module")
def tp_kills(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """2 replicas of 2 tensor ranks and a warm spare replica, the two kills: a spare replica takes each killed
    replica's place (and a new one is started)."""
    out = tmp_path_factory.mktemp("titan") / "tp-kills"
    kills = KILLS.format(rejoin="")
    succeeded(launch(out, corpus, *COMMON, TENSOR, "--spares", "2", "--checkpoint.every=0", kills, workers=4))
    return out


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(run, "step") if not r.get("republished")}


def assert_equal_states(run: Path, reference: Path, step: int = STEPS) -> None:
    """The DCP checkpoint of ``step`` of ``run`` holds ``reference``'s, tensor by tensor (parameters, optimizer
    state), with the same LR schedule and train state; every step's loss is the reference's."""
    assert losses(run) == losses(reference)
    mine, theirs = ckpt.verify(run, step), ckpt.verify(reference, step)
    assert sorted(mine["model"]) == sorted(theirs["model"]) and mine["model"]
    different = [k for k in theirs["model"] if not torch.equal(mine["model"][k], theirs["model"][k])]
    assert not different, different[:3]
    moments = [{k: v for k, v in s["optimizer"].items() if isinstance(v, torch.Tensor)} for s in (mine, theirs)]
    assert moments[0].keys() == moments[1].keys() and moments[0]
    assert [k for k in moments[1] if not torch.equal(moments[0][k], moments[1][k])] == []
    assert (
        mine["extra"]
        == theirs["extra"]
        == {
            "lr_scheduler": {"last_epoch": step},
            "train_state": {"step": step, "ntokens_seen": step * M * 2 * 64},
        }
    )


def whole_state_bytes(run: Path) -> int:
    """The bytes of a whole copy of the model's parameters and optimizer tensors (a final checkpoint's)."""
    state = ckpt.verify(run, STEPS)
    tensors = [v for part in ("model", "optimizer") for v in state[part].values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def removed_and_joined(run: Path) -> list[tuple[set[int], str]]:
    """(the workers each new epoch removed, its reason) in order."""
    epochs = [(set(r["members"]), r["reason"]) for r in read_records(run, "membership")]
    return [(before - after, reason) for (before, _), (after, reason) in zip(epochs, epochs[1:], strict=False)]


def test_kills_in_fsdp_replicas_leave_the_final_dcp_state_the_failure_free_one_s(
    fsdp_kills: tuple[Path, str], fsdp_reference: Path
) -> None:
    """2 replicas x (FSDP 2): a rank killed mid-backward, then one mid-reduction. Each death takes its replica
    down whole, the survivor recomputes its microbatches in-step, the replica restarts and each of its ranks
    receives its own shard of the state from the rank at the same coordinate of the live replica. The final DCP
    checkpoint equals the one of one failure-free replica, tensor by tensor (so does every step's loss): N
    replicas are bitwise one, with failures or without. The console ends with the run summary and its goodput."""
    run, console = fsdp_kills
    assert sorted(r["worker"] for r in read_records(run, "injected")) == [0, 3]
    changes = removed_and_joined(run)
    assert ({2, 3}, "died: 3") in changes and ({0, 1}, "died: 0") in changes  # whole replicas, each in one epoch
    assert [reason for _, reason in changes].count("joined: 2, 3") == 1
    assert [reason for _, reason in changes].count("joined: 0, 1") == 1
    assert sum(r["recomputed"] for r in read_records(run, "step")) > 0  # the mid-backward kill's microbatches
    # A rejoining rank received its shard: about half of a whole copy of the state (2 FSDP shards), never all of it.
    received = [r["state_bytes"] for r in read_records(run, "recovery") if r["state_bytes"]]
    assert received and all(0 < b < 0.6 * whole_state_bytes(fsdp_reference) for b in received), received
    assert_equal_states(run, fsdp_reference)
    assert "goodput" in console and "unbroken run summary" in console


def test_kills_in_tensor_parallel_replicas_are_survived_by_warm_spares_bitwise(
    tp_kills: Path, tp_reference: Path
) -> None:
    """2 replicas x (TP 2) with a spare replica: the same two kills; each time the waiting spare replica (its ranks
    built their tensor slices of the model and formed their group at the start) takes the dead replica's worker
    ids, receives each rank's slice of the state and computes from the next step. The run ends as one failure-free
    replica of 2 tensor ranks, bitwise."""
    promoted = {(r["worker"], r["spare"]) for r in read_records(tp_kills, "spare") if r["state"] == "promoted"}
    assert {w for w, _ in promoted} == {0, 1, 2, 3} and len({s for _, s in promoted}) == 4, promoted
    changes = removed_and_joined(tp_kills)
    assert ({2, 3}, "died: 3") in changes and ({0, 1}, "died: 0") in changes
    received = [r["state_bytes"] for r in read_records(tp_kills, "recovery") if r["state_bytes"]]
    assert received and all(0 < b < whole_state_bytes(tp_reference) for b in received), received
    assert_equal_states(tp_kills, tp_reference)


def test_fsdp_x_tp_resumed_from_a_tensor_parallel_checkpoint_continues_bitwise(
    tp_reference: Path, tmp_path: Path, corpus: Path
) -> None:
    """The tensor-parallel reference's DCP checkpoint of step 3, resumed by one replica of 2 FSDP shards x 2 tensor
    ranks (torchtitan's FSDP x TP mesh over the replica's 4 ranks; DCP reshards the state): it ends at step 6 with
    the reference's state, bitwise (sharding changes no bit in exact mode; the tensor degree, which does, is the
    same)."""
    run = tmp_path / "resumed"
    shutil.copytree(tp_reference, run)
    for path in (run / "checkpoints").glob(f"step_{STEPS:08d}*"):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    succeeded(launch(run, corpus, "--resume", str(run), SHARD, TENSOR, workers=4))
    assert read_records(run, "resume")[-1]["step"] == 3
    assert read_records(run, "final")[-1]["identical"]
    assert_equal_states(run, tp_reference)


# Export the job's checkpoint into torchtitan's layout, load it with a plain torchtitan Trainer's checkpointer and
# compare; then the same comparison against a state with one tensor changed must name it (the check fires).
EXPORT = r"""
import json, sys
from pathlib import Path
import torch
from unbroken.integrations.torchtitan import checkpoint, cpu
with cpu.importing():
    import torchtitan.trainer
cpu.after_import()
path, state = checkpoint.export(Path(sys.argv[1]), Path(sys.argv[2]))
equal = checkpoint.check(path, state)
name = sorted(state["model"])[0]
state["model"][name] = state["model"][name] + 1
print(json.dumps({"path": str(path), "equal": equal, "changed": name, "found": checkpoint.check(path, state)}))
"""


def test_plain_torchtitan_loads_the_job_s_checkpoint(fsdp_reference: Path, tmp_path: Path) -> None:
    """The job's final checkpoint written in torchtitan's layout (by torchtitan's own checkpointer, from a Trainer
    of the job's command line) and loaded by a fresh plain torchtitan Trainer's checkpointer: every parameter
    (its fused attention projection split into wq/wk/wv on disk and merged back on load), every optimizer tensor,
    the LR schedule and the step equal the job's. The comparison names a tensor that differs."""
    result = subprocess.run(
        [sys.executable, "-c", EXPORT, str(fsdp_reference), str(tmp_path / "torchtitan")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["path"].endswith(f"step-{STEPS}") and (Path(report["path"]) / ".metadata").is_file()
    assert report["equal"] == []
    assert report["found"] == [f"model {report['changed']}"]


# Each case: torchtitan's overrides, unbroken's, and the setting the refusal must name ("" : accepted).
REFUSALS = [
    ([], [], ""),
    (["--training.global_batch_size", "64"], ["--train.microbatches=4"], "training.global_batch_size = 64"),
    (["--training.global_batch_size", "32"], ["--train.microbatches=4"], ""),  # 4 x its local batch of 8
    (
        ["--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs"],
        [],
        "parallelism.pipeline_parallel_degree = 2",
    ),
    (["--parallelism.data_parallel_replicate_degree", "2"], [], "parallelism.data_parallel_replicate_degree = 2"),
    (["--parallelism.tensor_parallel_degree", "2"], [], "parallelism.tensor_parallel_degree = 2"),
    (["--parallelism.tensor_parallel_degree", "2"], ["--parallel.tensor=2"], ""),
    (["--validator.enable"], [], "validator.enable = True"),
    ([], ["--train.compile=true"], "train.compile = True"),
    ([], ["--train.activation_checkpointing=block"], "train.activation_checkpointing = block"),
    ([], ["--recovery.policy=mecefo"], "recovery.policy = mecefo"),
    (
        ["--checkpoint.enable", "--checkpoint.no-initial-load-model-only", "--checkpoint.initial_load_path", "/x"],
        [],
        "checkpoint.initial_load_model_only = false",
    ),
    (["FAULT_TOLERANCE"], [], "fault_tolerance.enable = true"),
]
SETTINGS = r"""
import json, sys
from dataclasses import dataclass, field, fields
from unbroken.integrations.torchtitan import cpu
with cpu.importing():
    from torchtitan.trainer import Trainer
from torchtitan.config import ConfigManager
from unbroken.core.config import load_config
from unbroken.integrations.torchtitan.settings import own

@dataclass(kw_only=True, slots=True)
class FaultTolerance:  # the shape of torchtitan's experiments/torchft section
    enable: bool = True

class FaultTolerantTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)

base = ["--module", "llama3", "--config", "llama3_debugmodel"]
for titan, ours, _ in json.loads(sys.argv[1]):
    torchft = titan == ["FAULT_TOLERANCE"]
    config = ConfigManager().parse_args(base + ([] if torchft else titan))
    if torchft:
        config = FaultTolerantTrainer.Config(**{f.name: getattr(config, f.name) for f in fields(config) if f.init})
    try:
        own(config, load_config(None, ours))
        print("")
    except ValueError as e:
        print(str(e).replace("\n", " "))
"""


def test_settings_the_integration_cannot_honour_are_refused_in_one_line(tmp_path: Path, corpus: Path) -> None:
    """On torchtitan's configs (its debug model's, with overrides) and unbroken's: torchtitan's own fault
    tolerance, gradient accumulation set against M, pipeline parallelism, a replicate degree, a tensor degree the
    job's replicas do not have, its validator, a full-state resume of a torchtitan checkpoint, and unbroken's
    compile, activation checkpointing and MeCeFO are each refused in one line naming the setting; the defaults,
    a global batch that says M x the local batch, and a tensor degree the replicas have are accepted. A refused
    setting stops a launched job at its start: the line on the launcher's console, no step run."""
    result = subprocess.run(
        [sys.executable, "-c", SETTINGS, json.dumps(REFUSALS)], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()[-len(REFUSALS) :]
    for (titan, ours, named), line in zip(REFUSALS, lines, strict=True):
        assert line.startswith(named) if named else line == "", (titan, ours, line)
        assert "\n" not in line
    run = tmp_path / "refused"
    refused = launch(run, corpus, *COMMON, workers=1, titan=[*TITAN, "--training.global_batch_size", "64"])
    assert refused.returncode != 0
    (line,) = [x for x in refused.stdout.splitlines() if "unbroken.integrations.torchtitan:" in x]
    assert line.startswith("[worker 0] unbroken.integrations.torchtitan: training.global_batch_size = 64 asks for")
    assert read_records(run, "step") == []
