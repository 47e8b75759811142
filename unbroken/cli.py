"""The ``unbroken`` command line (``unbroken --help`` lists every command; ``train --help`` every config key).

One machine, the embedded default (Shakespeare, the ``small`` model), 4 worker processes:
    unbroken train configs/default.toml --workers 4
Your own training loop (unbroken.ft, docs/library.md) on 4 workers, with the same config keys:
    unbroken launch --workers 4 --train.steps=100 examples/plain_loop.py
Override any config key:
    unbroken train configs/default.toml --workers 4 --train.steps=50 --data.source=my_corpus/
Tokenize a corpus once, in parallel, into shards that training reads in place (docs/data.md):
    unbroken prepare corpus/*.jsonl --tokenizer tokenizer.json --out data/corpus
    unbroken train configs/default.toml --workers 4 --data.source=data/corpus
Check a launch without starting it (config, schedule, data, checkpoint, devices, port; nothing written):
    unbroken train configs/tiny.toml --workers 4 --failures.schedule="kill:worker=1,step=5" --dry-run
Continue an interrupted run (reproduces the uninterrupted losses), or extend it (its LR schedule kept):
    unbroken train --resume runs/default-20261122-101500 [--train.steps=400]
Plots and a markdown summary of a run, optionally against a reference run (written to RUN_DIR/report):
    unbroken report runs/default-20261122-101500 [REFERENCE_RUN_DIR]
Simulate a cluster (no torch; policies side by side; tables printed, plots written with --out):
    unbroken simulate configs/sim/recover_512.toml [--run.policies=recover,restart] [--out DIR]
    unbroken simulate --replay RUN_DIR [--cores 2]
    unbroken simulate configs/sim/replicas_512.toml --sweep cluster.gpus_per_replica=1,8,64
Several hosts (the coordinator binds to 127.0.0.1 unless --host says otherwise):
    host A:  unbroken coordinator configs/default.toml --workers 8 --host 0.0.0.0 --port 29400
    each:    unbroken worker --coordinator hostA:29400

User mistakes (bad config, bad data, port in use, ...) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

# c10d logs a warning line (with a C++ stack trace) for every store wait that times out and for every call
# on a connection a finished peer closed; our processes do both by design (bounded waits, shutdown). Keep
# c10's errors; set TORCH_CPP_LOG_LEVEL yourself to see its warnings. Must precede the first torch import.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from unbroken import __version__
from unbroken.core.config import (
    TRAINER_ONLY,
    KeyChange,
    RunConfig,
    config_changes,
    describe,
    describe_changes,
    dump_config,
    dump_resumed_config,
    load_config,
    preset_path,
    resume_config,
)
from unbroken.core.ending import run_then_exit

if TYPE_CHECKING:
    from unbroken.control.launcher import LaunchPlan
EXIT_USAGE = 2
DRY_RUN_HELP = (
    "check everything a launch checks (config and overrides, the failure schedule, the data, --resume's checkpoint, "
    "devices, the port), print what would run, and stop: nothing started, nothing written"
)
LAB_DRY_RUN_HELP = (
    "check every argument (configs and overrides resolved, files named), print one line of what would run, and "
    "stop: nothing started, nothing written"
)

FORK_HELP = (
    "fork each worker of SCRIPT.py from a process that has imported torch and unbroken (a start or restart then "
    "costs a fork, not seconds of imports); the workers of a host then share Python's string-hash seed, so data "
    "seeded with hash() looks pure on one host and the data check cannot see it (default: started cold)"
)

WITH_CHANGES_HELP = (
    "with --resume: accept changes of keys that alter what the run computes (lr, the model, the data, M, ...); "
    "they are recorded in metrics.jsonl and the earlier config is kept as config.N.toml (default: refused)"
)

SPARES_HELP = "warm spares to take a dead worker's place (default 0; whole replicas if a replica has several ranks)"


def _split_overrides(extra: list[str]) -> list[str]:
    overrides = []
    for arg in extra:
        if arg.startswith("--") and "=" in arg and "." in arg.split("=", 1)[0]:
            overrides.append(arg)
        else:
            raise ValueError(f"unrecognised argument {arg!r}; config overrides look like --section.key=value")
    return overrides


def _config_path(config: str) -> Path:
    """A TOML path, or the name of a packaged config (``tiny``, ``default``) when no such file exists."""
    path = Path(config)
    if path.is_file() or path.suffix == ".toml" or "/" in config:
        return path
    try:
        return preset_path(config)
    except ValueError:
        return path  # load_config names the missing file


def _load(
    config: str | None, extra: list[str], resume: str | None, with_changes: bool = False
) -> tuple[RunConfig, str, RunConfig | None]:
    """The session's config, the run's name, and on ``--resume`` the run's stored config (the session's is that
    with the overrides, checked by ``resume_config``: ValueError, nothing written, for a change it refuses)."""
    overrides = _split_overrides(extra)
    if resume is not None:
        if config is not None:
            raise ValueError("give either a CONFIG or --resume RUN_DIR, not both")
        path = Path(resume) / "config.toml"
        if not path.is_file():
            raise ValueError(f"--resume {resume}: not a run directory (no config.toml)")
        stored = load_config(path)
        cfg = resume_config(
            stored, load_config(path, overrides), _steps_done(Path(resume)), with_changes, f"--resume {resume}"
        )
        return cfg, Path(resume).name, stored
    if with_changes:
        raise ValueError("--resume-with-changes goes with --resume RUN_DIR; a new run takes any config")
    if config is None:
        return load_config(None, overrides), "default", None
    return load_config(_config_path(config), overrides), Path(config).stem, None


def _steps_done(run_dir: Path) -> int:
    """The steps a run has done: its newest checkpoint's (0 without one)."""
    from unbroken.core.ckptfiles import list_checkpoints

    saved = list_checkpoints(run_dir)
    return saved[0] if saved else 0


