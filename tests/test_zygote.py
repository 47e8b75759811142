"""Workers forked by the zygote (``control.zygote``): the wire, and training that cannot tell a forked worker from
a started one.

The wire is driven from a process of its own (``scripts/zygote_driver.py``): the driver becomes a child
subreaper, which the pytest process must not (it would inherit every orphan of the other tests). The oracle for
fork safety is the cold start: a run whose workers, the restarted one included, are forked after the zygote
served others must be bitwise the run whose workers all started as fresh processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runner import EXACT, ONE_THREAD, ROOT, final_params, run_command, train

from unbroken.control.host.command import WorkerCommand
from unbroken.control.host.zygote import FORK_SCRIPTS, ZYGOTE_ENV, forkable
from unbroken.core.config import RunConfig
from unbroken.core.records import read_records, step_losses
from unbroken.train.launch import script_worker, trainer_worker

pytestmark = pytest.mark.timeout(240)

SCRIPTS = Path(__file__).parent / "scripts"


def test_which_commands_the_zygote_forks() -> None:
    """The built-in trainer always (unless ``UNBROKEN_ZYGOTE=0``, ``enabled``); a script, whatever its file is named,
    only when its launch asked for it (``--fork``); nothing that is not this interpreter running a module or a file.
    What is safe to fork is the caller's word (``WorkerCommand.fork_safe``): the control plane knows no program."""
    python, scripts, cfg = sys.executable, {ZYGOTE_ENV: FORK_SCRIPTS}, RunConfig()
    assert forkable(trainer_worker(cfg), {}) and not forkable(script_worker(trainer_worker(cfg).argv)(cfg), {})

    def script(*argv: str) -> WorkerCommand:
        return script_worker(argv)(cfg)

    assert forkable(script(python, "/jobs/train.py", "--lr", "3"), scripts)
    assert forkable(script(python, "/jobs/train"), scripts)
    assert not forkable(script(python, "/jobs/train.py"), {ZYGOTE_ENV: "1"})
    assert not forkable(script(python, "-c", "print(1)"), scripts)
    assert not forkable(script(python, "-m", "mymodule"), scripts)
    assert not forkable(script("/usr/bin/python2", "/jobs/train.py"), scripts)
    assert not forkable(script(python), scripts)


