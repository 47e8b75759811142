"""Every command that README.md and docs/*.md show in a ```sh block runs as written.

The commands are read from the pages when the tests run (``doccommands``), and each one must match a rule of
``RULES`` (the first that matches applies), which says how it is checked:

- ``RUN``: run as written, with bash, in a workspace (below); it must exit 0.
- ``FAST``: a variant is run instead; the rule says exactly what changes and why the command's point is kept.
- ``DRY``: ``unbroken train`` / ``launch`` with ``--dry-run`` added and nothing else changed: the written config,
  overrides and failure schedule pass every check a launch makes (the data, ``--resume``'s checkpoint, devices,
  the script, the port), the command prints the one line of what would run, and nothing is written. They run
  one after another in one process (tests/dryrunner.py, through ``unbroken.cli.main``): torch is imported once.
- ``SKIP``: not run, for the reason given (a GPU, a cluster, the network, minutes of benchmark); its ``unbroken``
  arguments are still parsed by the CLI and its config overrides loaded, and the repository files it names must
  exist.

A command with no rule fails, saying how to add one. Each command runs in a workspace of its own: a temporary
folder with the repository's files; what stands in for the placeholders of the pages (``PLACEHOLDERS``: a
finished run as ``runs/default-20261122-101500``, small inputs as ``my_texts/`` or ``tok.json``, values for the
words that stand for one, ``K`` in ``--cluster.gpus_per_replica=K``); ``unbroken``, ``python`` and
``.venv/bin/python`` on the PATH as this Python with this checkout; and the session's tokenized-corpus cache as
``.cache/unbroken`` (so no Shakespeare BPE is trained again).
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import pytest
from doccommands import DocCommand, extract, unfenced_commands
from runner import ROOT

from unbroken.cli import parse_command
from unbroken.core.config import load_config

pytestmark = pytest.mark.timeout(300)


class How(Enum):
    RUN = "run as written"
    FAST = "a fast variant"
    DRY = "a dry run"
    SKIP = "skipped"


@dataclass(frozen=True)
class Rule:
    pattern: str  # a regular expression the whole of DocCommand.key must match
    how: How
    why: str  # RUN, DRY: what it shows; FAST: what changes and why the point stays; SKIP: why it cannot run here
    variant: Callable[[DocCommand], str] | None = None  # FAST: the shell text run instead
    expect: str = ""  # a regular expression the output must contain
    needs_cuda: bool = False  # skipped unless torch sees a CUDA GPU
    commit: str = ""  # SKIP: a command of a past tree; the files it names are checked in this commit


# bash: the run of my_train.py recorded steps 0 .. {steps} - 1
STEPS_RAN = """python -c 'import glob, json; (m,) = glob.glob("runs/my_train-*/metrics.jsonl"); \\
assert sorted(r["step"] for r in map(json.loads, open(m)) if r["type"] == "step") == list(range({steps}))'"""