def _resumed_coordinator(args: argparse.Namespace, cfg: RunConfig, run_dir: Path) -> tuple[RunConfig, list[KeyChange]]:
    """``unbroken coordinator --resume``: the config it was given, checked against the run's (``resume_config``), and
    what it changes; as given where the run directory has no config yet."""
    if not (args.resume and (run_dir / "config.toml").is_file()):
        if args.resume_with_changes and not args.resume:
            raise ValueError("--resume-with-changes goes with --resume; a new run takes any config")
        return cfg, []
    stored = load_config(run_dir / "config.toml")
    cfg = resume_config(stored, cfg, _steps_done(run_dir), args.resume_with_changes, f"--resume {run_dir}")
    return cfg, config_changes(stored, cfg)


def _run_dir(args: argparse.Namespace, cfg: RunConfig, name: str) -> Path:
    from unbroken.control.launcher import default_run_dir

    if args.resume is not None:
        return Path(args.resume)
    if args.out:
        return Path(args.out)
    if cfg.train.out_dir:
        return Path(cfg.train.out_dir)
    return default_run_dir(name)


def _dry_run(plan: LaunchPlan, what: str, changes: list[KeyChange]) -> int:
    """``--dry-run``: the launch is valid (``plan_launch`` checked it); say what would run (and what a resume would
    change), start nothing."""
    from unbroken.control.launchcheck import launch_warnings
    from unbroken.core.failures import FailureSchedule

    plan.sock.close()
    cfg = plan.cfg
    for warning in launch_warnings(cfg, plan.workers, plan.spares):  # what the launch would warn of
        print(warning, file=sys.stderr)
    events = len(FailureSchedule.parse(cfg.failures.schedule).events)
    spares = f" and {plan.spares} warm spare{'s' if plan.spares != 1 else ''}" if plan.spares else ""
    into = f"continuing {plan.run_dir}" if plan.resume else f"into {plan.run_dir}"
    changing = f", its config changed: {describe_changes(changes)}" if changes else ""
    print(
        f"dry run: would {what} on {plan.workers} worker{'s' if plan.workers != 1 else ''}{spares} for "
        f"{cfg.train.steps} steps of {cfg.train.microbatches} microbatches, {into}, {events} failure "
        f"event{'s' if events != 1 else ''} scheduled{changing}; nothing started or written"
    )
    return 0


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from unbroken.control.launcher import Launcher, plan_launch
    from unbroken.control.status.alerts import check_alert_command
    from unbroken.ft.process import check_host_devices
    from unbroken.train.launch import trainer_worker
    from unbroken.train.trainer import validate_launch

    cfg, name, stored = _load(args.config, extra, args.resume, args.resume_with_changes)
    run_dir = _run_dir(args, cfg, name)
    check_host_devices(cfg, args.workers, args.spares)
    check_alert_command(cfg.metrics)
    resume = args.resume is not None
    plan = plan_launch(
        cfg, run_dir, args.workers, resume, args.host, args.port, trainer_worker, validate_launch, args.spares
    )
    changes = config_changes(stored, plan.cfg) if stored is not None else []
    if args.dry_run:
        return _dry_run(plan, f"train model {plan.cfg.model.hf_config or plan.cfg.model.flavour}", changes)
    if changes:
        dump_resumed_config(plan.cfg, run_dir, changes)  # the overrides (e.g. more steps) become part of the run
    return Launcher(plan, show_progress=not args.quiet).run()


