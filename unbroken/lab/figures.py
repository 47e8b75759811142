"""What every ``unbroken bench`` shares: how a sample of times is summarised (median, quartiles, range, size)
and a free local port for the processes a benchmark starts."""

from __future__ import annotations

import socket
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
