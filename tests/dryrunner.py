"""Runs ``unbroken`` commands one after another in this one process, through ``unbroken.cli.main`` (what the
``unbroken`` command runs) or a module's ``main`` (what ``python -m unbroken.lab.bench_mecefo`` runs), so that torch
is imported once for them all, not once a command: the dry runs of tests/test_docs_commands.py, which start no
process and write nothing.

    python tests/dryrunner.py JOBS.json RESULTS.json

JOBS.json: a list of {"cwd": folder, "env": {NAME: value}, "argv": the arguments, and "module": the module whose
``main(argv)`` runs them, or "" for the CLI}; RESULTS.json: for each, {"status": exit status, "stdout": ...,
"stderr": ...}. An exception other than the command's own (a bug) is status 1 with its traceback on stderr, and the
next command runs.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys
import traceback


def run_one(job: dict) -> dict:
    from unbroken.cli import main

    if job.get("module"):
        main = importlib.import_module(job["module"]).main
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(job["argv"]) or 0
            except SystemExit as e:  # argparse: a malformed command line
                status = e.code if isinstance(e.code, int) else 1
            except Exception:
                traceback.print_exc()
                status = 1
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return {"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    jobs_file, results_file = sys.argv[1:]
    with open(jobs_file) as f:
        jobs = json.load(f)
    results = [run_one(job) for job in jobs]
    with open(results_file, "w") as f:
        json.dump(results, f)