def cmd_launch(args: argparse.Namespace, extra: list[str]) -> int:
    from unbroken.control.launcher import Launcher, plan_launch

    if args.script is None:
        raise ValueError("unbroken launch needs a SCRIPT.py to run; unbroken launch [options] SCRIPT.py [ARGS ...]")
    script = Path(args.script)
    if not script.is_file():
        raise ValueError(f"script {args.script} does not exist; unbroken launch [options] SCRIPT.py [ARGS ...]")
    from unbroken.control.status.alerts import check_alert_command
    from unbroken.ft.process import check_host_devices
    from unbroken.train.launch import script_worker

    cfg, name, stored = _load(args.config, extra, args.resume, args.resume_with_changes)
    run_dir = _run_dir(args, cfg, script.stem if args.config is None else name)
    check_host_devices(cfg, args.workers, args.spares)
    check_alert_command(cfg.metrics)
    worker_for = script_worker((sys.executable, str(script.resolve()), *args.args))
    resume = args.resume is not None
    plan = plan_launch(cfg, run_dir, args.workers, resume, args.host, args.port, worker_for, spares=args.spares)
    changes = config_changes(stored, plan.cfg) if stored is not None else []
    if args.dry_run:
        return _dry_run(plan, f"run {args.script}", changes)
    if changes:
        dump_resumed_config(plan.cfg, run_dir, changes)
    return Launcher(plan, show_progress=not args.quiet).run()


