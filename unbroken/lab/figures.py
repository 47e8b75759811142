"""How the benchmarks summarise a sample of times: median, quartiles, range and size (one definition, used by
every ``unbroken bench``)."""

from __future__ import annotations

import statistics


def stats(times: list[float]) -> dict[str, float]:
    """Median, first and third quartiles, min, max and n of ``times`` (at least one value)."""
    ordered = sorted(times)
    q = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    return {
        "median": statistics.median(ordered),
        "q1": q[0],
        "q3": q[2],
        "min": ordered[0],
        "max": ordered[-1],
        "n": len(ordered),
    }
