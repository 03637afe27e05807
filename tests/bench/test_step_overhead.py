"""bench/step_overhead.py runs one short pair and one load-only pair: both runs take turns to
the end (no pause left behind), every pair line carries a step, save and load time of each
mode, the load-only pair a load time of each, and the last line is the one the bench
promises."""

import re
import subprocess
import sys

import pytest

from _launch import REPO

pytestmark = pytest.mark.slow

LAST = re.compile(r"^throughput ratio patched/unpatched: ([\d.]+) save: ([\d.]+) load: ([\d.]+)$")


def test_step_overhead_runs_one_short_pair():
    done = subprocess.run([sys.executable, str(REPO / "bench" / "step_overhead.py"), "--pairs",
                           "1", "--iters", "8", "--load-pairs", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    lines = done.stdout.splitlines()
    for mode in ("patched", "unpatched"):
        line = next(line for line in lines if line.startswith(f"pair 0 {mode}:"))
        assert re.search(r"step [\d.]+ ms CPU .* save [\d.]+ ms .* load [\d.]+ ms", line), line
    assert any(re.match(r"load pair 0: patched [\d.]+ ms, unpatched [\d.]+ ms$", line)
               for line in lines), done.stdout[-3000:]
    ratios = LAST.match(lines[-1])
    assert ratios and all(float(value) > 0 for value in ratios.groups()), lines[-1]