def cmd_coordinator(args: argparse.Namespace, extra: list[str]) -> int:
    from datetime import timedelta

    from unbroken.control.coordinator.loop import Coordinator, run_coordinator
    from unbroken.control.store.backend import open_state_store
    from unbroken.control.store.connect import bind_listen_socket
    from unbroken.control.store.gateway import require_token
    from unbroken.core.logs import init_logger

    init_logger("coordinator")
    token = require_token()  # refuse before writing anything: an unauthenticated store is never served
    if args.listen_fd is not None:  # started by a launcher, which validated and wrote the run dir
        sock = socket.socket(fileno=args.listen_fd)
        run_dir = Path(args.run_dir).resolve()
        cfg = load_config(run_dir / "config.toml")
        state = open_state_store(
            cfg.coordinator.state, run_dir, f"{args.host}:{sock.getsockname()[1]}", cfg.coordinator.lease_s
        )
        if not state.campaign():
            raise ValueError(f"coordinator.state = {cfg.coordinator.state}: another coordinator leads this run")
    else:
        from unbroken.control.status.alerts import check_alert_command

        cfg, name, _ = _load(args.config, extra, None)
        check_alert_command(cfg.metrics)
        run_dir = Path(args.run_dir or cfg.train.out_dir or f"runs/{name}").resolve()
        shared = cfg.coordinator.state.startswith("etcd://")  # a standby shares the run directory
        if run_dir.exists() and any(run_dir.iterdir()) and not (args.resume or shared):
            raise ValueError(f"run directory {run_dir} exists and is not empty; choose another or use --resume")
        cfg, changes = _resumed_coordinator(args, cfg, run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        state = open_state_store(cfg.coordinator.state, run_dir, f"{args.host}:{args.port}", cfg.coordinator.lease_s)
        if shared:
            print(f"coordinator {args.host}:{args.port}: campaigning to lead ({cfg.coordinator.state})", flush=True)
        if not state.campaign(timedelta(days=365) if shared else timedelta(seconds=30)):
            raise ValueError(f"coordinator.state = {cfg.coordinator.state}: another coordinator leads this run")
        sock = bind_listen_socket(args.host, args.port)  # only once leading: a standby does not listen
        if not (run_dir / "config.toml").exists():
            dump_config(cfg, run_dir)
        elif changes:
            dump_resumed_config(cfg, run_dir, changes)
        print(f"coordinator listening on {sock.getsockname()[0]}:{sock.getsockname()[1]}", flush=True)
    if args.listen_fd is None:
        from unbroken.control.launchcheck import launch_warnings

        for warning in launch_warnings(cfg, args.workers):
            print(warning, file=sys.stderr, flush=True)
    restore = args.restore or (args.listen_fd is None and not args.resume)  # a standby taking over restores
    coordinator = Coordinator(
        sock, cfg, run_dir, args.workers, args.resume, args.parent_pid, token, state=state, restore=restore
    )
    return run_coordinator(coordinator, Path(args.address_file) if args.address_file else None)


def cmd_worker(args: argparse.Namespace, extra: list[str]) -> int:
    from unbroken.control.member.client import COORDINATOR_ENV, RUN_DIR_ENV, WORKER_ID_ENV
    from unbroken.control.store.gateway import require_token

    if extra:
        raise ValueError(f"unrecognised arguments {' '.join(extra)}; a worker takes its config from the coordinator")
    require_token()
    os.environ[COORDINATOR_ENV] = args.coordinator
    if args.worker_id is not None:
        os.environ[WORKER_ID_ENV] = str(args.worker_id)
    if args.run_dir:
        os.environ[RUN_DIR_ENV] = args.run_dir
    from unbroken.train.trainer import main

    return main()


def cmd_agent(args: argparse.Namespace, extra: list[str]) -> int:
    from unbroken.control.host.agent import run_agent
    from unbroken.train.launch import script_worker, trainer_worker

    if extra:
        raise ValueError(f"unrecognised arguments {' '.join(extra)}; the config comes from the coordinator")
    if args.script is None:
        return run_agent(args, trainer_worker)
    script = Path(args.script)
    if not script.is_file():
        raise ValueError(f"script {args.script} does not exist; unbroken agent [options] [SCRIPT.py [ARGS ...]]")
    return run_agent(args, script_worker((sys.executable, str(script.resolve()), *args.args)))


def cmd_status(args: argparse.Namespace, extra: list[str]) -> int:
    from unbroken.control.status.terminal import cmd_status as show

    if extra:
        raise ValueError(f"unrecognised arguments {' '.join(extra)}; unbroken status HOST:PORT|RUN_DIR")
    return show(args)


def cmd_export(args: argparse.Namespace, extra: list[str]) -> int:
    from unbroken.train.export import export

    if extra:
        raise ValueError(f"unrecognised arguments {' '.join(extra)}; unbroken export RUN_DIR OUT")
    print(export(Path(args.run_dir), Path(args.out)))
    return 0


def cmd_prepare(args: argparse.Namespace, extra: list[str]) -> int:
    from unbroken.data.command import run_prepare

    if extra:
        raise ValueError(f"unrecognised arguments {' '.join(extra)}; see unbroken prepare --help")
    return run_prepare(args)


def cmd_bench(args: argparse.Namespace, extra: list[str]) -> int:
    from unbroken.lab.bench import run_bench

    return run_bench(
        args.what,
        args.config,
        [int(w) for w in args.workers.split(",")],
        args.repeats,
        _split_overrides(extra),
        args.steps,
        args.record,
        " ".join(["unbroken", *sys.argv[1:]]) if args.record or args.what == "all" else "",
        data_gb=(args.corpus_gb, args.reader_gb),
        out=args.out,
        parts=args.parts,
        members=args.members,
        news=args.news,
        beats=args.beats,
        dry_run=args.dry_run,
    )


def cmd_report(args: argparse.Namespace, extra: list[str]) -> int:
    from unbroken.lab.report import write_report

    if extra:
        raise ValueError(f"unrecognised arguments {' '.join(extra)}")
    print(write_report(Path(args.run_dir), Path(args.reference) if args.reference else None, args.out))
    return 0


def cmd_chaos(args: argparse.Namespace, extra: list[str]) -> int:
    from unbroken.lab.chaos import default_config, run_campaign, run_churn

    overrides = _split_overrides(extra)
    config = args.config or default_config()
    load_config(config, overrides)  # a bad config or override is a one-line error before any run
    out = Path(args.out) if args.out else None
    if args.churn:
        if args.spares:
            raise ValueError("--spares is for a campaign's runs; --churn makes its membership changes without spares")
        return run_churn(config, args.churn, args.workers, args.steps or 100000, out, overrides, args.dry_run)
    return run_campaign(
        config,
        args.trials,
        args.seed,
        args.workers,
        args.steps or 40,
        out,
        args.keep,
        overrides,
        args.mode,
        args.pace,
        args.spares,
        args.dry_run,
    )


def cmd_simulate(args: argparse.Namespace, extra: list[str]) -> int:
    if (args.scenario is None) == (args.replay is None):
        raise ValueError("unbroken simulate needs SCENARIO.toml or --replay RUN_DIR (one of them)")
    if args.replay is not None:
        if extra or args.sweep or args.out:
            raise ValueError("--replay RUN_DIR takes its scenario from the run: no overrides, --sweep or --out")
        from unbroken.sim.replay import run_replay

        return run_replay(args.replay, args.cores, args.dry_run)
    out = Path(args.out) if args.out else None
    if args.sweep:
        from unbroken.sim.sweep import run_sweep

        return run_sweep(args.scenario, _split_overrides(extra), args.sweep, out, args.dry_run)
    from unbroken.sim.report import run_simulate

    return run_simulate(args.scenario, _split_overrides(extra), out, args.dry_run)


def _with_keys(parser: argparse.ArgumentParser, script: bool = False) -> None:
    if not script:
        parser.epilog = (
            "configuration: any key of the TOML config as --section.key=value (CLI > TOML > defaults):\n\n" + describe()
        )
        return
    trainer_only = ", ".join(f"[{k}]" if "." not in k else k for k in sorted(TRAINER_ONLY))
    parser.epilog = (
        "configuration: a key of the TOML config as --section.key=value (CLI > TOML > defaults). These act on "
        "a script's run:\n\n" + describe(skip=TRAINER_ONLY) + f"\n\n{trainer_only} configure the built-in "
        "trainer's model, data and optimizer (unbroken train --help): your script builds its own; it may read "
        "them from ctx.config."
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="unbroken",
        description="LLM pre-training on PyTorch that keeps going when machines die. "
        "`unbroken COMMAND --help` for a command; `unbroken train --help` lists every config key.",
    )
    parser.add_argument("--version", action="version", version=f"unbroken {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_launch(sub)
    _add_coordinator(sub)
    _add_agent(sub)
    _add_tools(sub)
    _add_bench(sub)
    _add_report(sub)
    _add_chaos_and_simulate(sub)
    return parser


def _add_train(sub: argparse._SubParsersAction) -> None:
    """``unbroken train``: the built-in trainer on this machine."""
    raw = argparse.RawDescriptionHelpFormatter
    train = sub.add_parser(
        "train", help="train the built-in LLaMA on this machine: a coordinator and N workers", formatter_class=raw
    )
    train.add_argument("config", nargs="?", help="TOML config or a packaged one (tiny, default); default: defaults")
    train.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    train.add_argument("--spares", type=int, default=0, help=SPARES_HELP)
    train.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    train.add_argument("--resume-with-changes", action="store_true", help=WITH_CHANGES_HELP)
    train.add_argument("--out", help="run directory (default: train.out_dir or runs/<config>-<time>)")
    train.add_argument("--host", default="127.0.0.1", help="coordinator bind address (default 127.0.0.1)")
    train.add_argument("--port", type=int, default=0, help="coordinator port (default: any free port)")
    train.add_argument("--quiet", action="store_true", help="no progress output")
    train.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    _with_keys(train)
    train.set_defaults(func=cmd_train)


def _add_launch(sub: argparse._SubParsersAction) -> None:
    """``unbroken launch``: a user's script on N workers."""
    raw = argparse.RawDescriptionHelpFormatter
    launch = sub.add_parser(
        "launch",
        help="run your own training script (unbroken.ft) on N workers with a coordinator",
        formatter_class=raw,
        usage="unbroken launch [--workers N] [--out DIR] [--dry-run] [--section.key=value ...] SCRIPT.py [ARGS ...]",
    )
    launch.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    launch.add_argument("--spares", type=int, default=0, help=SPARES_HELP)
    launch.add_argument("--config", help="TOML config for the run (default: the defaults)")
    launch.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    launch.add_argument("--resume-with-changes", action="store_true", help=WITH_CHANGES_HELP)
    launch.add_argument("--out", help="run directory (default: train.out_dir or runs/<script>-<time>)")
    launch.add_argument("--host", default="127.0.0.1", help="coordinator bind address (default 127.0.0.1)")
    launch.add_argument("--port", type=int, default=0, help="coordinator port (default: any free port)")
    launch.add_argument("--quiet", action="store_true", help="no progress output")
    launch.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    launch.add_argument("--fork", action="store_true", help=FORK_HELP)
    launch.add_argument("script", metavar="SCRIPT.py", nargs="?", help="the training script each worker runs")
    launch.add_argument("args", nargs="*", metavar="ARGS", help="arguments passed to the script")
    _with_keys(launch, script=True)
    launch.set_defaults(func=cmd_launch)


def _add_coordinator(sub: argparse._SubParsersAction) -> None:
    """``unbroken coordinator``: the coordinator alone (multi-host jobs)."""
    raw = argparse.RawDescriptionHelpFormatter
    coord = sub.add_parser(
        "coordinator",
        help="run only the coordinator (multi-host jobs)",
        description="The job's coordinator, alone: membership, failure detection, metrics, the status page. "
        "Workers join it with UNBROKEN_COORDINATOR=HOST:PORT and the job's UNBROKEN_TOKEN (which it needs "
        "in its environment too); unbroken agent starts a host's workers (docs/control.md).",
        formatter_class=raw,
    )
    coord.add_argument("config", nargs="?", help="TOML config or a packaged one (tiny, default); default: defaults")
    coord.add_argument("--workers", type=int, required=True, help="workers to wait for before starting")
    coord.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: every interface)"
    )
    coord.add_argument("--port", type=int, default=29400, help="port to listen on (default 29400)")
    coord.add_argument("--run-dir", help="run directory (default: train.out_dir or runs/<config>)")
    coord.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
    coord.add_argument("--resume-with-changes", action="store_true", help=WITH_CHANGES_HELP)
    _with_keys(coord)
    coord.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)
    coord.add_argument("--restore", action="store_true", help=argparse.SUPPRESS)  # replaces a dead coordinator
    coord.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    coord.add_argument("--address-file", help=argparse.SUPPRESS)
    coord.set_defaults(func=cmd_coordinator)


