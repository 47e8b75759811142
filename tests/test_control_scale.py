"""bench control-scale's driver on a few members: the real coordinator as a child process, victims that are
processes of their own killed with SIGKILL and stopped with SIGSTOP, members joining; what its figures rest on
holds, checked against the run's own records."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from unbroken.core.records import read_records
from unbroken.lab.bench_control_scale import VICTIMS, Driver, format_control_scale


@pytest.mark.timeout(180)
def test_deaths_a_hang_and_joins_against_the_real_coordinator_are_measured_from_its_records(tmp_path: Path) -> None:
    driver = Driver(VICTIMS + 3, tmp_path, joins=3, rest_s=2.0)
    try:
        result = driver.run()
        ended_at = time.time()  # the records' clock; closing the leader member after this may get it declared dead
        joiners = driver.joiner_ids
    finally:
        driver.close(members=True)
    victims = list(driver.victims)
    # An epoch is published only after the death is reported (one clock), and read only after it is published.
    assert len(result["death_published_s"]) == VICTIMS - 1
    for published, last in zip(result["death_published_s"], result["death_last_read_s"], strict=True):
        assert 0 < published <= last
    assert 0 < result["read_p50_s"] <= result["read_p99_s"] <= max(result["death_last_read_s"])
    failures = {f["worker"]: f["why"] for f in read_records(driver.run_dir, "failure") if f["time"] <= ended_at}
    assert set(victims) <= set(failures) and result["false_deaths"] == len(failures) - len(victims)
    assert all(failures[w] == "process killed by SIGKILL" for w in victims[:-1]), failures
    # The hung one was declared dead by its silence alone, after more than the heartbeat timeout of it.
    silent = re.fullmatch(r"no heartbeat for (\d+\.\d+) s", failures[victims[-1]])
    assert silent and float(silent.group(1)) > result["heartbeat_timeout_s"], failures[victims[-1]]
    assert result["silence_s"] > 0
    # Every joiner is in the epoch the figures name, and the epochs count those from the joins' start to it.
    epochs = read_records(driver.run_dir, "membership")
    assert len(joiners) == 3 and all(any(w in e["members"] for e in epochs) for w in joiners)
    assert 1 <= result["join_epochs"] <= len(joiners)
    assert 0 <= result["join_wait_median_s"] <= result["join_wait_max_s"]  # an epoch holds only the admitted
    assert result["members"] == VICTIMS + 3 and result["rest_cores"] >= 0 and result["metrics_bytes_per_hour"] > 0
    # The crowd's 2 members (all but the leader and the victims) took their news from the crowd's relay.
    assert result["news"] == "relay" and result["relayed"] == VICTIMS + 3 - 1 - VICTIMS
    table = format_control_scale([result])
    assert f"| {VICTIMS + 3} |" in table
