"""The benchmarks' timer: the median wall time of repeated calls, in seconds."""

from __future__ import annotations

import statistics
import time


def median_seconds(repeats: int, run) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
