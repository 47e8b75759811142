"""Every command that README.md and docs/*.md show in a ```sh block runs: as written, as a stated smaller variant,
or as a dry run; the few that cannot run here are skipped for a GPU, several real hosts or a network install, with
the reason, and still checked as far as they can be.

The commands are read from the pages when the tests run (``doccommands``), and each one must match a rule of
``RULES`` (the first that matches applies), which says how it is checked:

- ``RUN``: run as written, with bash, in a workspace (below); it must exit 0.
- ``FAST``: a variant is run instead; the rule says exactly what changes and why the command's point is kept.
- ``DRY``: the command with ``--dry-run`` added and nothing else changed (``unbroken train``, ``launch``, ``bench``,
  ``chaos``, ``simulate``, and ``python -m unbroken.lab.bench_mecefo``): every argument passes the checks the real
  command makes (the config and overrides, the failure schedule, the data, ``--resume``'s checkpoint, devices, a
  campaign's trials, a scenario), it prints the one line of what would run, and nothing is written. They run one
  after another in one process (tests/dryrunner.py): torch is imported once.
- ``LIVE``: the multi-host example (a coordinator, an agent of the built-in trainer, an agent of a script,
  ``unbroken status HOST:PORT``) as a smaller job on this host, the substitutions stated in ``LIVE_VARIANT``: the
  status commands read the live coordinator's page, and both jobs run to their end.
- ``SKIP``: not run, for the reason given (a GPU, several hosts, a network install); the files it names must exist,
  and its ``unbroken`` arguments are still parsed by the CLI and its config overrides loaded.

No command may name a file of the repository that does not exist (``test_no_command_names_a_missing_file``), and
at most ``MAX_SKIPPED`` are skipped (the count and the reasons are printed at the end of the session's report). A
command with no rule fails, saying how to add one. Each command runs in a workspace of its own: a temporary
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
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import pytest
from doccommands import DocCommand, doc_files, extract, unfenced_commands
from runner import ROOT, free_port

from unbroken.cli import parse_command
from unbroken.core.config import load_config
from unbroken.core.records import RecordKind, read_records

pytestmark = pytest.mark.timeout(300)

MAX_SKIPPED = 15


class How(Enum):
    RUN = "run as written"
    FAST = "a fast variant"
    DRY = "a dry run"
    LIVE = "in the live job"
    SKIP = "skipped"


@dataclass(frozen=True)
class Rule:
    pattern: str  # a regular expression the whole of DocCommand.key must match
    how: How
    why: str  # RUN, DRY, LIVE: what it shows; FAST: what changes and why the point stays; SKIP: why it cannot run here
    variant: Callable[[DocCommand], str] | None = None  # FAST: the shell text run instead
    expect: str = ""  # a regular expression the output must contain
    needs_cuda: bool = False  # skipped unless torch sees a CUDA GPU


# bash: the run of my_train.py recorded steps 0 .. {steps} - 1
STEPS_RAN = """python -c 'import glob, json; (m,) = glob.glob("runs/my_train-*/metrics.jsonl"); \\
assert sorted(r["step"] for r in map(json.loads, open(m)) if r["type"] == "step") == list(range({steps}))'"""

DRY_LINE = r"^dry run: would "
MULTI_HOST = "several hosts: "
NETWORK = "installs from the network: "