def _add_agent(sub: argparse._SubParsersAction) -> None:
    """``unbroken agent``: one host's workers."""
    agent = sub.add_parser(
        "agent",
        help="one host of a multi-host job: start this host's K workers, watch them, report and replace them",
        usage="unbroken agent --coordinator HOST:PORT[,HOST:PORT] --workers K [--node-rank R] [SCRIPT.py [ARGS ...]]",
    )
    agent.add_argument("--coordinator", required=True, metavar="HOST:PORT[,HOST:PORT]", help="the leader first")
    agent.add_argument("--workers", type=int, required=True, help="workers on this host")
    agent.add_argument("--spares", type=int, default=0, help=SPARES_HELP)
    agent.add_argument(
        "--node-rank", type=int, help="this host's rank: its workers are R*K..R*K+K-1 (default: SLURM_NODEID, ...)"
    )
    agent.add_argument("--log-dir", help="worker logs (default: the run directory's logs/)")
    agent.add_argument("--wait-s", type=float, default=120.0, help="how long to wait for the coordinator at start")
    agent.add_argument("--fork", action="store_true", help=FORK_HELP)
    agent.add_argument("script", metavar="SCRIPT.py", nargs="?", help="your script (default: the built-in trainer)")
    agent.add_argument("args", nargs="*", metavar="ARGS", help="arguments passed to the script")
    agent.set_defaults(func=cmd_agent)


