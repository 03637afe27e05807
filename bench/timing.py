"""The benchmarks' timers: the median wall time of repeated calls, in seconds, and megatron's own
save timer read from a run's log."""

from __future__ import annotations

import re
import statistics
import time

# megatron's `save-checkpoint` timer line: (the fastest rank's ms, the slowest rank's ms)
SAVE_TIMER = re.compile(r"save-checkpoint \.+: \(([\d.]+), ([\d.]+)\)")


def median_seconds(repeats: int, run) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
