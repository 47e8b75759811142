"""``unbroken status``: a run's status on a terminal, from its coordinator's status server or its run directory.

Owns the client side of ``control.status.server``: fetching the snapshot (``fetch_snapshot``; the job's token from
``UNBROKEN_TOKEN`` goes as a bearer header, never on the command line), drawing it with rich (``render``: the
same facts as the page: the run's counts, throughput, wall time and goodput as the console summary and
``unbroken report`` state them, the warm spares, the loss curve as a one-line sparkline with failures and
rejoins marked under it, the workers, the failures, the timeline), and the command (``run_status``,
``add_arguments``), which redraws as records arrive (long-polling) until the run ends. Given a run directory
instead of ``HOST:PORT``, it folds ``RUN_DIR/metrics.jsonl`` once (a finished run, or one whose coordinator
serves no status page).

    unbroken status 127.0.0.1:29500             live, until the run ends (Ctrl-C to leave)
    unbroken status hostA:29500 --once          one snapshot (also what a pipe gets)
    unbroken status hostA:29500 --json          the snapshot as JSON
    unbroken status runs/tiny-20261122-101500   a run directory
"""

from __future__ import annotations

import argparse
import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from unbroken.control.status.model import TERMINAL_STATES, RunView
from unbroken.control.status.server import MAX_WAIT_S
from unbroken.control.store.gateway import TOKEN_ENV, token_from_env
from unbroken.core.goodput import Bucket
from unbroken.core.records import SpareState

LONG_POLL_S = 20.0
RETRY_S = 3.0
SPARKS = "▁▂▃▄▅▆▇█"
SHOWN_EVENTS = 12
SHOWN_INCIDENTS = 8
WORKER_COLUMNS = (  # (header, no_wrap)
    *(("worker", True), ("state", False), ("since", True), ("micro-\nbatches", True)),
    *(("s per\nmicro-\nbatch", True), ("compute\ns (est.)", True), ("fail-\nures", True), ("last failure", False)),
)
INCIDENT_COLUMNS = (
    *(("worker", True), ("fault", False), ("detected", True), ("re-formed", True)),
    *(("recom-\nputed/\ndropped", True), ("rejoined", True)),
)
FAULT_WIDTH = 16  # the narrowest the fault column gets (its event wraps between fields)
# The narrowest the workers' state column gets: its longest state whole ("slow": an alive fail-slow worker, so
# short that the 80 columns of a pipe still show every header whole).
STATE_WIDTH = len("alive")


def base_url(target: str) -> str:
    """``http://HOST:PORT`` for ``HOST:PORT``, ``[V6]:PORT`` or a URL; ValueError if it names no port."""
    url = target if "://" in target else f"http://{target}"
    parsed = urllib.parse.urlsplit(url)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != "http" or not parsed.hostname or port is None:
        raise ValueError(f"{target!r}: expected HOST:PORT of a coordinator's status page (or a run directory)")
    return f"http://{parsed.netloc}"