def _add_tools(sub: argparse._SubParsersAction) -> None:
    """``unbroken status``, ``worker``, ``export`` and ``prepare``."""
    from unbroken.control.status import terminal as status_view

    status = sub.add_parser("status", help="a run's live status: HOST:PORT of its status page, or its run directory")
    status_view.add_arguments(status)
    status.set_defaults(func=cmd_status)

    worker = sub.add_parser("worker", help="run one worker of the built-in trainer that joins a coordinator")
    worker.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="the coordinator to join")
    worker.add_argument(
        "--worker-id", type=int, default=None, help="this worker's id (default: the coordinator's choice)"
    )
    worker.add_argument("--run-dir", help="where checkpoints go (default: the coordinator's run directory)")
    worker.set_defaults(func=cmd_worker)

    export = sub.add_parser("export", help="a run's last checkpoint as a Hugging Face save_pretrained folder")
    export.add_argument("run_dir", metavar="RUN_DIR", help="a run of unbroken train (its last good checkpoint)")
    export.add_argument("out", metavar="OUT", help="the folder to write (must not exist, or be empty)")
    export.set_defaults(func=cmd_export)

    from unbroken.data import command as prepare_command

    prepare = sub.add_parser(
        "prepare",
        help="tokenize a corpus once, in parallel, into shards training reads in place (docs/data.md)",
        description=prepare_command.DESCRIPTION,
    )
    prepare_command.add_arguments(prepare)
    prepare.set_defaults(func=cmd_prepare)


