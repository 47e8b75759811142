"""Alerts (unbroken.control.status.alerts): what raises one, the command and the webhook that receive them in order,
the goodput alert's hold and re-arm, and a bad alert setting refused at launch in one line."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from runner import TINY, run_command, train_cmd

from unbroken.control.status.alerts import Alerter, AlertKind
from unbroken.core.config import MetricsConfig
from unbroken.core.records import RecordKind, make

pytestmark = pytest.mark.timeout(60)


def appender(path: Path) -> str:
    """An alert command that appends its stdin to ``path``."""
    return f"sh -c 'cat >> {path}'"


RECORDS = [
    make(RecordKind.USER, 1.0, note="a script's own record"),
    make(RecordKind.FAILURE, 2.0, worker=1, why="process killed by SIGKILL", epoch=2),
    make(
        RecordKind.SLOW, 3.0, worker=2, state="slow", step=29, relative=3.1, threshold=1.5, windows=3, decision="report"
    ),
    make(
        RecordKind.SLOW,
        4.0,
        worker=2,
        state="recovered",
        step=59,
        relative=1.0,
        threshold=1.5,
        windows=0,
        decision="report",
    ),  # fmt: skip
    make(RecordKind.COORDINATOR, 5.0, incarnation="b", restored_epoch=4, address="127.0.0.1:1", status="-"),
    make(RecordKind.COORDINATOR, 5.5, incarnation="c", restored_epoch=0, address="127.0.0.1:2", status="-"),
    make(RecordKind.CHECKPOINT_REJECTED, 6.0, detail="step_00000010.pt: checksum mismatch"),
    make(RecordKind.STOPPED, 7.0, reason="every worker died"),
]


def test_each_kind_of_trouble_reaches_the_command_once_and_in_order(tmp_path: Path) -> None:
    out = tmp_path / "alerts.jsonl"
    alerter = Alerter(MetricsConfig(alert_command=appender(out)), "/runs/x")
    for r in RECORDS:
        alerter.write(r)
    alerter.close()
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [a["alert"] for a in got] == [
        AlertKind.FAILURE,
        AlertKind.FAIL_SLOW,
        AlertKind.COORDINATOR_TAKEOVER,
        AlertKind.CHECKPOINT_REJECTED,
        AlertKind.STOPPED,
    ]  # a script's record, a recovery from slowness and a fresh coordinator's start are not alerts
    assert all(a["run_dir"] == "/runs/x" and a["summary"] for a in got)
    assert got[0]["record"] == RECORDS[1] and "worker 1 failed" in got[0]["summary"]


def goodput(t: float, ratio: float) -> dict[str, Any]:
    return make(RecordKind.GOODPUT, t, step=int(t), wall_s=t, tokens=1, tokens_per_s=1.0, ideal_tokens_per_s=1.0,
                ratio=ratio, buckets={})  # fmt: skip


def test_low_goodput_is_said_once_it_lasted_and_again_only_after_it_recovered() -> None:
    alerter = Alerter(MetricsConfig(alert_goodput=0.8, alert_goodput_minutes=10), "-")
    said = [
        t
        for t, ratio in [
            (0, 0.5),
            (300, 0.6),
            (599, 0.7),
            (600, 0.5),
            (900, 0.5),
            (1000, 0.9),
            (1100, 0.4),
            (1700, 0.4),
        ]
        if (a := alerter.alert_of(goodput(t, ratio))) is not None and a.kind is AlertKind.GOODPUT_LOW
    ]
    assert said == [600, 1700]  # 10 minutes below 80 % from t=0, then from t=1100 after it rose above


def test_the_webhook_receives_the_json(tmp_path: Path) -> None:
    received: list[dict[str, Any]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    with http.server.HTTPServer(("127.0.0.1", 0), Handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/hook"
        alerter = Alerter(MetricsConfig(alert_webhook=url), "/runs/y")
        alerter.write(RECORDS[1])
        alerter.close()
        server.shutdown()
    assert [(a["alert"], a["run_dir"], a["record"]["worker"]) for a in received] == [("failure", "/runs/y", 1)]


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("--metrics.alert_command=/nonexistent/notify", "is not a program that can be run"),
        ("--metrics.alert_command='unclosed", "No closing quotation"),
        ("--metrics.alert_webhook=ftp://example.org/hook", "must be an http:// or https:// URL"),
        ("--metrics.alert_goodput=1.5", "needs 0 <= alert_goodput < 1"),
    ],
    ids=["missing-program", "quotes", "webhook", "goodput"],
)
def test_a_bad_alert_setting_is_one_line_at_launch_and_nothing_is_written(
    tmp_path: Path, data_cache_dir: Path, override: str, says: str
) -> None:
    out = tmp_path / "run"
    cmd = train_cmd(data_cache_dir, TINY, "--out", str(out), override, workers=1)
    result = run_command(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert says in line and line.startswith("unbroken: error:"), line
    assert not out.exists()


def test_the_alerter_never_raises_into_the_coordinator(tmp_path: Path) -> None:
    """A command that fails, or hangs past its timeout, on the first alert is logged; the next still goes out."""
    out = tmp_path / "after.jsonl"
    for trouble in ("exit 1", "sleep 60"):
        script = f'x=$(cat); case "$x" in *\\"failure\\"*) {trouble};; esac; echo "$x" >> {out}'
        alerter = Alerter(MetricsConfig(alert_command=f"sh -c '{script}'"), "-")
        alerter.write(RECORDS[1])  # the failure: the command fails, or hangs
        alerter.write(RECORDS[-1])  # the stop
        alerter.close(timeout_s=30)
    assert [json.loads(line)["alert"] for line in out.read_text().splitlines()] == ["stopped", "stopped"]
