"""bench/batch_check_bench.py runs on one small shape and prints the check's time against torch's
default_collate of the same batch."""

import re
import subprocess
import sys

from _launch import REPO


def test_batch_check_bench_runs_for_a_small_shape():
    done = subprocess.run([sys.executable, str(REPO / "bench" / "batch_check_bench.py"),
                           "--shapes", "2x256", "--repeats", "3"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("micro-batch")]
    assert len(lines) == 1 and re.search(
        r"check +[0-9.]+ us \| default_collate of the same batch +[0-9.]+ us \| check / collate "
        r"[0-9.]+$", lines[0]), done.stdout