def _add_report(sub: argparse._SubParsersAction) -> None:
    """``unbroken report``: plots and a summary of a run."""
    report = sub.add_parser("report", help="plots and a markdown summary of a run (needs unbroken[plots])")
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run to report on")
    report.add_argument("reference", nargs="?", metavar="REFERENCE_RUN_DIR", help="compare the losses with this run")
    report.add_argument("--out", type=Path, help="output directory (default RUN_DIR/report)")
    report.set_defaults(func=cmd_report)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    """``unbroken bench``: its arguments."""
    bench = sub.add_parser("bench", help="benchmarks (results go in docs/benchmarks.md and the pages it links)")
    from unbroken.lab.bench import BENCHES

    bench.add_argument("what", choices=["all", *BENCHES], help="which benchmark (all: every one)")
    bench.add_argument("config", nargs="?", help="TOML config (default: each benchmark's own)")
    bench.add_argument("--workers", default="2,4", help="comma-separated worker counts (default 2,4)")
    bench.add_argument("--repeats", type=int, default=2, help="alternating rounds of each system (default 2)")
    bench.add_argument("--steps", type=int, help="steps per run (mecefo: 200, convergence: 300, data: 100)")
    bench.add_argument("--record", action="store_true", help="also write the figures into their page of docs/")
    bench.add_argument("--corpus-gb", type=float, default=1.0, help="data: the throughput corpus (default 1)")
    bench.add_argument("--reader-gb", type=float, default=10.0, help="data: the reader-memory corpus (default 10)")
    bench.add_argument("--out", help="gpu: where gpu.md, gpu.json and its runs go (default runs/bench-gpu-<time>)")
    bench.add_argument(
        "--parts", default="", help="gpu: some of determinism,exact,kills,throughput,mecefo,nccl (default: all)"
    )
    bench.add_argument(
        "--members", default="", help="control-scale: comma-separated member counts (default 64,256,512,1024)"
    )
    bench.add_argument(
        "--news",
        default="",
        help="control-scale: how the crowds' members take the coordinator's news: relay (one relay a crowd, as "
        "an agent runs one a host), direct (each watches the coordinator), or both (default relay,direct)",
    )
    bench.add_argument(
        "--beats",
        default="",
        help="control-scale: who sends the crowds' heartbeats: worker (each member), host (one process a crowd, "
        "as an agent under comm.heartbeats = host), or both (default worker)",
    )
    bench.add_argument("--dry-run", action="store_true", help=LAB_DRY_RUN_HELP)
    bench.set_defaults(func=cmd_bench)


def _add_chaos_and_simulate(sub: argparse._SubParsersAction) -> None:
    """``unbroken chaos`` and ``unbroken simulate``: their arguments."""
    chaos = sub.add_parser("chaos", help="a seeded campaign of short runs with random faults, each run checked")
    chaos.add_argument("config", nargs="?", help="TOML config (default: the packaged tiny)")
    chaos.add_argument("--trials", type=int, default=10, help="runs in the campaign (default 10)")
    chaos.add_argument("--seed", type=int, default=0, help="first trial's seed; trial SEED is reproducible alone")
    chaos.add_argument("--workers", type=int, default=4, help="workers per run (default 4)")
    chaos.add_argument("--steps", type=int, help="steps per run (default 40; churn: until stopped)")
    chaos.add_argument("--out", help="keep the runs here (default: a temporary folder, kept on a violation)")
    chaos.add_argument("--keep", action="store_true", help="keep every run, not only those with a violation")
    chaos.add_argument(
        "--mode",
        choices=["named", "random-time"],
        default="named",
        help="faults at the code's named points (default), or from outside at random instants",
    )
    pace_help = "seconds added to each microbatch of the last worker (never a named fault's victim), in every run: "
    pace_help += "faults planned after a killed worker's return then fire on a fast machine too (default 0)"
    chaos.add_argument("--pace", type=float, default=0.0, metavar="SECONDS", help=pace_help)
    churn_help = "instead: one run with this many membership changes, sampling memory, threads and descriptors"
    chaos.add_argument("--churn", type=int, metavar="CHANGES", help=churn_help)
    chaos.add_argument(
        "--spares",
        type=int,
        default=0,
        help="warm spares beside the workers in every run (a multiple of the replica's ranks; default 0)",
    )
    chaos.add_argument("--dry-run", action="store_true", help=LAB_DRY_RUN_HELP)
    chaos.set_defaults(func=cmd_chaos)
    simulate = sub.add_parser("simulate", help="discrete-event model of a cluster: recovery policies side by side")
    simulate.add_argument("scenario", nargs="?", metavar="SCENARIO.toml", help="e.g. configs/sim/recover_512.toml")
    simulate.add_argument(
        "--replay",
        metavar="RUN_DIR",
        help="instead: a finished run's own failure timeline, costs fitted from its records, its goodput buckets "
        "and the simulated ones side by side (docs/goodput.md)",
    )
    simulate.add_argument(
        "--cores", type=int, default=0, help="with --replay: the run's workers shared this many CPU cores (0: devices)"
    )
    simulate.add_argument("--out", help="also write scenario.toml, summary.md, results.json and plots here")
    simulate.add_argument(
        "--sweep",
        action="append",
        metavar="SECTION.KEY=V1,V2,...",
        help="run the scenario once per value (repeat for a grid) and compare the policies across them in one "
        "table, e.g. --sweep cluster.gpus_per_replica=1,8,64 (with --out: a folder per point, sweep.md)",
    )
    simulate.add_argument("--dry-run", action="store_true", help=LAB_DRY_RUN_HELP)
    simulate.set_defaults(func=cmd_simulate)


