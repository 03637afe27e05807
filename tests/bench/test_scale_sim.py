"""bench/scale_sim.py runs on two small simulated sizes: megatron's own check accepts the
synthetic metadata (so it is a valid layout), the guards find nothing wrong in it, and the
result lines carry every measurement the bench promises."""

import subprocess
import sys

from _launch import REPO


def test_scale_sim_runs_for_two_small_sizes():
    done = subprocess.run([sys.executable, str(REPO / "bench" / "scale_sim.py"), "--sizes",
                           "16,32", "--models", "mixtral-8x22b"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("mixtral-8x22b")]
    assert len(lines) == 2
    for line in lines:
        for part in ("megatron check", "save guard", "load guard", "integrity", "peak",
                     "load FS ops", "commit FS ops"):
            assert part in line, line
        # At commit a rank finds its own file by name (one stat, one fsync), lists nothing.
        assert "each rank 2 stats + 1 fsyncs + 0 listings of 0 names" in line, line
