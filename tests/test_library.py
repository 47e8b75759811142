"""The library's edges as a user meets them (issue 29, section 4): mistakes in the use of ``unbroken.ft`` are one
clear ``ValueError`` (raise statements: they hold under ``python -O``), ``ctx.evaluate`` records the validation
loss, and the data check catches a microbatch whose inputs depend on the worker that computes it.

The in-process tests run workers as threads on real gloo groups (``ftharness``); the data check's oracle is the
definition of a pure microbatch: the same (seed, step, id) gives the same input tensors on every worker, so
seeding from anything else (here: the worker's id, as Python's per-process ``hash()`` of a string does) must be
reported, and pure data never. The probe must not change training: exact mode makes N workers bitwise one
worker (who runs no probe), so a 3-worker run that probes must still equal it.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from ftharness import ThreadJob
from runner import ROOT, run_command
from torch import nn

from unbroken.core.config import RunConfig
from unbroken.core.records import read_records
from unbroken.ft.api import Context

pytestmark = pytest.mark.timeout(120)


def config(**sections: dict) -> RunConfig:
    cfg = RunConfig()
    base = {
        "train": {"steps": 3, "microbatches": 4, "threads": 1},
        "comm": {"heartbeat_timeout_s": 10.0, "heartbeat_interval_s": 0.1, "join_timeout_s": 30.0},
        "checkpoint": {"every": 0},
    }
    for name, values in {**base, **sections}.items():
        cfg = replace(cfg, **{name: replace(getattr(cfg, name), **{**base.get(name, {}), **values})})
    return cfg


def mlp() -> nn.Module:
    """The same weights in every worker. Workers here are threads of one process: they share torch's global RNG,
    so a model initialised from it (``manual_seed`` then the layers' own init) would depend on how the threads
    interleave; a generator of the model's own does not."""
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def seeded(step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + mb)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def pure(ctx: Context, worker: int, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = ctx.generator(step, mb)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def per_worker(ctx: Context, worker: int, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded with something of the worker's own (what ``hash()`` of a string does across processes)."""
    g = torch.Generator().manual_seed(1_000_000 * worker + 1000 * step + mb)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def loop(ctx: Context, worker: int, model: nn.Module, data=pure) -> dict[str, torch.Tensor]:  # noqa: ANN001
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.register_state(model, opt)
    for step in ctx.steps():
        for mb in step.microbatches():
            x, y = data(ctx, worker, step.index, mb)
            step.backward(nn.functional.mse_loss(model(x), y), tokens=16, inputs=(x, y))
        step.commit(opt)
    return {k: v.clone() for k, v in model.state_dict().items()}


def run(tmp_path: Path, cfg: RunConfig, workers: int, body, name: str = "run") -> dict:  # noqa: ANN001
    job = ThreadJob(tmp_path / name, cfg, workers)
    try:
        return job.run(body)
    finally:
        job.close()


def test_ctx_log_says_what_is_wrong_in_one_value_error(tmp_path: Path) -> None:
    said: list[str] = []

    def body(ctx: Context, worker: int) -> None:
        model = mlp()
        ctx.register_state(model)
        for step in ctx.steps():
            for mb in step.microbatches():
                x, y = seeded(step.index, mb)
                step.backward(nn.functional.mse_loss(model(x), y))
            step.commit(torch.optim.SGD(model.parameters(), lr=0.1))
            for kind, fields in [
                ("eval", {"loss": 1.0}),
                ("step", {"step": 0}),
                ("user", {"t": torch.ones(2)}),
                ("eval", {"step": 0, "val_loss": "low"}),
                ("user", {"time": 3}),
            ]:
                with pytest.raises(ValueError) as e:
                    ctx.log(kind, **fields)
                said.append(str(e.value))
            ctx.log("eval", step=step.index, val_loss=2.0)
            ctx.log("user", note="fine", items=[1, 2])

    run(tmp_path, config(train={"steps": 1}), 1, body)
    assert all("\n" not in line for line in said)
    assert "lacks step, val_loss" in said[0] and "'eval' (fields step, val_loss" in said[0]
    assert "a script logs" in said[1] and "the other kinds are the library's" in said[1]
    assert "Tensor" in said[2] and "float(t)" in said[2]
    assert "val_loss must be a number" in said[3]
    assert "time is set by the library" in said[4]
    (ev,) = read_records(tmp_path / "run", "eval")
    assert ev["val_loss"] == 2.0 and ev["val_ppl"] == pytest.approx(math.exp(2.0)) and ev["step"] == 0
    assert read_records(tmp_path / "run", "user")[0]["items"] == [1, 2]


def test_evaluate_records_the_validation_loss_of_the_last_committed_step(tmp_path: Path) -> None:
    """Two workers split 5 items; the record holds their mean, once (the leader publishes it)."""

    def body(ctx: Context, worker: int) -> list[float | None]:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx.register_state(model, opt)
        values = []
        for step in ctx.steps():
            for mb in step.microbatches():
                x, y = seeded(step.index, mb)
                step.backward(nn.functional.mse_loss(model(x), y))
            step.commit(opt)
            values.append(ctx.evaluate(5, lambda k, s=step.index: float(10 * s + k)))
            ctx.evaluate(5, lambda k: 99.0, record=False)
        return values

    results = run(tmp_path, config(train={"steps": 2}), 2, body)
    assert results[0] == results[1] == [2.0, 12.0]  # mean of 10 s + k over k < 5
    records = read_records(tmp_path / "run", "eval")
    assert [(r["step"], r["val_loss"]) for r in records] == [(0, 2.0), (1, 12.0)]


def test_a_missing_commit_says_call_commit_before_the_next_step(tmp_path: Path) -> None:
    def body(ctx: Context, worker: int) -> None:
        model = mlp()
        ctx.register_state(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for step in ctx.steps():
            for mb in step.microbatches():
                x, y = seeded(step.index, mb)
                step.backward(nn.functional.mse_loss(model(x), y))

    with pytest.raises(ValueError, match=r"^step 0: call step\.commit\(\) before the next step$"):
        run(tmp_path, config(), 1, body)


def test_register_state_refuses_extra_state_it_cannot_save(tmp_path: Path) -> None:
    def body(ctx: Context, worker: int) -> None:
        ctx.register_state(mlp(), cursor=5)

    with pytest.raises(ValueError, match=r"register_state\(cursor=\.\.\.\): a int has no state_dict"):
        run(tmp_path, config(), 1, body)


def test_the_data_check_reports_a_microbatch_that_depends_on_its_worker(tmp_path: Path) -> None:
    """Step 0 of 2 workers: the prober (worker 1, the last with the fewest ids) computes microbatch 0 of worker 0
    again; seeded by the worker's id its inputs differ, which every member sees once its reduction is done."""
    cfg = config(recovery={"reduction": "exact"})
    run(tmp_path, cfg, 2, lambda ctx, w: loop(ctx, w, mlp(), per_worker))
    (record,) = read_records(tmp_path / "run", "impure_data")
    assert (record["step"], record["microbatch"], record["workers"]) == (0, 0, [0, 1])
    assert "not a pure function of (seed, step, microbatch id)" in record["reason"] and "\n" not in record["reason"]


def test_pure_data_passes_the_check_and_the_probe_leaves_training_bitwise_unchanged(tmp_path: Path) -> None:
    """Exact mode: 3 workers (one probe, at step 0) end bitwise where 1 worker (no probe) does."""
    cfg = config(recovery={"reduction": "exact"})
    one = run(tmp_path, cfg, 1, lambda ctx, w: loop(ctx, w, mlp()), "one")[0]
    three = run(tmp_path, cfg, 3, lambda ctx, w: loop(ctx, w, mlp()), "three")
    assert read_records(tmp_path / "three", "impure_data") == []
    for params in three.values():
        assert all(torch.equal(params[k], one[k]) for k in one)


def test_the_probe_is_the_least_busy_member_and_an_owner_s_first_id() -> None:
    from unbroken.core.plan import plan_step
    from unbroken.ft import datacheck

    assert datacheck.choose_probe(plan_step(0, [0, 1], 4)) == datacheck.Probe(0, 0, 1)
    assert datacheck.choose_probe(plan_step(0, [3, 5, 7], 2)) == datacheck.Probe(0, 3, 7)  # 7 is idle
    assert datacheck.choose_probe(plan_step(0, [2], 4)) is None
    a, b = datacheck.generator(1, 2, 3), datacheck.generator(1, 2, 3)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    assert datacheck.seed_of(1, 2, 3) != datacheck.seed_of(1, 3, 2)


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "train_script.py"
    path.write_text(
        "import sys\nimport torch\nfrom torch import nn\nimport unbroken.ft as ft\n\n"
        "def data(seed, step, mb):\n"
        "    g = ft.generator(seed, step, mb)\n"
        "    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)\n\n" + body
    )
    return path


@pytest.mark.timeout(200)
def test_python_script_alone_takes_overrides_and_a_missing_commit_is_one_error_under_O(tmp_path: Path) -> None:
    """``python my_train.py --train.steps=2 --my-flag``: ft.init(overrides=sys.argv[1:]) takes the config keys and
    leaves the script's own; a script that forgets commit() stops with the ValueError, under ``python -O`` too."""
    train = script(
        tmp_path,
        "ctx = ft.init(overrides=sys.argv[1:])\n"
        "assert '--my-flag' in sys.argv\n"
        "torch.manual_seed(0)\n"
        "model = nn.Linear(8, 4)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "ctx.register_state(model, opt)\n"
        "for step in ctx.steps():\n"
        "    for mb in step.microbatches():\n"
        "        x, y = data(ctx.config.train.seed, step.index, mb)\n"
        "        step.backward(nn.functional.mse_loss(model(x), y), inputs=(x, y))\n"
        "    if '--forget-commit' not in sys.argv:\n"
        "        step.commit(opt)\n",
    )
    args = ["--train.steps=2", "--train.threads=1", "--checkpoint.every=0", "--my-flag"]
    ok = run_command([sys.executable, str(train), *args], cwd=tmp_path, capture_output=True, text=True, timeout=150)
    assert ok.returncode == 0, ok.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert read_records(run_dir, "final")[0]["step"] == 2
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bad = run_command(
        [sys.executable, "-O", str(train), *args, "--forget-commit", f"--train.out_dir={tmp_path / 'bad'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
    )
    assert bad.returncode != 0
    assert "ValueError: step 0: call step.commit() before the next step" in bad.stderr, bad.stderr[-3000:]


def test_export_of_a_script_s_run_is_one_line(tmp_path: Path) -> None:
    """A library run's checkpoint holds the script's own model, which export cannot rebuild: one line, exit 2."""
    run(tmp_path, config(train={"steps": 1}), 1, lambda ctx, w: loop(ctx, w, mlp()))
    assert read_records(tmp_path / "run", "final")[0]["step"] == 1
    result = run_command(
        [sys.executable, "-m", "unbroken", "export", str(tmp_path / "run"), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("unbroken: error: export: ") and "a script's own model" in line
    assert not (tmp_path / "hf").exists()


def private_uses_of_ft(source: str) -> list[str]:
    """What ``source`` (a module importing ``unbroken.ft as ft``) takes from ``unbroken.ft`` outside its public API
    (``unbroken.ft.__all__``): an import of one of its modules, or an ``ft.NAME`` that ``__all__`` does not hold."""
    import ast

    import unbroken.ft as ft

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("unbroken.ft"):
            if node.module != "unbroken.ft" or any(a.name not in ft.__all__ for a in node.names):
                found.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.startswith("unbroken.ft.")]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ft":
            if node.attr not in ft.__all__:
                found.append(f"ft.{node.attr}")
    return found


def test_the_built_in_trainer_uses_only_the_public_api() -> None:
    import unbroken.ft as ft

    assert private_uses_of_ft((ROOT / "unbroken" / "train" / "trainer.py").read_text()) == []
    assert all(hasattr(ft, name) for name in ft.__all__)  # the lazy ones (FSDP, tensor parallelism) too
    doctored = (
        "import unbroken.ft as ft\nimport unbroken.ft.process\nfrom unbroken.ft.checkpoint import schema\n"
        "from unbroken.ft import Context, comm\nft.init()\nft.api.Context\n"
    )
    assert private_uses_of_ft(doctored) == [
        "import unbroken.ft.process",
        "from unbroken.ft.checkpoint import schema",
        "from unbroken.ft import Context, comm",
        "ft.api",
    ]
