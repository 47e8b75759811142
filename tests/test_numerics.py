"""What decides a worker's bits (unbroken.core.numerics, unbroken.ft.determinism): deterministic kernels in force in
every worker process however it was started, the fingerprint exact mode compares at join, the intra-op thread
count exact mode fixes, and the one line that stops a run on an op without a deterministic implementation.

The settings are read back inside each worker: its fingerprint, which the coordinator records when it admits
the worker (``admitted`` records), is made in the worker process from torch's own state."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runner import EXACT, ROOT, TINY, run_command, train, unbroken

from unbroken.control.store.gateway import TOKEN_ENV, new_token
from unbroken.control.store.netif import free_port
from unbroken.core.config import load_config
from unbroken.core.numerics import CUBLAS_WORKSPACE, differences, group_fingerprint, refusal
from unbroken.core.records import read_records
from unbroken.ft.process import intra_op_threads

pytestmark = pytest.mark.timeout(300)

SCRIPTS = ROOT / "tests" / "scripts"
ON = {
    "deterministic_algorithms": "true",
    "deterministic_warn_only": "false",
    "cublas_workspace_config": CUBLAS_WORKSPACE,
    "cudnn_deterministic": "true",
    "cudnn_benchmark": "false",
}


def admitted(run_dir: Path) -> dict[int, dict[str, str]]:
    return {r["worker"]: r["fingerprint"] for r in read_records(run_dir, "admitted")}


def launch(
    script: Path,
    out: Path,
    cache: Path,
    *args: str,
    workers: int,
    env: dict[str, str] | None = None,
    quiet: bool = True,
    fork: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``unbroken launch SCRIPT``; ``fork``: its workers forked from the launcher's zygote (``--fork``), for the
    tests whose claim is not about how a script's worker starts."""
    cmd = [sys.executable, "-m", "unbroken", "launch", "--workers", str(workers), "--out", str(out)]
    cmd += [*(["--quiet"] if quiet else []), *(["--fork"] if fork else []), f"--data.cache_dir={cache}", *args]
    cmd.append(str(script))
    return run_command(cmd, capture_output=True, text=True, timeout=240, env=env)


def test_deterministic_kernels_are_in_force_in_every_worker_of_unbroken_train(
    tmp_path: Path, data_cache_dir: Path
) -> None:
    """Exact mode switches them on (train.deterministic = auto); fp32 leaves torch's defaults."""
    exact = train(tmp_path / "exact", data_cache_dir, EXACT, "--train.steps=2", workers=2)
    assert exact.returncode == 0, exact.stderr[-2000:]
    fingerprints = admitted(tmp_path / "exact")
    assert sorted(fingerprints) == [0, 1]
    for fp in fingerprints.values():
        assert {k: fp[k] for k in ON} == ON
    fp32 = train(tmp_path / "fp32", data_cache_dir, "--train.steps=2", workers=1)
    assert fp32.returncode == 0, fp32.stderr[-2000:]
    off = admitted(tmp_path / "fp32")[0]
    assert off["deterministic_algorithms"] == "false" and off["cudnn_deterministic"] == "false"


