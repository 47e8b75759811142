"""The ``unbroken`` command line: ``train``, ``coordinator``, ``worker``, ``bench`` and ``report``.

One machine, the embedded default (Shakespeare, the ``small`` model), 4 worker processes:
    unbroken train configs/default.toml --workers 4
Override any config key:
    unbroken train configs/default.toml --workers 2 --train.steps=50 --data.source=my_corpus/
Continue an interrupted run (reproduces the uninterrupted losses):
    unbroken train --resume runs/default-20261122-101500
Plots and a markdown summary of a run, optionally against a reference run (written to RUN_DIR/report):
    unbroken report runs/default-20261122-101500 [REFERENCE_RUN_DIR]
Simulate a cluster (no torch; policies side by side; tables printed, plots written with --out):
    unbroken simulate configs/sim/recover_512.toml [--run.policies=recover,restart] [--out DIR]
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

# c10d logs a warning line (with a C++ stack trace) for every store wait that times out and for every call
# on a connection a finished peer closed; our processes do both by design (bounded waits, shutdown). Keep
# c10's errors; set TORCH_CPP_LOG_LEVEL yourself to see its warnings. Must precede the first torch import.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from unbroken.core.config import RunConfig, dump_config, load_config

EXIT_USAGE = 2


def _split_overrides(extra: list[str]) -> list[str]:
    overrides = []
    for arg in extra:
        if arg.startswith("--") and "=" in arg and "." in arg.split("=", 1)[0]:
            overrides.append(arg)
        else:
            raise ValueError(f"unrecognised argument {arg!r}; config overrides look like --section.key=value")
    return overrides


def _load(config: str | None, extra: list[str], resume: str | None) -> tuple[RunConfig, str]:
    overrides = _split_overrides(extra)
    if resume is not None:
        if config is not None:
            raise ValueError("give either a CONFIG or --resume RUN_DIR, not both")
        path = Path(resume) / "config.toml"
        if not path.is_file():
            raise ValueError(f"--resume {resume}: not a run directory (no config.toml)")
        return load_config(path, overrides), Path(resume).name
    if config is None:
        return load_config(None, overrides), "default"
    return load_config(config, overrides), Path(config).stem


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from unbroken.control.launcher import Launcher, default_run_dir, plan_launch

    cfg, name = _load(args.config, extra, args.resume)
    if args.resume is not None:
        run_dir = Path(args.resume)
    elif args.out:
        run_dir = Path(args.out)
    elif cfg.train.out_dir:
        run_dir = Path(cfg.train.out_dir)
    else:
        run_dir = default_run_dir(name)
    plan = plan_launch(cfg, run_dir, args.workers, args.resume is not None, args.host, args.port)
    if args.resume is not None and extra:
        dump_config(cfg, run_dir)  # the overrides (e.g. more steps) become part of the run
    return Launcher(plan, show_progress=not args.quiet).run()


def cmd_coordinator(args: argparse.Namespace, extra: list[str]) -> int:
    from unbroken.control.coordinator import Coordinator, run_coordinator
    from unbroken.control.gateway import require_token
    from unbroken.control.store import bind_listen_socket
    from unbroken.core.logs import init_logger

    init_logger("coordinator")
    token = require_token()  # refuse before writing anything: an unauthenticated store is never served
    if args.listen_fd is not None:  # started by the launcher, which validated and wrote the run dir
        sock = socket.socket(fileno=args.listen_fd)
        run_dir = Path(args.run_dir)
        cfg = load_config(run_dir / "config.toml")
    else:
        cfg, name = _load(args.config, extra, None)
        run_dir = Path(args.run_dir or cfg.train.out_dir or f"runs/{name}")
        if run_dir.exists() and any(run_dir.iterdir()) and not args.resume:
            raise ValueError(f"run directory {run_dir} exists and is not empty; choose another or use --resume")
        sock = bind_listen_socket(args.host, args.port)
        run_dir.mkdir(parents=True, exist_ok=True)
        if not args.resume:
            dump_config(cfg, run_dir)
        print(f"coordinator listening on {sock.getsockname()[0]}:{sock.getsockname()[1]}", flush=True)
    from unbroken.core.config import to_toml

    coordinator = Coordinator(
        sock,
        to_toml(cfg),
        run_dir.resolve(),
        args.workers,
        cfg.comm.heartbeat_timeout_s,
        cfg.comm.join_timeout_s,
        resume=args.resume,
        parent_pid=args.parent_pid,
        token=token,
    )
    return run_coordinator(coordinator, Path(args.address_file) if args.address_file else None)


def cmd_worker(args: argparse.Namespace, extra: list[str]) -> int:
    from unbroken.train.trainer import run_worker

    if extra:
        raise ValueError(f"unrecognised arguments {' '.join(extra)}; a worker takes its config from the coordinator")
    return run_worker(args.coordinator, args.worker_id, args.run_dir)


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
        return run_churn(config, args.churn, args.workers, args.steps or 100000, out, overrides)
    return run_campaign(config, args.trials, args.seed, args.workers, args.steps or 40, out, args.keep, overrides)


def cmd_simulate(args: argparse.Namespace, extra: list[str]) -> int:
    from unbroken.sim.report import run_simulate

    return run_simulate(args.scenario, _split_overrides(extra), Path(args.out) if args.out else None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unbroken", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train on this machine: a coordinator and N worker processes")
    train.add_argument("config", nargs="?", help="TOML config (default: the embedded default)")
    train.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    train.add_argument("--out", help="run directory (default: train.out_dir or runs/<config>-<time>)")
    train.add_argument("--host", default="127.0.0.1", help="coordinator bind address (default 127.0.0.1)")
    train.add_argument("--port", type=int, default=0, help="coordinator port (default: any free port)")
    train.add_argument("--quiet", action="store_true", help="no progress output")
    train.set_defaults(func=cmd_train)

    coord = sub.add_parser("coordinator", help="run only the coordinator (multi-host jobs)")
    coord.add_argument("config", nargs="?")
    coord.add_argument("--workers", type=int, required=True, help="workers to wait for before starting")
    coord.add_argument("--host", default="127.0.0.1")
    coord.add_argument("--port", type=int, default=29400)
    coord.add_argument("--run-dir")
    coord.add_argument("--resume", action="store_true")
    coord.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)
    coord.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    coord.add_argument("--address-file", help=argparse.SUPPRESS)
    coord.set_defaults(func=cmd_coordinator)

    worker = sub.add_parser("worker", help="run one training worker that joins a coordinator")
    worker.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    worker.add_argument("--worker-id", type=int, default=None)
    worker.add_argument("--run-dir", help="where checkpoints go (default: the coordinator's run directory)")
    worker.set_defaults(func=cmd_worker)

    bench = sub.add_parser("bench", help="benchmarks (results go in docs/benchmarks.md)")
    bench.add_argument("what", choices=["all", "ddp", "recovery", "policies", "mecefo", "convergence", "simulator"])
    bench.add_argument("config", nargs="?")
    bench.add_argument("--workers", default="2,4", help="comma-separated worker counts (default 2,4)")
    bench.add_argument("--repeats", type=int, default=2, help="alternating rounds of each system (default 2)")
    bench.add_argument("--steps", type=int, help="steps per run (mecefo: 200, convergence: 300)")
    bench.add_argument("--record", action="store_true", help="also write the figures into docs/benchmarks.md")
    bench.set_defaults(func=cmd_bench)

    report = sub.add_parser("report", help="plots and a markdown summary of a run (needs unbroken[plots])")
    report.add_argument("run_dir", metavar="RUN_DIR")
    report.add_argument("reference", nargs="?", metavar="REFERENCE_RUN_DIR", help="compare the losses with this run")
    report.add_argument("--out", type=Path, help="output directory (default RUN_DIR/report)")
    report.set_defaults(func=cmd_report)

    chaos = sub.add_parser("chaos", help="a seeded campaign of short runs with random faults, each run checked")
    chaos.add_argument("config", nargs="?", help="TOML config (default: configs/tiny.toml)")
    chaos.add_argument("--trials", type=int, default=10, help="runs in the campaign (default 10)")
    chaos.add_argument("--seed", type=int, default=0, help="first trial's seed; trial SEED is reproducible alone")
    chaos.add_argument("--workers", type=int, default=4, help="workers per run (default 4)")
    chaos.add_argument("--steps", type=int, help="steps per run (default 40; churn: until stopped)")
    chaos.add_argument("--out", help="keep the runs here (default: a temporary folder, kept on a violation)")
    chaos.add_argument("--keep", action="store_true", help="keep every run, not only those with a violation")
    churn_help = "instead: one run with this many membership changes, sampling memory, threads and descriptors"
    chaos.add_argument("--churn", type=int, metavar="CHANGES", help=churn_help)
    chaos.set_defaults(func=cmd_chaos)
    simulate = sub.add_parser("simulate", help="discrete-event model of a cluster: recovery policies side by side")
    simulate.add_argument("scenario", metavar="SCENARIO.toml", help="e.g. configs/sim/recover_512.toml")
    simulate.add_argument("--out", help="also write scenario.toml, summary.md, results.json and plots here")
    simulate.set_defaults(func=cmd_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        return int(args.func(args, extra) or 0)
    except ValueError as e:
        print(f"unbroken: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
