"""Alerts: the operator of a long run is told, not made to watch.

Owns what is worth an alert and how it leaves: the coordinator feeds every metrics record to an ``Alerter``
(a sink of its ``MetricsTee``), which turns a few of them into an ``Alert`` and sends it, as one JSON object, to
``[metrics] alert_command`` (run with the JSON on its stdin; its words split as a shell would, no shell run) and/or
``[metrics] alert_webhook`` (an HTTP POST of the JSON). The alerts are sent in order by a thread of their own,
each with a timeout: a slow or broken receiver is logged and never holds up the coordinator.

The alerts (``AlertKind``): a worker failed; a worker is fail-slow (``control.coordinator.failslow``); the run
stopped (a broken invariant, a bug in the script, the coordinator's hold expired, ...); a standby or successor
coordinator took over; a checkpoint failed its verification on resume; the goodput (``core.goodput``) stayed below
``[metrics] alert_goodput`` of the ideal for ``alert_goodput_minutes`` (said once, again only after it recovered).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import queue
import shlex
import shutil
import signal
import subprocess
import threading
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from unbroken.control.coordinator.failslow import SlowState
from unbroken.control.coordinator.failslow import describe as describe_slow
from unbroken.core.config import MetricsConfig
from unbroken.core.records import RecordKind

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 10.0


class AlertKind(StrEnum):
    FAILURE = "failure"
    FAIL_SLOW = "fail_slow"
    STOPPED = "stopped"
    COORDINATOR_TAKEOVER = "coordinator_takeover"
    CHECKPOINT_REJECTED = "checkpoint_rejected"
    GOODPUT_LOW = "goodput_low"


@dataclass(frozen=True)
class Alert:
    kind: AlertKind
    time: float
    summary: str  # one line for a person
    record: Mapping[str, Any]  # the record that raised it

    def payload(self, run_dir: str) -> dict[str, Any]:
        """The JSON object sent: ``alert``, ``time``, ``summary``, ``run_dir`` and the ``record``."""
        return {"alert": str(self.kind), "time": self.time, "summary": self.summary, "run_dir": run_dir,
                "record": dict(self.record)}  # fmt: skip


def check_alert_command(cfg: MetricsConfig) -> None:
    """At launch: the alert command's program exists and can be run (ValueError, one line, otherwise)."""
    if not cfg.alert_command:
        return
    program = shlex.split(cfg.alert_command)[0]
    found = shutil.which(program) if os.sep not in program else (program if os.access(program, os.X_OK) else None)
    if found is None or os.path.isdir(found):
        raise ValueError(
            f"metrics.alert_command = {cfg.alert_command!r}: {program!r} is not a program that can be run; give a "
            "command that reads one JSON event on its stdin (e.g. 'tee -a alerts.jsonl')"
        )


class Alerter:
    """A ``MetricsTee`` sink: the alerts of the records it is given, sent as they come (see the module's doc)."""

    def __init__(self, cfg: MetricsConfig, run_dir: str) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.argv = shlex.split(cfg.alert_command) if cfg.alert_command else []
        self._low_since: float | None = None  # the goodput below alert_goodput since (record time)
        self._low_said = False
        self._queue: queue.Queue[bytes | None] = queue.Queue()  # in order, one at a time, off the caller's thread
        self._sender: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.argv or self.cfg.alert_webhook)

    def alert_of(self, record: Mapping[str, Any]) -> Alert | None:
        """The alert ``record`` raises, if any (the goodput's needs the records before it)."""
        kind, t = record.get("type"), float(record.get("time", 0.0))
        if kind == RecordKind.FAILURE:
            text = f"worker {record.get('worker')} failed: {record.get('why')}"
            return Alert(AlertKind.FAILURE, t, text, record)
        if kind == RecordKind.SLOW and record.get("state") == SlowState.SLOW:
            return Alert(AlertKind.FAIL_SLOW, t, describe_slow(record), record)
        if kind == RecordKind.STOPPED:
            return Alert(AlertKind.STOPPED, t, f"the run stopped: {record.get('reason')}", record)
        if kind == RecordKind.COORDINATOR and record.get("restored_epoch"):
            text = f"a coordinator took over at epoch {record.get('restored_epoch')} ({record.get('address')})"
            return Alert(AlertKind.COORDINATOR_TAKEOVER, t, text, record)
        if kind == RecordKind.CHECKPOINT_REJECTED:
            return Alert(
                AlertKind.CHECKPOINT_REJECTED, t, f"a checkpoint failed to verify: {record.get('detail')}", record
            )
        if kind == RecordKind.GOODPUT and self.cfg.alert_goodput > 0:
            return self._goodput(record, t)
        return None

    def _goodput(self, record: Mapping[str, Any], t: float) -> Alert | None:
        ratio = record.get("ratio")
        if not isinstance(ratio, int | float) or ratio != ratio or ratio >= self.cfg.alert_goodput:
            self._low_since, self._low_said = None, False
            return None
        if self._low_since is None:
            self._low_since = t
        if self._low_said or t - self._low_since < 60.0 * self.cfg.alert_goodput_minutes:
            return None
        self._low_said = True
        text = (
            f"goodput {100 * ratio:.1f} % of the ideal (below {100 * self.cfg.alert_goodput:.0f} % for "
            f"{(t - self._low_since) / 60:.1f} min, step {record.get('step')})"
        )
        return Alert(AlertKind.GOODPUT_LOW, t, text, record)

    def write(self, record: Mapping[str, Any]) -> None:
        alert = self.alert_of(record) if self.enabled else None
        if alert is None:
            return
        log.warning("alert: %s", alert.summary)
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_all, name="alerts", daemon=True)
            self._sender.start()
        self._queue.put(json.dumps(alert.payload(self.run_dir), default=str).encode())

    def _send_all(self) -> None:
        while (body := self._queue.get()) is not None:
            self._send(body)

    def _send(self, body: bytes) -> None:
        if self.argv:
            self._run_command(body)
        if self.cfg.alert_webhook:
            request = urllib.request.Request(
                self.cfg.alert_webhook, data=body, headers={"Content-Type": "application/json"}, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=SEND_TIMEOUT_S):
                    pass
            except (OSError, http.client.HTTPException) as e:  # refused, an HTTP error, or a reply that is not HTTP
                log.error("metrics.alert_webhook %s failed: %s", self.cfg.alert_webhook, e)

    def _run_command(self, body: bytes) -> None:
        """The command in a session of its own, so that a timeout ends whatever it started too."""
        try:
            proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as e:
            log.error("metrics.alert_command could not start: %s", e)
            return
        try:
            _, err = proc.communicate(body + b"\n", timeout=SEND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.error("metrics.alert_command took more than %.0f s; killed", SEND_TIMEOUT_S)
            return
        if proc.returncode != 0:
            log.error("metrics.alert_command exited %d: %s", proc.returncode, err.decode(errors="replace")[-500:])

    def close(self, timeout_s: float = 3 * SEND_TIMEOUT_S) -> None:
        """Send what is queued (the run's last alerts, a stop among them), waiting at most ``timeout_s``."""
        if self._sender is not None:
            self._queue.put(None)
            self._sender.join(timeout_s)
            self._sender = None