def test_deterministic_kernels_are_in_force_in_a_script_under_unbroken_launch(
    tmp_path: Path, data_cache_dir: Path
) -> None:
    """A user's own loop (ft.init) with train.deterministic = on asked for explicitly, in fp32 mode."""
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    result = launch(
        ROOT / "examples" / "plain_loop.py",
        tmp_path / "run",
        data_cache_dir,
        "--train.steps=2",
        "--train.deterministic=on",
        workers=2,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    fingerprints = admitted(tmp_path / "run")
    assert sorted(fingerprints) == [0, 1]
    for fp in fingerprints.values():
        assert {k: fp[k] for k in ON} == ON


def test_deterministic_kernels_are_in_force_in_the_workers_of_an_agent(tmp_path: Path, data_cache_dir: Path) -> None:
    """A coordinator and one host's agent (the multi-host path): the agent starts the workers."""
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    env[TOKEN_ENV] = new_token()
    port, run = free_port(), tmp_path / "run"
    overrides = [EXACT, "--train.steps=2", "--train.threads=1", f"--data.cache_dir={data_cache_dir}"]
    coordinator = unbroken("coordinator", TINY, "--workers", "2", "--port", str(port), "--run-dir", str(run),
                           *overrides, env=env, log=tmp_path / "coordinator.log")  # fmt: skip
    agent = unbroken("agent", "--coordinator", f"127.0.0.1:{port}", "--workers", "2", env=env, log=tmp_path / "a.log")
    try:
        assert coordinator.wait(timeout=200) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        assert agent.wait(timeout=60) == 0, (tmp_path / "a.log").read_text()[-3000:]
    finally:
        for p in (coordinator, agent):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    fingerprints = admitted(run)
    assert sorted(fingerprints) == [0, 1]
    for fp in fingerprints.values():
        assert {k: fp[k] for k in ON} == ON


def test_a_worker_with_another_fingerprint_is_refused_at_start_and_at_rejoin(
    tmp_path: Path, data_cache_dir: Path
) -> None:
    """Exact mode, 3 workers: worker 2 reports another CPU ISA from its start and is kept out of the first epoch;
    worker 1 is killed at step 2 and comes back with another ISA too, and is refused at its join. Each is told
    in one line, the run goes on with the others and finishes."""
    (tmp_path / "marks").mkdir()
    env = {**os.environ, "UNBROKEN_TEST_FAKE_FINGERPRINT_DIR": str(tmp_path / "marks")}
    result = launch(
        SCRIPTS / "fake_fingerprint.py",
        tmp_path / "run",
        data_cache_dir,
        EXACT,
        "--train.steps=8",
        "--failures.schedule=kill:worker=1,step=2,phase=backward,rejoin=0.5",
        workers=3,
        env=env,
        quiet=False,
        fork=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    refused = {r["worker"]: r["reason"] for r in read_records(run, "refused")}
    assert sorted(refused) == [1, 2]
    for worker, reason in refused.items():
        assert reason.startswith(f"worker {worker} refused: exact mode needs identical hardware and software")
        assert "cpu_isa: ANOTHER-ISA vs " in reason and "\n" not in reason
        log = (run / "logs" / f"worker-{worker}.log").read_text()
        assert log.count(reason) == 1, log[-2000:]
    memberships = read_records(run, "membership")
    assert memberships[0]["members"] == [0, 1]
    assert all(2 not in m["members"] for m in memberships)
    assert not any(1 in m["members"] for m in memberships if str(m["reason"]).startswith("joined"))
    final = read_records(run, "final")[0]
    assert sorted(final["checksums"]) == ["0"]
    assert refused[2] in result.stdout  # the console says it too


@pytest.mark.parametrize("where", ["backward", "forward"])
def test_an_op_without_a_deterministic_implementation_stops_the_run_with_one_line(
    tmp_path: Path, data_cache_dir: Path, where: str
) -> None:
    """In the backward (inside ``step.backward``) or in the user's forward (an exception out of the loop): not a
    failure and not a bug to survive once, but the run's settings: the job stops at the first occurrence."""
    env = {**os.environ, "UNBROKEN_TEST_NONDETERMINISTIC_IN": where}
    result = launch(SCRIPTS / "nondeterministic_op.py", tmp_path / "run", data_cache_dir, EXACT, "--train.steps=5",
                    workers=2, env=env, fork=True)  # fmt: skip
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("unbroken: error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "put_ has no deterministic implementation" in errors[0] and "--train.deterministic=off" in errors[0]
    assert max(r["step"] for r in read_records(tmp_path / "run", "step")) == 1  # steps 0 and 1 committed


def test_in_exact_mode_n_workers_train_what_one_trains_with_the_default_threads(
    tmp_path: Path, data_cache_dir: Path
) -> None:
    """A loop whose gradient depends on how a large sum is split over threads: with the default thread count, one
    worker and two workers end bitwise equal (exact mode gives each worker one intra-op thread)."""
    finals = []
    for workers in (1, 2):
        result = launch(SCRIPTS / "thread_sensitive.py", tmp_path / f"w{workers}", data_cache_dir, EXACT,
                        "--train.steps=3", workers=workers)  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        final = read_records(tmp_path / f"w{workers}", "final")[0]
        assert final["identical"]
        finals.append(set(final["checksums"].values()))
        assert {fp["intra_op_threads"] for fp in admitted(tmp_path / f"w{workers}").values()} == {"1"}
    assert finals[0] == finals[1]


def test_workers_started_by_torchrun_take_torchruns_thread_count(tmp_path: Path, data_cache_dir: Path) -> None:
    """``torchrun --nproc-per-node=2 my_script.py`` against a coordinator started by hand (the README's torchrun
    path): torchrun gives each of its processes OMP_NUM_THREADS=1, which each worker keeps (fp32 mode, where the
    default would otherwise be the host's cores over its workers)."""
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this interpreter (it comes with torch)")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "UNBROKEN_LOCAL_WORKERS")}
    env[TOKEN_ENV] = new_token()
    port, run = free_port(), tmp_path / "run"
    env["UNBROKEN_COORDINATOR"] = f"127.0.0.1:{port}"
    coordinator = unbroken("coordinator", "--workers", "2", "--port", str(port), "--run-dir", str(run),
                           "--train.steps=2", env=env, log=tmp_path / "coordinator.log")  # fmt: skip
    with open(tmp_path / "torchrun.log", "ab") as log:
        workers = subprocess.Popen(
            [str(torchrun), "--standalone", "--nproc-per-node=2", str(ROOT / "examples" / "plain_loop.py")],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        assert workers.wait(timeout=200) == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
        assert coordinator.wait(timeout=60) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    finally:
        for p in (coordinator, workers):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    fingerprints = admitted(run)
    assert sorted(fingerprints) == [0, 1]
    assert {fp["intra_op_threads"] for fp in fingerprints.values()} == {"1"}


def test_intra_op_threads_honour_the_config_then_the_launchers_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OMP_NUM_THREADS", "UNBROKEN_LOCAL_WORKERS", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    fp32, exact = load_config(None), load_config(None, [EXACT])
    assert intra_op_threads(fp32) == 16 and intra_op_threads(exact) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun
    assert intra_op_threads(fp32) == 4
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8(x2)")  # srun; LOCAL_WORLD_SIZE is asked first
    assert intra_op_threads(fp32) == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # what the launcher (or the user) set wins over the count
    assert intra_op_threads(fp32) == 3 and intra_op_threads(exact) == 3
    assert intra_op_threads(load_config(None, ["--train.threads=5"])) == 5


def test_the_group_fingerprint_is_the_majoritys_and_a_refusal_names_every_difference() -> None:
    a = {"host": "h0", "gpu": "NVIDIA H100 80GB HBM3", "cuda": "13.0", "tf32_matmul": "false"}
    b = {**a, "host": "h1", "gpu": "NVIDIA H200"}
    c = {**a, "host": "h2", "tf32_matmul": "true", "cuda": "12.8"}
    assert group_fingerprint({0: b, 1: a, 2: {**a, "host": "h9"}}) == a  # hosts are not compared
    assert group_fingerprint({3: b, 1: a}) == a  # a tie: the lowest worker id's
    assert refusal(7, {**a, "host": "elsewhere"}, a) is None
    assert differences(c, a) == ["cuda: 12.8 vs 13.0", "tf32_matmul: true vs false"]
    line = refusal(2, b, a)
    assert line is not None and "gpu: NVIDIA H200 vs NVIDIA H100 80GB HBM3" in line and line.startswith("worker 2 ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: bench gpu would run")
def test_bench_gpu_without_a_gpu_says_so_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = run_command(
        [sys.executable, "-m", "unbroken", "bench", "gpu", "--record"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "unbroken: error: bench gpu needs a CUDA GPU and this machine has none that torch "
        f"{torch.__version__} sees; nothing was run or written"
    ]
    assert list(tmp_path.iterdir()) == []
