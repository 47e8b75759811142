"""The documented ways to start a job on several hosts, run for real on this machine: ``deploy/slurm.sbatch``
submitted with ``sbatch`` to a two-node Slurm cluster, and two ``torchrun`` instances (two "nodes" meeting
through torchrun's c10d rendezvous) each running ``unbroken agent``. In both, a worker is killed with
``kill -9`` from outside, found as an operator would (by the job's token in its environment), and the run
ends bitwise equal to the failure-free one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import slurmcluster
from runner import (
    CONTROL_COMMON,
    CONTROL_STEPS,
    ROOT,
    TINY,
    committed,
    control_pace,
    free_port,
    popen,
    same_final,
    wait_for,
    worker_pids,
)

from unbroken.control.store.gateway import TOKEN_ENV, new_token
from unbroken.core.records import read_records, step_losses

pytestmark = pytest.mark.timeout(300)

KILL_AT_STEP = 8


def _env(token: str) -> dict[str, str]:
    """The job's environment: its token, and this checkout's interpreter first on PATH (``unbroken``,
    ``torchrun``)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, TOKEN_ENV: token, "PATH": path}


def _kill_one_worker(token: str, run: Path, proc: subprocess.Popen[bytes], victim: int, logs: list[Path]) -> None:
    wait_for(lambda: committed(run) >= KILL_AT_STEP or proc.poll() is not None, 180, f"step {KILL_AT_STEP}")
    if proc.poll() is not None:
        tails = "\n".join(f"{log.name}: {log.read_text()[-2000:]}" for log in logs if log.exists())
        raise AssertionError(f"the job ended (exit status {proc.returncode}) before the kill\n{tails}")
    pids = worker_pids(token)
    assert sorted(pids) == [0, 1], pids
    os.kill(pids[victim], signal.SIGKILL)


def _check_run(run: Path, reference: Path, victim: int) -> None:
    failures = read_records(run, "failure")
    assert [f["worker"] for f in failures] == [victim] and "SIGKILL" in failures[0]["why"], failures
    final = read_records(run, "final")[0]
    assert final["identical"], final
    assert sorted(step_losses(run)) == list(range(CONTROL_STEPS))
    assert step_losses(run) == step_losses(reference)
    same_final(reference, run, CONTROL_STEPS)


def test_slurm_sbatch_two_nodes_with_a_worker_killed(
    tmp_path: Path, data_cache_dir: Path, control_reference: Path
) -> None:
    """``sbatch --nodes=2 deploy/slurm.sbatch configs/tiny.toml ...`` with WORKERS_PER_NODE=1 on a real
    two-node Slurm cluster: the coordinator on the first node, one agent per node (``srun``), node rank from
    SLURM_NODEID. Worker 1 (node 2) is killed from outside; its agent reports it and restarts it."""
    reason = slurmcluster.missing()
    if reason is not None:
        pytest.skip(reason)
    token = new_token()
    run = tmp_path / "run"
    with slurmcluster.SlurmCluster(tmp_path / "slurm") as cluster:
        env = {**cluster.env, **_env(token), "WORKERS_PER_NODE": "1", "RUN_DIR": str(run)}
        env["UNBROKEN_PORT"] = str(free_port())
        cmd = ["sbatch", "--wait", "--nodes=2", f"--output={tmp_path / 'job.out'}", str(ROOT / "deploy/slurm.sbatch")]
        cmd += [TINY, *CONTROL_COMMON, f"--data.cache_dir={data_cache_dir}", "--failures.mttr_s=0.5"]
        cmd.append(f"--failures.schedule={control_pace(2)}")
        proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            _kill_one_worker(token, run, proc, victim=1, logs=[tmp_path / "job.out"])
            output, _ = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
                subprocess.run(["scancel", "--user=root"], env=cluster.env, timeout=30, check=False)
        job_out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
        assert proc.returncode == 0, output.decode()[-2000:] + job_out[-3000:]
    _check_run(run, control_reference, victim=1)
    joined = [tuple(m["members"]) for m in read_records(run, "membership")]
    assert joined[0] == (0, 1) and joined[-1] == (0, 1), joined  # worker 1 came back


def test_torchrun_two_nodes_each_running_an_agent(
    tmp_path: Path, data_cache_dir: Path, control_reference: Path
) -> None:
    """Two ``torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d ... -m unbroken agent`` stand for two
    hosts (GROUP_RANK gives each agent its node rank), with a coordinator started by hand. A worker is killed
    from outside: torchrun, which would restart every worker of the job on any failure, sees nothing; the
    agent reports the exit, restarts the worker, and the run goes on in the same processes."""
    if shutil.which("torchrun", path=_env("")["PATH"]) is None:
        pytest.skip("torchrun is not on PATH (it comes with torch)")
    token = new_token()
    env = _env(token)
    run, port, rdzv = tmp_path / "run", free_port(), free_port()
    common = [*CONTROL_COMMON, f"--data.cache_dir={data_cache_dir}", "--failures.mttr_s=0.5"]
    common.append(f"--failures.schedule={control_pace(2)}")
    logs = [open(tmp_path / name, "ab") for name in ("coordinator.log", "node0.log", "node1.log")]  # noqa: SIM115
    coordinator = popen(
        [sys.executable, "-m", "unbroken", "coordinator", TINY, "--workers", "2", "--port", str(port)]
        + ["--run-dir", str(run), *common],
        env=env,
        stdout=logs[0],
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    torchrun = ["torchrun", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-id=job-{rdzv}"]
    torchrun += [f"--rdzv-endpoint=127.0.0.1:{rdzv}", "--max-restarts=0", "-m", "unbroken", "agent"]
    torchrun += ["--coordinator", f"127.0.0.1:{port}", "--workers", "1"]
    nodes = [
        subprocess.Popen(torchrun, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        for log in logs[1:]
    ]
    try:
        _kill_one_worker(token, run, nodes[0], victim=1, logs=[tmp_path / n for n in ("coordinator.log", "node0.log")])
        codes = [p.wait(timeout=240) for p in (*nodes, coordinator)]
    finally:
        for p in (coordinator, *nodes):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for log in logs:
            log.close()
    assert codes == [0, 0, 0], "\n".join((tmp_path / n).read_text()[-2000:] for n in ("node0.log", "node1.log"))
    _check_run(run, control_reference, victim=1)
