"""Shared fixtures: one tokenized-corpus cache for the whole session, so the BPE is trained once; the
failure-free and faulted runs that several test files compare (the control-plane and launcher tests' reference,
the recovery runs that the recovery and report tests read).

``make test`` runs the suite in two pytest processes (pytest-xdist, a file per process at a time): each run
below is made once for the whole session by whichever process needs it first, under a file lock, in a
directory they all share. ``unbroken`` commands run through ``runner.run_command`` are forked by a launchpad
per process (tests/launchpad.py), ended with the session."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock
from runner import RUN_TIMEOUT_S, stop_launchpad

# Each shared run below is one ``runner.train`` (bounded by its subprocess timeout, RUN_TIMEOUT_S); the first test
# that asks for a fixture builds it, and the other pytest process may wait for that build under the fixture's lock.
# Either way the build is part of the test's time: a test's hang bound is its own plus the builds it may wait for.
# A test module whose own module-scoped fixture trains several runs says how many in ``FIXTURE_RUNS``.
SHARED_RUNS = {"control_reference": 1, "recovery_runs": 5, "tiny_run": 1}
# The longest files of the two pytest processes that ``make test`` runs with xdist, longest first (their wall time in
# r123), then the rest in name order, none of which took over 20 s: each process is given a file at a time in this
# order (xdist's own reordering by test count turned off), so a long file started last cannot run alone at the end
# (the namespace tests, 5 minutes of waits, did; ``make test`` runs them in a process of their own since) and the
# two end within a short file of each other.
LONGEST_FIRST = (
    "test_parallel.py",
    "test_replica3d.py",
    "test_torchtitan.py",
    "test_docs_commands.py",
    "test_examples.py",
    "test_numerics.py",
    "test_chaos.py",
    "test_baselines.py",
    "test_transforms.py",
    "test_failslow.py",
    "test_mecefo.py",
    "test_train.py",
)


def _schedule_rank(item: pytest.Item) -> int:
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_schedule_rank)  # stable: a file's tests keep their order
    for item in items:
        builds = {**SHARED_RUNS, **getattr(getattr(item, "module", None), "FIXTURE_RUNS", {})}
        runs = sum(builds.get(name, 0) for name in getattr(item, "fixturenames", ()))
        if not runs:
            continue
        marker = item.get_closest_marker("timeout")
        own = float(marker.args[0]) if marker is not None and marker.args else float(config.getini("timeout"))
        item.add_marker(pytest.mark.timeout(own + runs * RUN_TIMEOUT_S))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    stop_launchpad()  # waited for here: its runs' CPU time counts in this process's (``time make test``)


def _shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory every pytest process of this session sees (xdist gives each its own base below it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None], runs: int) -> Path:
    """``root/name``, built by ``build`` (``runs`` runs) the first time any process of the session asks for it."""
    root = _shared_root(tmp_path_factory)
    out, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock"), timeout=runs * RUN_TIMEOUT_S):
        if not done.exists():
            out.mkdir(exist_ok=True)
            build(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def data_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory shared by every test of the session (tokenizer + token arrays; safe to build from
    several processes at once, see unbroken/data/textcache.py)."""
    override = os.environ.get("UNBROKEN_TEST_CACHE")
    if override:
        Path(override).mkdir(parents=True, exist_ok=True)
        return Path(override)
    cache = _shared_root(tmp_path_factory) / "data-cache"
    cache.mkdir(exist_ok=True)
    return cache


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A seed for a test's random choices: a new one each run, or ``UNBROKEN_TEST_SEED`` to replay one; a failed
    test's report names it (its "seed" section)."""
    value = int(os.environ.get("UNBROKEN_TEST_SEED") or random.SystemRandom().randrange(2**32))
    request.node.add_report_section("setup", "seed", f"UNBROKEN_TEST_SEED={value} replays this test's random choices")
    return value


@pytest.fixture(scope="session")
def control_reference(tmp_path_factory: pytest.TempPathFactory, data_cache_dir: Path) -> Path:
    """The failure-free run (exact reduction) that the control-plane and launcher tests compare with: one worker,
    since with exact reduction the trajectory does not depend on the number of workers."""
    from runner import CONTROL_COMMON, train

    def build(base: Path) -> None:
        result = train(base / "reference", data_cache_dir, *CONTROL_COMMON, workers=1)
        assert result.returncode == 0, result.stderr[-3000:]

    return _once(tmp_path_factory, "control", build, SHARED_RUNS["control_reference"]) / "reference"


@pytest.fixture(scope="session")
def recovery_runs(tmp_path_factory: pytest.TempPathFactory, data_cache_dir: Path) -> dict[str, Path]:
    """Failure-free references and the same steps with ``runner.RECOVERY_SCHEDULE`` (4 workers): exact reduction
    (50 steps; the reference by one worker, since the exact trajectory does not depend on the number of
    workers), fp32 (20 steps, both by 4 workers: fp32 sums in an order that does), and the ``drop`` policy
    (exact reduction, so it equals the reference bit for bit until work is dropped)."""
    from runner import EXACT, FP32_STEPS, ONE_THREAD, RECOVERY_SCHEDULE, RECOVERY_STEPS, train

    common = ["--checkpoint.every=0", ONE_THREAD]
    exact, faults = EXACT, f"--failures.schedule={RECOVERY_SCHEDULE}"
    long, short = f"--train.steps={RECOVERY_STEPS}", f"--train.steps={FP32_STEPS}"
    plan = {  # name: (overrides, workers)
        "exact_ref": ([long, exact], 1),
        "exact_failures": ([long, exact, faults], 4),
        "fp32_ref": ([short], 4),
        "fp32_failures": ([short, faults], 4),
        "drop_failures": ([long, exact, "--recovery.policy=drop", faults], 4),
    }

    def build(base: Path) -> None:
        for name, (extra, workers) in plan.items():
            result = train(base / name, data_cache_dir, *common, *extra, workers=workers)
            assert result.returncode == 0, (name, result.stderr[-3000:])

    base = _once(tmp_path_factory, "recovery", build, SHARED_RUNS["recovery_runs"])
    return {name: base / name for name in plan}


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, data_cache_dir: Path) -> Path:
    """A finished run of tests/tiny.toml by 2 workers (8 steps, checkpoints at steps 4 and 8), made once for the
    session: copy it before anything could change it."""
    from runner import train

    def build(base: Path) -> None:
        result = train(base / "run", data_cache_dir, workers=2)
        assert result.returncode == 0, result.stderr[-3000:]

    return _once(tmp_path_factory, "tiny-run", build, SHARED_RUNS["tiny_run"]) / "run"