LAUNCH_VALUES = (
    *("--workers", "--spares", "--config", "--resume", "--out", "--host", "--port"),
    *("--coordinator", "--node-rank", "--log-dir", "--wait-s"),
)


def _split_launch(argv: list[str]) -> tuple[list[str], list[str]]:
    """``launch``'s own options and overrides (everything before the script) and the script with its
    arguments (passed on untouched, even ones that look like options or hold spaces)."""
    i = 0
    while i < len(argv):
        if argv[i] in LAUNCH_VALUES:
            i += 2
        elif argv[i].startswith("-"):
            i += 1
        else:
            break
    return argv[:i], argv[i:]


def parse_command(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command's options and the arguments left to it (config overrides); argparse exits with status 2 on a
    malformed command line. ``launch`` and ``agent`` pass everything after the script to the script."""
    parser = build_parser()
    script: list[str] = []
    overrides: list[str] = []
    if argv[:1] in (["launch"], ["agent"]):
        head, script = _split_launch(argv[1:])
        overrides = [a for a in head if a.startswith("--") and "=" in a and "." in a.split("=", 1)[0]]
        argv = [argv[0], *(a for a in head if a not in overrides)]
    args, extra = parser.parse_known_args(argv)
    extra += overrides
    if script:
        args.script, args.args = script[0], script[1:]
    return args, extra


def _fork_zygote_early(args: argparse.Namespace) -> bool:
    """``train``, ``agent`` and ``launch --fork`` fork their zygote here, after the imports they make anyway and
    before they do anything else (``control.host.zygote.fork_early``). True in the forked zygote."""
    if args.func is cmd_train and not args.dry_run:
        import unbroken.control.launcher
        import unbroken.train.trainer  # noqa: F401 - what cmd_train imports first: torch, shared with the zygote
    elif args.func is cmd_launch and args.fork and not args.dry_run:
        import unbroken.control.launcher  # noqa: F401
    elif args.func is cmd_agent and (args.script is None or args.fork):
        import unbroken.control.host.agent  # noqa: F401
    else:
        return False
    from unbroken.control.host import zygote

    if getattr(args, "fork", False):  # a script's workers forked too: the workers' environment is this one's
        os.environ[zygote.ZYGOTE_ENV] = zygote.FORK_SCRIPTS
    return zygote.fork_early()


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_command(sys.argv[1:] if argv is None else argv)
    if _fork_zygote_early(args):
        from unbroken.control.host import zygote

        # The zygote, and in time each worker it forks: returns what ``python -m unbroken.control.host.zygote`` would.
        return zygote.serve_early()
    try:
        return int(args.func(args, extra) or 0)
    except ValueError as e:
        print(f"unbroken: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def run() -> NoReturn:
    """The ``unbroken`` command: ``main``, then the process ends without the interpreter's teardown (half a second
    of CPU with torch imported; ``core.ending``)."""
    run_then_exit(main)


if __name__ == "__main__":
    run()