RULES = (
    Rule(
        r"make demo",
        How.SKIP,
        "creates .venv and installs torch from the network, then runs "
        "`unbroken train configs/default.toml --workers 4` (README.md: a dry run here)",
    ),
    Rule(r"make test", How.SKIP, "the whole test suite, this file among it"),
    Rule(r"pip install .*", How.SKIP, "changes the Python environment and needs the network"),
    Rule(r"unbroken (\S+ )?--help", How.RUN, "the help"),
    Rule(
        r"unbroken train gpu( .*)?", How.DRY, "the `gpu` preset insists on CUDA (train.device = cuda)", needs_cuda=True
    ),
    Rule(
        r"unbroken (train|launch) .*--failures\.(schedule|mtbf_s|scenario)=.*",
        How.DRY,
        "the written schedule against the written workers and steps, as a launch checks it; a command shown for its "
        "failures must schedule at least one",
        expect=r"\b[1-9]\d* failure events? scheduled",
    ),
    Rule(
        r"unbroken (train|launch) .*",
        How.DRY,
        "a real run is minutes here; the dry run makes every check a launch makes before it starts anything",
    ),
    Rule(
        r"unbroken agent --coordinator hostA:.*|unbroken coordinator .*--host 0\.0\.0\.0 .*",
        How.SKIP,
        "one host of a multi-host job: the coordinator waits for the "
        "workers of other hosts, an agent for a coordinator on hostA (tests/test_control.py runs both on one host)",
    ),
    Rule(
        r"torchrun .*--rdzv-endpoint=hostA:.*",
        How.SKIP,
        "two hosts meeting at hostA's rendezvous (tests/test_launchers.py runs torchrun on one)",
    ),
    Rule(
        r"sbatch .*",
        How.SKIP,
        "needs Slurm (tests/test_launchers.py submits deploy/slurm.sbatch where it is installed)",
    ),
    Rule(
        r"unbroken status [^/ ]+:\S+( .*)?",
        How.SKIP,
        "needs the live status page of a running job (tests/test_control.py reads a live one)",
    ),
    Rule(r"unbroken (status|report|export) .*", How.RUN, "on the finished run of PLACEHOLDERS"),
    Rule(r"unbroken prepare .*", How.RUN, "on the small inputs of PLACEHOLDERS"),
    Rule(r"unbroken simulate .*", How.RUN, "pure Python, seconds"),
    Rule(r"unbroken bench gpu( .*)?", How.SKIP, "needs a CUDA GPU (docs/gpu.md)"),
    Rule(r"unbroken bench .*", How.SKIP, "a benchmark: minutes of real runs (--record rewrites docs/benchmarks.md)"),
    Rule(
        r"unbroken chaos .*",
        How.SKIP,
        "a campaign of real 4-worker runs, a minute or more a trial (tests/test_chaos.py checks the campaign's parts)",
    ),
    Rule(
        r"export UNBROKEN_TOKEN=.*",
        How.FAST,
        "as written, then the token it exported is checked to be the 16 characters or more every process requires",
        variant=lambda c: c.text + '\n[ "${#UNBROKEN_TOKEN}" -ge 16 ]',
    ),
    Rule(
        r"python my_train\.py --train\.steps=\d+( .*)?",
        How.FAST,
        "--train.steps=3 for the written number, and the run is checked to have made steps 0, 1, 2: a script "
        "run alone is a job of one worker with a coordinator of its own that takes the override (and leaves the "
        "script its own arguments) in any number of steps",
        variant=lambda c: (
            "set -e\n" + re.sub(r"--train\.steps=\d+", "--train.steps=3", c.text) + "\n" + STEPS_RAN.format(steps=3)
        ),
    ),
    Rule(r"python -c print\('time_s,gpu,event'\).* > one\.csv", How.RUN, "writes the trace the next command reads"),
    Rule(r"scripts/install_etcd\.sh", How.SKIP, "installs software (etcd3gw into .venv, an etcd server)"),
    Rule(
        r"python - <<EOF",
        How.SKIP,
        "times an etcd cluster: needs etcd (scripts/install_etcd.sh); "
        "tests/test_statestore.py runs the etcd store where it is installed",
    ),
    Rule(
        r"git show 1175365:.*|python -c import importlib\.util .*",
        How.SKIP,
        "how a past measurement was made, on the code of commit 1175365",
    ),
    Rule(r"python -m unbroken\.lab\.bench_mecefo .*", How.SKIP, "a benchmark on 7B-sized matrices: minutes of CPU"),
    Rule(r"python scripts/(fold_timing|basis_sharding)\.py.*", How.SKIP, "a timing benchmark"),
    Rule(
        r"python scripts/proto_hsdp/.*",
        How.SKIP,
        "the removed prototypes of commit 54cd1a3, whose findings docs/parallel.md records",
        commit="54cd1a3",
    ),
)