def fetch_snapshot(
    target: str, token: str | None = None, since: int = -1, wait_s: float = 0.0, timeout_s: float = 10.0
) -> dict[str, Any]:
    """The snapshot served at ``target`` (``HOST:PORT``); with ``since`` and ``wait_s``, as soon as it is newer
    than ``since`` (at most ``wait_s`` later). ValueError (one line) if refused or unreachable."""
    url = f"{base_url(target)}/api/status?since={since}&wait={min(wait_s, MAX_WAIT_S):g}"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s + wait_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        if e.code == 401:
            hint = "the token was refused" if token else f"set {TOKEN_ENV} to the job's token"
            raise ValueError(f"{target}: the status page needs the job's token from this host ({hint})") from None
        raise ValueError(f"{target}: the status page answered HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ValueError(f"cannot reach the status page at {target}: {reason}") from None


# -- drawing ------------------------------------------------------------------------------------------------
def _num(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _clock(t: float | None) -> str:
    return "-" if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def after_step(steps_done: int | None) -> str:
    """A checkpoint's place, from the steps done it is named by (``step_00000008.pt``: ``after step 7``)."""
    return "-" if steps_done is None else f"after step {steps_done - 1:,}" if steps_done > 0 else "before step 0"


def _breakable(event: str | None) -> str | None:
    """A failure event with a space after each comma, so a narrow column wraps it between its fields."""
    return None if event is None else event.replace(",", ", ")


def sparkline(steps: list[int], values: list[float | None], width: int) -> tuple[str, int, int]:
    """``values`` (by step) as at most ``width`` block characters, each the mean of its bucket of steps;
    returns the line and the first and last step."""
    points = [(s, v) for s, v in zip(steps, values, strict=True) if v is not None and math.isfinite(v)]
    if not points or width < 1:
        return "", 0, 0
    first, last = points[0][0], points[-1][0]
    span = max(1, last - first + 1)
    buckets: list[list[float]] = [[] for _ in range(min(width, span))]
    for s, v in points:
        buckets[(s - first) * len(buckets) // span].append(v)
    means = [sum(b) / len(b) if b else None for b in buckets]
    known = [m for m in means if m is not None]
    lo, hi = min(known), max(known)
    scale = (len(SPARKS) - 1) / (hi - lo) if hi > lo else 0.0
    line = "".join(" " if m is None else SPARKS[round((m - lo) * scale)] for m in means)
    return line, first, last


def _marks(incidents: list[dict[str, Any]], first: int, last: int, width: int) -> str:
    """A line under the sparkline: ``x`` where a worker failed, ``+`` where it rejoined."""
    span = max(1, last - first + 1)
    cells = min(width, span)
    line = [" "] * cells
    for inc in incidents:
        for step, mark in ((inc.get("step"), "x"), (inc.get("rejoin_step"), "+")):
            if step is not None and first <= step <= last:
                line[(step - first) * cells // span] = mark
    return "".join(line).rstrip()


def goodput_line(columns: dict[str, Any]) -> str:
    """The newest goodput record of the snapshot's ``goodput`` columns in a line (empty before the first):
    ``812 tokens/s, 79.6 % of the ideal; badput start 3.0 s, recompute 1.2 s, checkpoint 0.4 s``."""
    if not columns.get("step"):
        return ""
    newest = {name: values[-1] for name, values in columns.items() if isinstance(values, list) and values}
    ratio = "" if newest.get("ratio") is None else f", {100 * newest['ratio']:.1f} % of the ideal"
    named = [(b, newest.get(b)) for b in map(str, Bucket) if b != Bucket.UNATTRIBUTED]
    top = sorted(((b, s) for b, s in named if s), key=lambda item: -item[1])[:3]
    rate = "-" if newest.get("tokens_per_s") is None else f"{newest['tokens_per_s']:,.0f}"
    worst = "; badput " + ", ".join(f"{b} {s:.1f} s" for b, s in top) if top else ""
    return f"{rate} tokens/s{ratio}{worst}"


def _spares(snapshot: dict[str, Any]) -> str:
    """The warm spares in a line: ``1 ready, 1 promoted (spare 0 in worker 1's place)``; empty without any."""
    spares = snapshot.get("spares") or []
    if not spares:
        return ""
    states = [(state, sum(1 for x in spares if x["state"] == state)) for state in map(str, SpareState)]
    counts = ", ".join(f"{n} {state}" for state, n in states if n)
    placed = [
        f"spare {x['spare']} in worker {x['worker']}'s place" for x in spares if x["state"] == SpareState.PROMOTED
    ]
    return counts + (f" ({', '.join(placed)})" if placed else "")


def _summary(snapshot: dict[str, Any]) -> Table:
    """The panel of the run's state, counts and times (the same facts as the run's summary and report)."""
    run = snapshot["run"]
    state = run["state"] + (f": {run['state_detail']}" if run.get("state_detail") else "")
    style = "green" if run["state"] == "training" else "red" if run["state"] in TERMINAL_STATES - {"finished"} else ""
    total = f" of {run['total_steps']:,}" if run.get("total_steps") else ""
    expected = f" of {run['expected_workers']}" if run.get("expected_workers") else ""
    age = None if run.get("updated_at") is None else max(0.0, snapshot["server_time"] - run["updated_at"])
    ckpt = run.get("last_checkpoint")
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column(overflow="fold")  # a long path breaks, never ends in an ellipsis
    summary.add_row("state", Text(state, style=style))
    if run.get("run_dir"):
        summary.add_row("run", run["run_dir"])
    last_step = "" if run.get("last_step") is None else f", the last step {run['last_step']:,}"
    summary.add_row("steps done", f"{run['steps_done']:,}{total}{last_step} (epoch {run['epoch']})")
    if (run.get("sessions") or 0) > 1:
        summary.add_row("sessions", f"{run['sessions']} (resumed or relaunched; a step trained again counts once)")
    summary.add_row("workers alive", f"{run['alive']}{expected}: {run['members']}")
    summary.add_row("loss", f"train {_num(run['loss'])}, validation {_num(run['val_loss'])}")
    tps = "-" if run["tokens_per_s"] is None else f"{run['tokens_per_s']:,.0f}"
    summary.add_row("speed", f"{_ms(run['step_time_s'])} per step, {tps} tokens/s (median); {run['tokens']:,} tokens")
    if run.get("train_tokens_per_s") is not None and run.get("wall_s") is not None:
        over = f", summed over {run['sessions']} sessions" if (run.get("sessions") or 0) > 1 else ""
        wall = f"wall {run['wall_s']:.1f} s (coordinator start to last record{over})"
        summary.add_row("throughput", f"{run['train_tokens_per_s']:,.0f} tokens/s (training), {wall}")
    if run.get("tokens_per_s_per_gpu") is not None:
        mfu = "MFU -" if run.get("mfu") is None else f"MFU {100 * run['mfu']:.1f} %"
        summary.add_row("per GPU", f"{run['tokens_per_s_per_gpu']:,.0f} tokens/s (median), {mfu}")
    promoted = f", {run['promotions']} replaced by a spare" if run.get("promotions") else ""
    summary.add_row(
        "failures",
        f"{run['failures']} failed, {run['recoveries']} recovered, {run.get('rejoins', run.get('joins', 0))} "
        f"rejoined{promoted}; microbatches recomputed {run['recomputed_microbatches']}, dropped "
        f"{run['dropped_microbatches']}",
    )
    if spares := _spares(snapshot):
        summary.add_row("spares", spares)
    if line := goodput_line(snapshot.get("goodput") or {}):
        summary.add_row("goodput", line)
    summary.add_row("checkpoint", "-" if ckpt is None else f"{after_step(ckpt['step'])} ({ckpt['path']})")
    summary.add_row("last record", f"{_age(age)} ago")
    return summary


def _curve(snapshot: dict[str, Any], width: int) -> Text | None:
    """The loss as a sparkline on one line of the width, the failures and rejoins marked under it."""
    series = snapshot["series"]
    known = [(s, v) for s, v in zip(series["step"], series["loss"], strict=True) if v is not None and math.isfinite(v)]
    if not known:
        return None
    # The curve and its labels on one line of the width: the curve gets what the labels leave.
    prefix = f"loss {known[0][1]:.3f} "
    suffix = f" {known[-1][1]:.3f}  (steps {known[0][0]}-{known[-1][0]})"
    legend = "   x failed, + rejoined"
    cells = max(10, width - len(prefix) - max(len(suffix), len(legend)))
    line, first, last = sparkline(series["step"], series["loss"], cells)
    curve = Text()
    curve.append(prefix, style="bold")
    curve.append(line, style="cyan")
    curve.append(suffix)
    marks = _marks(snapshot["incidents"], first, last, cells)
    if marks.strip():
        curve.append("\n" + " " * len(prefix) + marks, style="red")
        curve.append(legend, style="dim")
    return curve


def _workers(snapshot: dict[str, Any]) -> Table:
    # Headers of one short word a line and times unwrapped: 80 columns (a pipe's width) show them whole.
    workers = Table(title="workers", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col, nowrap in WORKER_COLUMNS:
        workers.add_column(col, no_wrap=nowrap, min_width=STATE_WIDTH if col == "state" else None)
    for w in snapshot["workers"]:
        row_style = "red" if w["state"] in ("dead", "left") else "yellow" if w.get("straggler") else ""
        workers.add_row(
            str(w["id"]),
            "slow" if w.get("fail_slow") and w["state"] == "alive" else w["state"],
            _clock(w["since"]),
            "-" if w["quota"] is None else str(w["quota"]),
            _num(w["s_per_microbatch"], 3),
            _num(w["compute_s"], 3),
            str(w["failures"]),
            w["last_failure"] or "",
            style=row_style,
        )
    return workers


def _incidents(snapshot: dict[str, Any]) -> Table:
    ended = snapshot["run"]["state"] in TERMINAL_STATES
    incidents = Table(title="failures and recoveries", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col, nowrap in INCIDENT_COLUMNS:
        incidents.add_column(col, no_wrap=nowrap, overflow="fold", min_width=FAULT_WIDTH if col == "fault" else None)
    for i in snapshot["incidents"][-SHOWN_INCIDENTS:]:
        not_back = "no (run\nended)" if ended else "not yet"
        back = f"step {i['rejoin_step']}\n(epoch {i['rejoin_epoch']})"
        if i["down_s"] is not None:
            back += f"\ndown {_age(i['down_s'])}"
        incidents.add_row(
            str(i["worker"]),
            " ".join(x for x in (_breakable(i["event"]), i["why"]) if x),
            f"step {i['step']},\n{_ms(i['detection_s'])}",
            ("no" if ended else "not yet")
            if i["reformed_at"] is None
            else f"step {i['recovery_step']},\n{_ms(i['reform_s'])}",
            "-" if i["recomputed"] is None else f"{i['recomputed']}/{i['dropped']}",
            not_back if i["rejoined_at"] is None else back,
        )
    return incidents


def _timeline(snapshot: dict[str, Any]) -> Panel:
    events = Text()
    kind_style = {"failure": "red", "stopped": "red", "stall": "red", "recovery": "blue", "membership": "blue"}
    for e in snapshot["timeline"][-SHOWN_EVENTS:]:
        events.append(f"{_clock(e['time'])}  ", style="dim")
        events.append(e["text"] + "\n", style=kind_style.get(e["kind"], ""))
    events.rstrip()
    return Panel(events, title="timeline (newest last)", title_align="left")


def render(snapshot: dict[str, Any], width: int = 100) -> RenderableType:
    """The snapshot as rich renderables: summary (the last checkpoint in it), loss sparkline, workers, failures,
    timeline."""
    parts: list[RenderableType] = [Panel(_summary(snapshot), title="unbroken status", expand=False)]
    if (curve := _curve(snapshot, width)) is not None:
        parts.append(curve)
    parts.append(_workers(snapshot))
    if snapshot["incidents"]:
        parts.append(_incidents(snapshot))
    if snapshot["timeline"]:
        parts.append(_timeline(snapshot))
    return Group(*parts)


# -- the command --------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``status`` subcommand's arguments (cli.py: ``add_arguments(sub.add_parser("status", ...))``)."""
    parser.add_argument("target", help="HOST:PORT of a coordinator's status page, or a run directory")
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit (also when piped)")
    parser.add_argument("--json", action="store_true", help="print the snapshot as JSON and exit")


def run_status(target: str, once: bool = False, as_json: bool = False, console: Console | None = None) -> int:
    """The ``unbroken status`` command: 0 once the view was shown (live: once the run ended or on Ctrl-C).

    Raises:
        ValueError: a bad target, or the status page refused or could not be reached.
    """
    console = console or Console()
    if Path(target).is_dir():
        snapshot = RunView.from_run_dir(target).snapshot()
        once = True
    else:
        token = token_from_env()
        snapshot = fetch_snapshot(target, token)
    if as_json:
        console.print_json(json.dumps(snapshot))
        return 0
    if once or not console.is_terminal or snapshot["run"]["state"] in TERMINAL_STATES:
        console.print(render(snapshot, console.width))
        return 0
    try:
        with Live(render(snapshot, console.width), console=console, auto_refresh=False) as live:
            while snapshot["run"]["state"] not in TERMINAL_STATES:
                try:
                    snapshot = fetch_snapshot(target, token, since=snapshot["seq"], wait_s=LONG_POLL_S)
                except ValueError as e:
                    live.update(Group(render(snapshot, console.width), Text(f"{e}; retrying", style="red")))
                    live.refresh()
                    time.sleep(RETRY_S)
                    continue
                live.update(render(snapshot, console.width))
                live.refresh()
    except KeyboardInterrupt:
        pass
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """cli.py's handler for the ``status`` subcommand."""
    return run_status(args.target, once=args.once, as_json=args.json)
