"""``unbroken bench failslow``: what a worker that stays slow costs, and what each answer to it wins back (issue 32).

One worker (1) computes ``FACTOR`` times slower for ``SLOW_STEPS`` steps from step ``SLOW_FROM``; per round, in
alternation, the same run under:

- **no slowdown**: the yardstick;
- **report** (``recovery.slow = "report"``): the others wait for it at every reduction;
- **rebalance** (``recovery.slow = "rebalance"``): once the rule finds it fail-slow, the throughput workload is
  switched on (each member's microbatches follow its measured speed);
- **throughput** (``recovery.workload = "throughput"`` for the whole run): the same from the first step, the
  bound of what ``rebalance`` can win;
- **exclude** (``recovery.slow = "exclude"``): once the rule finds it fail-slow, it is removed like a failed
  worker and the others carry on.

Committed tokens per second: the tokens of every committed step over the wall time from the first step's start
to the last commit (as ``bench policies``), median [min, max] over the rounds, and its ratio to no slowdown.
"""

from __future__ import annotations

import statistics
from typing import Any

from unbroken.core.config import load_config, preset_path
from unbroken.core.records import RecordKind, committed_steps
from unbroken.lab.runs import run_to_end

FACTOR = 3
SLOW_FROM = 10
SLOW_STEPS = 100
STEPS = SLOW_FROM + SLOW_STEPS + 10
VARIANTS: dict[str, list[str]] = {
    "no slowdown": ["--recovery.slow=report"],
    "report": ["--recovery.slow=report"],
    "rebalance": ["--recovery.slow=rebalance"],
    "throughput": ["--recovery.slow=report", "--recovery.workload=throughput"],
    "exclude": ["--recovery.slow=exclude"],
}


def _tokens_per_s(records: list[dict[str, Any]]) -> float:
    steps = [r for r in records if r["type"] == RecordKind.STEP and not r.get("republished")]
    final = committed_steps(records)
    start = min(r["time"] - r["step_time_s"] for r in steps)
    wall = max(r["time"] for r in final.values()) - start
    return sum(r["tokens"] for r in final.values()) / wall


def bench_failslow(config: str | None, workers: int, repeats: int, overrides: list[str]) -> dict[str, list[float]]:
    """``repeats`` rounds of every variant, alternating; committed tokens/s per variant."""
    slow = f"slow:worker=1,factor={FACTOR},steps={SLOW_FROM}-{SLOW_FROM + SLOW_STEPS - 1}"
    base = [f"--train.steps={STEPS}", "--train.eval_every=0", "--checkpoint.every=0", "--train.microbatches=8"]
    out: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(repeats):
        for name, variant in VARIANTS.items():
            schedule = "" if name == "no slowdown" else slow
            args = [*base, *variant, f"--failures.schedule={schedule}", *overrides]
            cfg = load_config(config or str(preset_path("tiny")), args)
            out[name].append(_tokens_per_s(run_to_end(cfg, workers)))
    return out


def format_failslow(result: dict[str, list[float]], workers: int) -> str:
    yardstick = statistics.median(result["no slowdown"])
    lines = [
        f"{workers} workers, worker 1 {FACTOR}x slower in steps {SLOW_FROM}-{SLOW_FROM + SLOW_STEPS - 1} of {STEPS}; "
        "committed tokens/s, median [min, max] over the rounds",
        "",
        "| variant | rounds | committed tokens/s | vs no slowdown |",
        "|---|---|---|---|",
    ]
    for name, values in result.items():
        median = statistics.median(values)
        lines.append(
            f"| {name} | {len(values)} | {median:,.0f} [{min(values):,.0f}, {max(values):,.0f}] | "
            f"{median / yardstick:.2f} |"
        )
    return "\n".join(lines)