@dataclass(frozen=True)
class Placeholder:
    what: str  # what stands in for it
    value: str = ""  # a word that stands for a value: the text run instead (else the workspace holds `what`)
    in_workspace: bool = True  # False: an environment variable provides it


A_RUN = "a finished run: configs/tiny.toml on 2 workers, 8 steps, checkpoints at steps 4 and 8 (a copy)"
PLACEHOLDERS = {  # what the pages write -> what stands in for it
    "runs/default-20261122-101500": Placeholder(A_RUN),
    "runs/tiny-20261122-101500": Placeholder(A_RUN),
    "RUN": Placeholder(A_RUN),
    "RUN_DIR": Placeholder(A_RUN),
    "REFERENCE_RUN_DIR": Placeholder(A_RUN),
    "my_texts": Placeholder("a folder of 3 text files of made-up words"),
    "books": Placeholder("a folder of 2 text files of made-up words"),
    "corpus": Placeholder("JSONL files of made-up words: a.jsonl, b.jsonl and gzipped, a.jsonl.gz, b.jsonl.gz"),
    "tok.json": Placeholder("a byte-level BPE of 512 ids trained on made-up words"),
    "tokenizer.json": Placeholder("the same BPE"),
    "wiki.parquet": Placeholder("a parquet file of 40 rows with a `body` column"),
    "data/c": Placeholder("corpus/*.jsonl prepared with tok.json (unbroken prepare)"),
    "data/corpus": Placeholder("corpus/*.jsonl prepared with tok.json (unbroken prepare)"),
    "my_train.py": Placeholder("examples/plain_loop.py"),
    "one.csv": Placeholder("what docs/simulation.md's own `python -c ... > one.csv` writes"),
    "gpt2": Placeholder(
        "the BPE of tok.json as gpt2's tokenizer.json in a local hub cache (HF_HUB_CACHE, HF_HUB_OFFLINE=1)",
        in_workspace=False,
    ),
    "[REFERENCE_RUN_DIR]": Placeholder("the optional argument, given", "REFERENCE_RUN_DIR"),
    "[--out DIR]": Placeholder("the optional argument, given (DIR: a new folder in the workspace)", "--out DIR"),
    "--cluster.gpus_per_replica=K": Placeholder("K, R, E: a row of the table below", "--cluster.gpus_per_replica=8"),
    "--cost.restart_s=R": Placeholder("K, R, E: a row of the table below", "--cost.restart_s=120"),
    "--checkpoint.every=E": Placeholder("K, R, E: a row of the table below", "--checkpoint.every=158"),
    "--cost.efficient_factor=F": Placeholder("F, S: a row of the table below", "--cost.efficient_factor=0.52"),
    "--failures.seed=S": Placeholder("F, S: a row of the table below", "--failures.seed=0"),
}
FILES = [name for name, p in PLACEHOLDERS.items() if not p.value and p.in_workspace]
REPO_ENTRIES = ("configs", "deploy", "docs", "examples", "scripts", "tests", "unbroken", "Makefile", "pyproject.toml")
NOT_WATCHED = {*REPO_ENTRIES, "bin", ".venv", ".cache"}  # what a dry run may touch: none of the run's files
HUB_COMMIT = "0" * 40

COMMANDS, PROBLEMS = extract(ROOT)


def rule_for(command: DocCommand) -> Rule | None:
    return next((r for r in RULES if re.fullmatch(r.pattern, command.key, re.DOTALL)), None)


def substituted(command: DocCommand) -> DocCommand:
    for written, placeholder in PLACEHOLDERS.items():
        if placeholder.value:
            command = command.replaced(written, placeholder.value)
    return command