@pytest.mark.parametrize("how", ["started", "early"])
def test_a_forked_worker_is_the_agent_s_child_with_its_own_environment_descriptors_and_session(
    tmp_path: Path, how: str
) -> None:
    """The zygote started as a program of its own, or forked from its agent at the agent's start (``fork_early``, as
    ``unbroken train`` does): the workers it forks cannot tell which."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(SCRIPTS / "zygote_driver.py"), str(tmp_path), how],
                            capture_output=True, text=True, timeout=180, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    zygote_log = (tmp_path / "zygote.log").read_text()
    if how == "early":
        assert out["zygote"] == out["early"]  # the agent's Zygote is the process forked at its start
        assert f"zygote forked from its program (pid {out['driver']})" in zygote_log
    else:
        assert out["early"] is None and "forked from its program" not in zygote_log
    # The driver reaps each worker itself (waitpid works only on one's own children): exit status, exception, kill.
    assert (out["own"]["code"], out["group"]["code"], out["killed"]["code"]) == (3, 1, -9)
    assert out["killed_stopped_poll"] is None  # stopped is not ended
    said = {s["mark"]: s for s in out["said"]}
    assert sorted(said) == ["group", "killed", "own"]  # each got its own request's environment
    for name, s in said.items():
        assert s["pid"] == out[name]["pid"] and s["forked"] == "1" and s["name"] == "__main__"
        assert s["torch_loaded"]  # imported before the fork: the worker starts at its first line
        assert s["preloaded"]  # the zygote imported what its agent named too (``preload``)
        assert s["warmed"]  # and ran the warm-up it named (``module:function``), before the fork
        assert not s["numba_loaded"]  # the exact fold's kernels only for an exact run: 57 MiB of every process
        assert s["ppid"] == out["driver"]  # the agent's child from its first line (the intermediate has exited)
        handed = int(s["argv"][2])
        assert handed in s["fds"] and len(set(s["fds"]) - {0, 1, 2, handed}) <= 1  # the one listing /proc/self/fd
        log = (tmp_path / f"{name}.log").read_text()
        assert "to the log" in log and "started by a fork of the agent's zygote" in log
    # A session of its own (the terminal's Ctrl-C reaches only the launcher), or the agent's process group (a
    # host's loss, ``kill -9`` of that group, takes its workers too).
    assert said["own"]["sid"] == said["own"]["pgid"] != out["pgid"]
    assert said["group"]["pgid"] == out["pgid"]
    assert "RuntimeError: a bug" in (tmp_path / "group.log").read_text()
    assert out["zygote_code"] == 0  # it ends when the driver closes its socket
    assert "zygote: no_such_module_here not preloaded" in zygote_log  # a module it cannot import stops nothing


def test_forked_workers_train_bitwise_what_cold_started_ones_do(tmp_path: Path, data_cache_dir: Path) -> None:
    """Worker 1 is killed at step 3 and restarted (forked again, after the zygote forked both workers). Each
    microbatch worker 0 computes from step 4 on takes 0.3 s more (it sleeps: the same arithmetic; 4 a step alone:
    at least 4.8 s over the 4 steps left, whatever the machine's speed), so the restart has seconds to rejoin
    before the run ends; unslowed, those steps took 0.6 s, and a forked restart 0.5 s after the kill came 0.02 s
    too late in one clean run (r34)."""
    schedule = "kill:worker=1,step=3,phase=backward,rejoin=0.5; slow:worker=0,seconds=0.3,steps=4-7"
    args = [EXACT, "--train.steps=8", "--checkpoint.every=0", f"--failures.schedule={schedule}"]
    runs = {}
    for name, setting in (("forked", "1"), ("cold", "0")):
        result = train(tmp_path / name, data_cache_dir, *args, workers=2, env={**os.environ, ZYGOTE_ENV: setting})
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = tmp_path / name
    forks = (runs["forked"] / "logs" / "worker-1.log").read_text().count("started by a fork of the agent's zygote")
    assert forks == 2  # its first start and its restart
    assert "started by a fork" not in (runs["cold"] / "logs" / "worker-1.log").read_text()
    # The launcher's coordinator comes from the same zygote (or starts cold with the workers).
    assert "started by a fork" in (runs["forked"] / "logs" / "coordinator.log").read_text()
    assert "started by a fork" not in (runs["cold"] / "logs" / "coordinator.log").read_text()
    # The launcher forked its zygote (it had imported torch already): a run imports torch once.
    assert "zygote forked from its program" in (runs["forked"] / "logs" / "zygote.log").read_text()
    assert not (runs["cold"] / "logs" / "zygote.log").exists()
    assert [tuple(m["members"]) for m in read_records(runs["forked"], "membership")] == [(0, 1), (0,), (0, 1)]
    # The admissions say how each start went, forked or cold as the setting says, each with the wall time since its
    # agent asked for it and its own CPU until then: two starts and the restart (a cold one may come too late).
    for name, run in runs.items():
        admitted = read_records(run, "admitted")
        expected = [[0, 1, 1]] if name == "forked" else [[0, 1, 1], [0, 1]]
        assert sorted(r["worker"] for r in admitted) in expected, admitted
        assert all(r["forked"] is (name == "forked") for r in admitted), admitted
        assert all(r["start_s"] > 0 and r["start_cpu_s"] > 0 for r in admitted), admitted
    assert step_losses(runs["forked"]) == step_losses(runs["cold"])
    cold = final_params(runs["cold"])
    assert all(torch.equal(tensor, cold[name]) for name, tensor in final_params(runs["forked"]).items())


def test_a_script_s_workers_are_forked_with_fork_and_train_bitwise_what_cold_started_ones_do(tmp_path: Path) -> None:
    """``unbroken launch --fork``: the workers of a user's script (examples/plain_loop.py) are forked from the
    launcher's zygote, worker 1's restart after its kill too; without it they start cold. The two runs are bitwise
    alike. Worker 0 sleeps 0.3 s more per microbatch from step 4 on (the same arithmetic), so the forked restart has
    seconds to rejoin before the end whatever the machine's speed."""
    schedule = "kill:worker=1,step=3,phase=backward,rejoin=0.5; slow:worker=0,seconds=0.3,steps=4-7"
    args = [EXACT, ONE_THREAD, "--train.steps=8", "--checkpoint.every=8", f"--failures.schedule={schedule}"]
    runs = {}
    for name, fork in (("forked", ["--fork"]), ("cold", [])):
        runs[name] = run = tmp_path / name
        cmd = [sys.executable, "-m", "unbroken", "launch", "--workers", "2", "--out", str(run), "--quiet", *fork]
        result = run_command([*cmd, *args, str(ROOT / "examples" / "plain_loop.py")], capture_output=True, text=True,
                             timeout=180)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    forked_log = (runs["forked"] / "logs" / "worker-1.log").read_text()
    assert forked_log.count("started by a fork of the agent's zygote") == 2  # its first start and its restart
    assert "started by a fork" not in (runs["cold"] / "logs" / "worker-1.log").read_text()
    for name, run in runs.items():
        # The forked restart rejoins; a cold one (an interpreter and torch to start) may come after the end on a
        # loaded machine, as in test_forked_workers_train_bitwise_what_cold_started_ones_do.
        epochs = [tuple(m["members"]) for m in read_records(run, "membership")]
        expected = [[(0, 1), (0,), (0, 1)]] if name == "forked" else [[(0, 1), (0,), (0, 1)], [(0, 1), (0,)]]
        assert epochs in expected, (name, epochs)
        assert all(r["forked"] is (name == "forked") for r in read_records(run, "admitted"))
    assert step_losses(runs["forked"]) == step_losses(runs["cold"])
    cold = final_params(runs["cold"])
    assert all(torch.equal(tensor, cold[name]) for name, tensor in final_params(runs["forked"]).items())
