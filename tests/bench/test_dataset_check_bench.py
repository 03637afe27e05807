"""bench/dataset_check_bench.py runs on two small sizes and prints, per size, the check's time
against megatron's own IndexedDataset open of the same synthetic dataset."""

import re
import subprocess
import sys

from _launch import REPO


def test_dataset_check_bench_runs_for_two_small_sizes():
    done = subprocess.run([sys.executable, str(REPO / "bench" / "dataset_check_bench.py"),
                           "--sizes", "1024,4096", "--repeats", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if " sequences: " in line]
    assert len(lines) == 2, done.stdout
    for line in lines:
        assert re.search(r"check +[0-9.]+ ms \| megatron's IndexedDataset open +[0-9.]+ ms \| "
                         r"check / megatron [0-9.]+$", line), line