# -- the placeholders, made once --------------------------------------------------------------------------------
def made_up_words(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    vocabulary = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(300)
    ]
    return [" ".join(rng.choice(vocabulary) for _ in range(rng.randint(20, 120))) for _ in range(n)]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, tiny_run: Path, data_cache_dir: Path) -> Path:
    """The placeholders, each under its name (PLACEHOLDERS), and hub/ (the Hugging Face cache). Also the session
    data cache's entry of the packaged presets' data (the plays at their 8,192-word vocabulary; the other tests
    train tests/tiny.toml's 1,024): a workspace links the entries there when it is made, and one it builds itself
    stays its own, so each command of the pages would otherwise train that tokenizer again (40 of them, 150 s)."""
    from unbroken.core.config import load_config
    from unbroken.data.tokenizer import train_bpe
    from unbroken.train.data import prepare_corpus

    prepare_corpus(load_config(ROOT / "configs" / "default.toml", [f"--data.cache_dir={data_cache_dir}"]).data)

    base = tmp_path_factory.mktemp("placeholders")
    shutil.copytree(tiny_run, base / "run", symlinks=True)  # a copy: `unbroken report` writes into it
    for name in ("runs/default-20261122-101500", "runs/tiny-20261122-101500", "RUN", "RUN_DIR", "REFERENCE_RUN_DIR"):
        (base / name).parent.mkdir(parents=True, exist_ok=True)
        (base / name).symlink_to(base / "run")
    for folder, files in (("my_texts", 3), ("books", 2)):
        (base / folder).mkdir()
        for k in range(files):
            (base / folder / f"part-{k}.txt").write_text("\n\n".join(made_up_words(150, k)) + "\n")
    (base / "corpus").mkdir()
    for name, seed in (("a", 10), ("b", 11)):
        lines = "".join(json.dumps({"text": doc}) + "\n" for doc in made_up_words(200, seed))
        (base / "corpus" / f"{name}.jsonl").write_text(lines)
        (base / "corpus" / f"{name}.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    train_bpe(made_up_words(300, 0), 512).save(str(base / "tok.json"))
    shutil.copy(base / "tok.json", base / "tokenizer.json")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": made_up_words(40, 12)}), base / "wiki.parquet")
    hub = base / "hub" / "models--gpt2"
    (hub / "snapshots" / HUB_COMMIT).mkdir(parents=True)
    shutil.copy(base / "tok.json", hub / "snapshots" / HUB_COMMIT / "tokenizer.json")
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text(HUB_COMMIT)
    (base / "data").mkdir()
    prepare = [sys.executable, "-m", "unbroken", "prepare", "corpus/a.jsonl", "corpus/b.jsonl", "--procs", "1"]
    result = subprocess.run(
        [*prepare, "--tokenizer", "tok.json", "--out", "data/c"], cwd=base, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (base / "data" / "corpus").symlink_to(base / "data" / "c")
    (base / "my_train.py").symlink_to(ROOT / "examples" / "plain_loop.py")
    programs(base)
    writer = next((c for c in COMMANDS if c.words[-2:] == (">", "one.csv")), None)
    if writer is not None:
        wrote = subprocess.run(["bash", "-c", writer.text], cwd=base, env=environment(base, base), timeout=60)
        assert wrote.returncode == 0, f"{writer.source}: {writer.text}"
    missing = {name for name in FILES if not (base / name).exists()} - {"one.csv"}  # one.csv: if a page writes it
    assert not missing, f"PLACEHOLDERS with nothing made for them: {missing}"
    return base


def environment(workspace: Path, shared: Path) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PATH": f"{workspace / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
        "HF_HUB_CACHE": str(shared / "hub"),
        "HF_HUB_OFFLINE": "1",
    }


def programs(ws: Path) -> None:
    """``unbroken`` (``python -m unbroken``), ``python`` and ``python3`` in ``ws/bin`` and ``.venv/bin/python``: this
    Python, importing this checkout (``environment``)."""
    (ws / "bin").mkdir()
    (ws / ".venv" / "bin").mkdir(parents=True)
    shims = {"bin/unbroken": " -m unbroken", "bin/python": "", "bin/python3": "", ".venv/bin/python": ""}
    for name, args in shims.items():  # scripts, not links: a link to a venv's python loses the venv
        (ws / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{args} "$@"\n')
        (ws / name).chmod(0o755)


def make_workspace(base: Path, shared: Path, cache: Path, outputs: set[str]) -> Path:
    """A folder to run a command in: the repository, the placeholders (but not those the command writes), the
    programs, and the session's data cache (its entries linked, so that a new one stays here)."""
    ws = base / "workspace"
    ws.mkdir()
    for name in REPO_ENTRIES:
        (ws / name).symlink_to(ROOT / name)
    for name in FILES:
        if name in outputs or not (shared / name).exists():
            continue
        (ws / name).parent.mkdir(parents=True, exist_ok=True)
        (ws / name).symlink_to(shared / name)
    programs(ws)
    (ws / ".cache" / "unbroken").mkdir(parents=True)
    for entry in cache.iterdir():
        (ws / ".cache" / "unbroken" / entry.name).symlink_to(entry)
    return ws


def snapshot(ws: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder of the workspace but the repository and the data cache (following the links to the
    placeholders: a run directory is watched too): path -> (size, modification time)."""
    found = {}
    for top in ws.iterdir():
        if top.name in NOT_WATCHED:
            continue
        for folder, dirs, files in os.walk(top, followlinks=True):
            for name in [*dirs, *files]:
                st = os.stat(Path(folder) / name)
                found[str((Path(folder) / name).relative_to(ws))] = (st.st_size, st.st_mtime_ns)
        st = os.stat(top)
        found[top.name] = (st.st_size, st.st_mtime_ns)
    return found


# -- the checks -------------------------------------------------------------------------------------------------
def exists_in(commit: str, path: str) -> bool | None:
    """Whether ``path`` is in ``commit``'s tree; None if this clone lacks the commit (a shallow clone)."""
    git = ["git", "-C", str(ROOT), "cat-file", "-e"]
    if subprocess.run([*git, f"{commit}^{{commit}}"], capture_output=True).returncode != 0:
        return None
    return subprocess.run([*git, f"{commit}:{path}"], capture_output=True).returncode == 0


def check_skipped(command: DocCommand, commit: str = "") -> None:
    """What can be checked of a command that is not run: the files it names exist (in ``commit``'s tree for a
    command of a past tree); the CLI parses its arguments, and its config overrides load."""
    for word in command.words:
        if re.match(r"(configs|deploy|docs|examples|scripts|unbroken|tests)/[\w./-]+$", word):
            if commit:
                assert exists_in(commit, word) is not False, f"{command.source}: {word} is not in commit {commit}"
            else:
                assert (ROOT / word).exists(), f"{command.source}: {word} does not exist"
    module = next((command.words[i + 1] for i, w in enumerate(command.words[:-1]) if w == "-m"), "")
    if module.startswith("unbroken.") and module != "unbroken":
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), f"{command.source}: no module {module}"
    argv = command.cli_argv()
    if argv is None:
        return
    try:
        args, extra = parse_command(argv)
    except SystemExit as e:
        pytest.fail(f"{command.source}: `unbroken {' '.join(argv)}` does not parse (exit status {e.code})")
    if args.command != "simulate":
        load_config(None, extra)  # ValueError (one line) for a malformed override or an unknown key


def run(text: str, ws: Path, shared: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", text], cwd=ws, env=environment(ws, shared), capture_output=True, text=True, timeout=240
    )


def test_the_pages_have_commands_and_each_ends() -> None:
    assert not PROBLEMS
    assert any(c.path == "README.md" for c in COMMANDS) and any(c.path.startswith("docs/") for c in COMMANDS)


def test_commands_are_in_sh_blocks() -> None:
    """A command in a block not fenced as ```sh would escape this test."""
    found = unfenced_commands(ROOT)
    assert not found, "fence these blocks as ```sh so that tests/test_docs_commands.py checks them:\n" + "\n".join(
        found
    )


def test_every_rule_matches_a_command() -> None:
    unused = [r.pattern for r in RULES if not any(rule_for(c) is r for c in COMMANDS)]
    assert not unused, f"rules that match no command of the pages (remove them from RULES): {unused}"


@dataclass(frozen=True)
class DryRun:
    status: int
    stdout: str
    stderr: str
    written: set[str]  # what changed in the workspace


def runs_dry(command: DocCommand) -> bool:
    rule = rule_for(command)
    return rule is not None and rule.how is How.DRY and not (rule.needs_cuda and not cuda_available())


@pytest.fixture(scope="module")
def dry_runs(shared: Path, data_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, DryRun]:
    """Every dry run of the pages, each in its workspace, in one process (tests/dryrunner.py: through
    unbroken.cli.main, so that torch is imported once, not once a command)."""
    base = tmp_path_factory.mktemp("dry")
    commands = [substituted(c) for c in COMMANDS if runs_dry(c)]
    jobs, workspaces = [], []
    for n, command in enumerate(commands):
        (base / str(n)).mkdir()
        ws = make_workspace(base / str(n), shared, data_cache_dir, command.outputs())
        argv = command.cli_argv()
        assert argv is not None, f"{command.source}: a dry run of `{command.key}`, which does not run the CLI"
        jobs.append({"cwd": str(ws), "env": command.env, "argv": [argv[0], "--dry-run", *argv[1:]]})
        workspaces.append(ws)
    before = [snapshot(ws) for ws in workspaces]
    (base / "jobs.json").write_text(json.dumps(jobs))
    runner = [sys.executable, str(ROOT / "tests" / "dryrunner.py"), str(base / "jobs.json"), str(base / "results.json")]
    done = subprocess.run(runner, env=environment(base, shared), capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((base / "results.json").read_text())
    found = {}
    for command, ws, old, result in zip(commands, workspaces, before, results, strict=True):
        new = snapshot(ws)
        written = {k for k in old.keys() | new.keys() if old.get(k) != new.get(k)}
        found[command.source] = DryRun(result["status"], result["stdout"], result["stderr"], written)
    return found


@pytest.mark.parametrize("command", COMMANDS, ids=[c.source for c in COMMANDS])
def test_the_command_runs_as_written(command: DocCommand, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    rule = rule_for(command)
    if rule is None:
        pytest.fail(
            f"{command.source}: no rule for `{command.key}`; add a Rule(pattern, How.X, why) to RULES in "
            "tests/test_docs_commands.py: RUN (as written), FAST (a variant: say what changes and why the point "
            "stays), DRY (unbroken train/launch), or SKIP (say why it cannot run in the tests)"
        )
    command = substituted(command)
    if rule.how is How.SKIP or (rule.needs_cuda and not cuda_available()):
        check_skipped(command, rule.commit)
        pytest.skip(f"{command.source}: {rule.why}")
    if rule.how is How.DRY:
        dry = request.getfixturevalue("dry_runs")[command.source]
        assert dry.status == 0, f"{command.source}: {command.text}\n{dry.stderr[-3000:]}"
        lines = dry.stdout.splitlines()
        assert len(lines) == 1 and lines[0].startswith("dry run: "), (command.source, dry.stdout[-2000:])
        assert not dry.written, f"{command.source}: the dry run wrote {sorted(dry.written)}"
        output = dry.stdout
    else:
        shared = request.getfixturevalue("shared")
        ws = make_workspace(tmp_path, shared, request.getfixturevalue("data_cache_dir"), command.outputs())
        text = rule.variant(command) if rule.how is How.FAST and rule.variant else command.text
        result = run(text, ws, shared)
        assert result.returncode == 0, f"{command.source}: {text}\n{result.stdout[-1500:]}\n{result.stderr[-3000:]}"
        output = result.stdout
    if rule.expect:
        assert re.search(rule.expect, output), f"{command.source}: {rule.why}; got {output[-1000:]}"


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