RULES = (
    Rule(
        r"make demo",
        How.FAST,
        "make's own dry run, `make -n demo`: the recipes it would run are printed and none runs (the venv, torch "
        "from the network, then the training, whose own dry run is README.md's `unbroken train configs/default.toml "
        "--workers 4`)",
        variant=lambda c: "make -n demo",
        expect=r"unbroken train configs/default\.toml --workers 4",
    ),
    Rule(
        r"make test",
        How.FAST,
        "make's own dry run, `make -n test`: the recipes it would run are printed and none runs (the install, then "
        "the whole test suite, this file among it)",
        variant=lambda c: "make -n test",
        expect=r"python -m pytest",
    ),
    Rule(r"pip install .*", How.SKIP, NETWORK + "changes the Python environment"),
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
        r"unbroken coordinator .*--host 0\.0\.0\.0 .*|unbroken agent --coordinator hostA:.*",
        How.LIVE,
        "a job of this host standing for the hosts of the example (LIVE_VARIANT), run to its end",
    ),
    Rule(
        r"unbroken status [\w.]+:PORT( .*)?",
        How.LIVE,
        "the live status page of a job of this host whose coordinator waits for its workers (LIVE_VARIANT)",
        expect=r"\bstarting\b",
    ),
    Rule(
        r"torchrun .*--rdzv-endpoint=hostA:.*",
        How.SKIP,
        MULTI_HOST + "two hosts meeting at hostA's rendezvous (tests/test_launchers.py runs torchrun on one)",
    ),
    Rule(
        r"sbatch .*",
        How.SKIP,
        MULTI_HOST + "a Slurm allocation of several nodes (tests/test_launchers.py submits deploy/slurm.sbatch to a "
        "cluster of two nodes on one machine where Slurm is installed)",
    ),
    Rule(r"unbroken (status|report|export) .*", How.RUN, "on the finished run of PLACEHOLDERS"),
    Rule(r"unbroken prepare .*", How.RUN, "on the small inputs of PLACEHOLDERS"),
    Rule(
        r"unbroken simulate configs/sim/recover_512\.toml|unbroken simulate .* --failures\.trace=one\.csv .*",
        How.RUN,
        "pure Python, a second: a scenario and a trace simulated as written",
    ),
    Rule(r"unbroken simulate .*", How.DRY, "the scenario loaded and checked, every point of a sweep too"),
    Rule(
        r"unbroken bench gpu( .*)?",
        How.DRY,
        "the benchmark needs a CUDA GPU, and so does its dry run (docs/gpu.md)",
        expect=DRY_LINE + "run bench gpu",
        needs_cuda=True,
    ),
    Rule(
        r"unbroken bench .*",
        How.DRY,
        "a benchmark is minutes of real runs; its dry run resolves each config with the overrides",
        expect=DRY_LINE + "run bench ",
    ),
    Rule(
        r"unbroken chaos .*",
        How.DRY,
        "a campaign is a minute of real runs a trial; its dry run plans a named campaign's trials",
        expect=DRY_LINE + "(run a chaos campaign|run one churn run)",
    ),
    Rule(
        r"python -m unbroken\.lab\.bench_mecefo .*",
        How.DRY,
        "a benchmark on 7B-sized matrices, minutes of CPU; its dry run checks the shapes and options",
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
    Rule(r"scripts/install_etcd\.sh", How.SKIP, NETWORK + "etcd3gw into .venv and an etcd server"),
    Rule(
        r"python - <<EOF",
        How.SKIP,
        NETWORK + "times an etcd cluster, which needs etcd (scripts/install_etcd.sh); tests/test_statestore.py runs "
        "the etcd store where it is installed",
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
    from unbroken.data.corpus import open_corpus
    from unbroken.data.tokenizer import train_bpe

    open_corpus(load_config(ROOT / "configs" / "default.toml", [f"--data.cache_dir={data_cache_dir}"]).data)

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
REPO_PATH = re.compile(r"(configs|deploy|docs|examples|scripts|unbroken|tests)/[\w./-]+$")


def missing_files(command: DocCommand) -> list[str]:
    """The repository files and modules ``command`` names that do not exist."""
    missing = [w for w in command.words if REPO_PATH.match(w) and not (ROOT / w).exists()]
    module = next((command.words[i + 1] for i, w in enumerate(command.words[:-1]) if w == "-m"), "")
    if module.startswith("unbroken.") and not (ROOT / (module.replace(".", "/") + ".py")).is_file():
        missing.append(module)
    return missing


def check_skipped(command: DocCommand) -> None:
    """What can be checked of a command that is not run: the CLI parses its arguments, and its config overrides
    load (the files it names exist: ``test_no_command_names_a_missing_file``)."""
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


def skipped(command: DocCommand) -> bool:
    rule = rule_for(command)
    return rule is not None and (rule.how is How.SKIP or (rule.needs_cuda and not cuda_available()))


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


def test_no_command_names_a_missing_file() -> None:
    found = {c.source: missing for c in COMMANDS if (missing := missing_files(substituted(c)))}
    assert not found, f"commands of the pages that name files the repository does not have: {found}"


def test_the_missing_file_check_fires() -> None:
    """The check above on commands that name what does not exist: a script, a config, a module."""
    for text in ("python scripts/no_such_script.py", "unbroken train configs/no_such.toml", "python -m unbroken.nope"):
        command = DocCommand("doctored.md", 1, text, tuple(text.split()))
        assert missing_files(command), text
    assert not missing_files(
        DocCommand("x.md", 1, "unbroken train configs/tiny.toml", ("unbroken", "train", "configs/tiny.toml"))
    )


PROSE_PATH = re.compile(r"(?<![\w/.-])((?:unbroken|tests|scripts|configs|examples|deploy|docs)/[\w./-]*[\w/])")
PROSE_MODULE = re.compile(r"(?<![\w/.])(unbroken(?:\.\w+)+)")
FOREIGN_PATHS = {"docs/source/assumptions_and_recommendations.rst"}  # torchft's, cited in docs/gpu.md


def stale_names(text: str) -> list[str]:
    """The repository paths (``unbroken/ft/comm.py``) and dotted module names (``unbroken.core.plan``, with the name
    that follows a module checked to be in its source) that ``text`` names and the repository does not have."""
    stale = [p for p in PROSE_PATH.findall(text) if p not in FOREIGN_PATHS and not (ROOT / p).exists()]
    for dotted in PROSE_MODULE.findall(text):
        parts = dotted.split(".")
        for k in range(len(parts), 1, -1):
            base = ROOT.joinpath(*parts[:k])
            source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            if source.is_file():
                if k < len(parts) and not re.search(rf"\b{re.escape(parts[k])}\b", source.read_text()):
                    stale.append(dotted)
                break
        else:
            stale.append(dotted)
    return stale


def test_every_file_and_module_the_pages_name_exists() -> None:
    """Prose too: a page that names a moved or removed file or module says something that no longer holds."""
    found = {str(f.relative_to(ROOT)): names for f in doc_files(ROOT) if (names := stale_names(f.read_text()))}
    assert not found, f"names of files or modules the repository does not have: {found}"


def test_the_stale_name_check_fires() -> None:
    text = "see `unbroken/ft/efficient.py`, `unbroken.control.statestore` and `unbroken.core.plan.no_such_planner`"
    assert stale_names(text) == [
        "unbroken/ft/efficient.py",
        "unbroken.control.statestore",
        "unbroken.core.plan.no_such_planner",
    ]
    assert stale_names("see `unbroken/ft/comm/reducer.py` and `unbroken.core.plan.plan_ids`") == []


def test_few_commands_are_skipped_each_for_a_gpu_hosts_or_the_network(capsys: pytest.CaptureFixture[str]) -> None:
    """At most MAX_SKIPPED commands are skipped, each for one of the reasons a test cannot help (a GPU, several real
    hosts, a network install); the count and the reasons are printed whatever pytest captures."""
    reasons = {c.source: rule.why for c in COMMANDS if skipped(c) and (rule := rule_for(c)) is not None}
    lines = [f"{len(reasons)} of {len(COMMANDS)} commands of the docs skipped:"]
    lines += [f"  {source}: {why}" for source, why in reasons.items()]
    with capsys.disabled():
        print("\ntests/test_docs_commands.py: " + "\n".join(lines))
    allowed = ("CUDA", MULTI_HOST, NETWORK)
    assert all(any(a in why for a in allowed) for why in reasons.values()), lines
    assert len(reasons) <= MAX_SKIPPED, lines


@dataclass(frozen=True)
class DryRun:
    status: int
    stdout: str
    stderr: str
    written: set[str]  # what changed in the workspace


def runs_dry(command: DocCommand) -> bool:
    rule = rule_for(command)
    return rule is not None and rule.how is How.DRY and not (rule.needs_cuda and not cuda_available())


def dry_job(command: DocCommand, ws: Path) -> dict[str, object]:
    """The dry run of ``command`` for tests/dryrunner.py: the CLI's arguments with ``--dry-run`` after the command's
    name, or a module's arguments with ``--dry-run`` added."""
    argv = command.cli_argv()
    if argv is not None:
        return {"cwd": str(ws), "env": command.env, "argv": [argv[0], "--dry-run", *argv[1:]], "module": ""}
    module = command.module_argv()
    assert module is not None, (
        f"{command.source}: a dry run of `{command.key}`, which runs neither the CLI nor a module"
    )
    return {"cwd": str(ws), "env": command.env, "argv": [*module[1], "--dry-run"], "module": module[0]}


# Dry runs that must be refused, as the real command refuses them: (module or "" for the CLI, argv without
# --dry-run, what the one line says).
BAD_DRY_RUNS = (
    ("", "bench ddp --workers 2,0", "--workers count must be >= 1"),
    ("", "bench parallel --workers 3", "must be a multiple of shard x pipeline x tensor"),
    ("", "bench ddp --train.no_such_key=1", "unknown config key train.no_such_key"),
    ("", "bench control-scale --members 3", "--members '3'"),
    ("", "chaos --trials 2 --steps 5", "--steps >= 12"),
    ("", "chaos configs/tiny.toml --workers 4 --parallel.shard=4", "--workers >= 8"),
    ("", "chaos --churn 10 --spares 1", "--spares is for a campaign's runs"),
    ("", "simulate configs/sim/recover_512.toml --run.policies=sometimes", "run.policies"),
    ("", "simulate configs/sim/replicas_512.toml --sweep cluster.gpus_per_replica=1,3", "--sweep at"),
    ("", "simulate --replay no_such_run", "not a run directory"),
    ("unbroken.lab.bench_mecefo", "--refresh 4096by11008", "expected OUTxIN"),
)


@pytest.fixture(scope="module")
def dry_runs(shared: Path, data_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, DryRun]:
    """Every dry run of the pages, each in its workspace, and those of BAD_DRY_RUNS (keyed by their text), in one
    process (tests/dryrunner.py: through unbroken.cli.main or the module's main, so that torch is imported once,
    not once a command)."""
    base = tmp_path_factory.mktemp("dry")
    commands = [substituted(c) for c in COMMANDS if runs_dry(c)]
    keys, jobs, workspaces = [], [], []
    for n, command in enumerate(commands):
        (base / str(n)).mkdir()
        ws = make_workspace(base / str(n), shared, data_cache_dir, command.outputs())
        keys.append(command.source)
        jobs.append(dry_job(command, ws))
        workspaces.append(ws)
    for n, (module, text, _why) in enumerate(BAD_DRY_RUNS):
        (base / f"bad{n}").mkdir()
        ws = make_workspace(base / f"bad{n}", shared, data_cache_dir, set())
        words = text.split()
        argv = [*words, "--dry-run"] if module else [words[0], "--dry-run", *words[1:]]
        keys.append(text)
        jobs.append({"cwd": str(ws), "env": {}, "argv": argv, "module": module})
        workspaces.append(ws)
    before = [snapshot(ws) for ws in workspaces]
    (base / "jobs.json").write_text(json.dumps(jobs))
    runner = [sys.executable, str(ROOT / "tests" / "dryrunner.py"), str(base / "jobs.json"), str(base / "results.json")]
    done = subprocess.run(runner, env=environment(base, shared), capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((base / "results.json").read_text())
    found = {}
    for key, ws, old, result in zip(keys, workspaces, before, results, strict=True):
        new = snapshot(ws)
        written = {k for k in old.keys() | new.keys() if old.get(k) != new.get(k)}
        found[key] = DryRun(result["status"], result["stdout"], result["stderr"], written)
    return found


@pytest.mark.parametrize(("module", "text", "why"), BAD_DRY_RUNS, ids=[t for _, t, _ in BAD_DRY_RUNS])
def test_a_dry_run_refuses_a_bad_argument_in_one_line(
    module: str, text: str, why: str, dry_runs: dict[str, DryRun]
) -> None:
    """The dry runs of bench, chaos and simulate refuse what the real command refuses, in one line with exit status
    2 (the run's own check, made before anything would start), and write nothing."""
    result = dry_runs[text]
    assert result.status == 2 and why in result.stderr, (text, result)
    assert not result.stdout and not result.written, (text, result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(("unbroken: error: ", "python -m unbroken")), (text, lines)
    if "usage:" not in result.stderr:  # argparse's own errors print the usage above their line
        assert len(lines) == 1, (text, lines)


# -- the live job: the multi-host example on this host ------------------------------------------------------------
# What the LIVE commands run instead, in jobs of this host: each a stated smaller variant of the written command.
LIVE_VARIANT = (
    ("hostA", "127.0.0.1"),  # the coordinator's host is this one
    ("--host 0.0.0.0", "--host 127.0.0.1"),  # no other host needs to reach it
    ("--port 29400", "--port {port}"),  # a free port of this host
    (":29400", ":{port}"),
    ("configs/default.toml", "configs/tiny.toml"),  # a smaller model of the same keys
    ("--run-dir /shared/runs/r1", "--run-dir runs/{job}"),  # the run directory in the workspace
    ("--workers 8", "--workers {workers}"),  # one host of that many workers
    ("--workers 4", "--workers {workers}"),
    (":PORT", ":{status_port}"),  # the status page's port, given to the coordinator (LIVE_COORDINATOR)
)
LIVE_STEPS = 3
# What the coordinator's variant adds: its status page on a known port, and a short run.
LIVE_COORDINATOR = (
    f"--coordinator.status_port={{status_port}} --train.steps={LIVE_STEPS} --train.eval_every=0 --checkpoint.every=0"
)


def live_variant(text: str, **values: object) -> str:
    for written, instead in LIVE_VARIANT:
        text = text.replace(written, instead.format(**values))
    return text


@dataclass(frozen=True)
class Live:
    text: str  # what ran
    status: int
    output: str


@dataclass(frozen=True)
class Started:
    command: DocCommand
    text: str
    proc: subprocess.Popen[bytes]
    log: Path

    def finish(self, timeout_s: float) -> tuple[int, str]:
        """The exit status within ``timeout_s`` (its process group killed past it: -9) and the output."""
        try:
            status = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            status = self.proc.wait()
        return status, self.log.read_text(errors="replace")


def live_roles() -> dict[str, list[DocCommand]]:
    """The LIVE commands of the pages, one of each text, by what they start: the coordinator, an agent of the
    built-in trainer, an agent of a script, ``unbroken status HOST:PORT``."""
    roles: dict[str, list[DocCommand]] = {"coordinator": [], "agent": [], "script": [], "status": []}
    for c in {c.key: c for c in COMMANDS if (r := rule_for(c)) is not None and r.how is How.LIVE}.values():
        argv = c.cli_argv() or [""]
        roles["script" if argv[0] == "agent" and parse_command(argv)[0].script else argv[0]].append(c)
    return roles


@pytest.fixture(scope="module")
def live_job(shared: Path, data_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Live]:
    """The LIVE commands of the pages, each as its variant (LIVE_VARIANT), in two jobs of this host that run at
    once: (a) the written coordinator (with LIVE_COORDINATOR) for 2 workers and, while it waits for them, every
    ``unbroken status HOST:PORT`` against its live page, then the agent of the built-in trainer; (b) the same
    coordinator for 1 worker and the agent of the script (``my_train.py``). Both must run to their end, every
    step committed. Keyed by the written command (``DocCommand.key``)."""
    from unbroken.control.store.gateway import new_token

    roles = live_roles()
    (coordinator,) = roles["coordinator"]
    ws = make_workspace(tmp_path_factory.mktemp("live"), shared, data_cache_dir, set())
    env = {**environment(ws, shared), "UNBROKEN_TOKEN": new_token()}
    ports: list[int] = []
    while len(ports) < 4:  # four distinct ports (each drawn at random)
        ports += [port] if (port := free_port()) not in ports else []
    jobs = {
        "a": {"port": ports[0], "status_port": ports[1], "job": "a", "workers": 2},
        "b": {"port": ports[2], "status_port": ports[3], "job": "b", "workers": 1},
    }
    started: list[Started] = []

    def start(command: DocCommand, text: str, name: str) -> Started:
        with open(ws / f"{name}.log", "wb") as out:
            proc = subprocess.Popen(["bash", "-c", f"exec {text}"], cwd=ws, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        started.append(Started(command, text, proc, ws / f"{name}.log"))
        return started[-1]

    def variant(command: DocCommand, job: str) -> str:
        text = live_variant(command.text, **jobs[job])
        return f"{text} {LIVE_COORDINATOR.format(**jobs[job])}" if command is coordinator else text

    found: dict[str, Live] = {}
    try:
        coordinators = {job: start(coordinator, variant(coordinator, job), f"coordinator-{job}") for job in jobs}
        agents = [start(c, variant(c, "b"), f"script-{k}") for k, c in enumerate(roles["script"])]
        deadline = time.monotonic() + 120
        while "status page on" not in coordinators["a"].log.read_text(errors="replace"):
            assert coordinators["a"].proc.poll() is None and time.monotonic() < deadline, coordinators["a"].log
            time.sleep(0.1)
        for c in roles["status"]:  # the coordinator waits for its workers meanwhile: its page is live
            done = run(variant(c, "a"), ws, shared)
            found[c.key] = Live(variant(c, "a"), done.returncode, done.stdout + done.stderr)
        agents += [start(c, variant(c, "a"), f"agent-{k}") for k, c in enumerate(roles["agent"])]
        for agent in agents:
            found[agent.command.key] = Live(agent.text, *agent.finish(200))
        for job, started_coordinator in coordinators.items():
            status, output = started_coordinator.finish(60)
            steps = sorted(r["step"] for r in read_records(ws / "runs" / job, RecordKind.STEP))
            if status != 0 or steps != list(range(LIVE_STEPS)) or coordinator.key not in found:
                found[coordinator.key] = Live(started_coordinator.text, status or int(steps != list(range(LIVE_STEPS))),
                                              f"{output}\nsteps committed: {steps}")  # fmt: skip
    finally:
        for s in started:
            if s.proc.poll() is None:
                os.killpg(s.proc.pid, signal.SIGKILL)
                s.proc.wait()
    return found


@pytest.mark.parametrize("command", COMMANDS, ids=[c.source for c in COMMANDS])
def test_the_command_runs(command: DocCommand, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    rule = rule_for(command)
    if rule is None:
        pytest.fail(
            f"{command.source}: no rule for `{command.key}`; add a Rule(pattern, How.X, why) to RULES in "
            "tests/test_docs_commands.py: RUN (as written), FAST (a variant: say what changes and why the point "
            "stays), DRY (a dry run), LIVE (the live job), or SKIP (a GPU, several hosts, a network install)"
        )
    command = substituted(command)
    if rule.how is How.SKIP or (rule.needs_cuda and not cuda_available()):
        check_skipped(command)
        pytest.skip(f"{command.source}: {rule.why}")
    if rule.how is How.DRY:
        dry = request.getfixturevalue("dry_runs")[command.source]
        assert dry.status == 0, f"{command.source}: {command.text}\n{dry.stderr[-3000:]}"
        lines = dry.stdout.splitlines()
        assert len(lines) == 1 and lines[0].startswith("dry run: "), (command.source, dry.stdout[-2000:])
        assert not dry.written, f"{command.source}: the dry run wrote {sorted(dry.written)}"
        output = dry.stdout
    elif rule.how is How.LIVE:
        live = request.getfixturevalue("live_job")[command.key]
        assert live.status == 0, f"{command.source}: {live.text}\n{live.output[-3000:]}"
        output = live.output
    else:
        shared = request.getfixturevalue("shared")
        ws = make_workspace(tmp_path, shared, request.getfixturevalue("data_cache_dir"), command.outputs())
        text = rule.variant(command) if rule.how is How.FAST and rule.variant else command.text
        result = run(text, ws, shared)
        assert result.returncode == 0, f"{command.source}: {text}\n{result.stdout[-1500:]}\n{result.stderr[-3000:]}"
        output = result.stdout
    if rule.expect:
        assert re.search(rule.expect, output, re.MULTILINE), f"{command.source}: {rule.why}; got {output[-1000:]}"


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
