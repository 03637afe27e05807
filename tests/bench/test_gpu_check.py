"""bench/gpu_check.sh, the prepared GPU check, runs on CPU too: the CPU-capable steps pass and
every step that needs CUDA says SKIP with its reason (so the script cannot rot unseen)."""

import os
import subprocess
import sys

import pytest
import torch

from _launch import REPO


@pytest.mark.slow
def test_gpu_check_runs_on_this_machine(tmp_path):
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh")], cwd=REPO,
                          env={**os.environ, "GPU_CHECK_RESULTS": str(tmp_path),
                               "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    device = "cpu" if not torch.cuda.is_available() else None
    results = list(tmp_path.glob("gpu_check_*.txt"))
    assert len(results) == 1 and (device is None or results[0].name == f"gpu_check_{device}.txt")
    verdicts = dict(line.split(":", 1)[0].split(" ", 1)[::-1]
                    for line in results[0].read_text().splitlines()[1:-1])
    assert verdicts["local-spec"] == "PASS"
    if not torch.cuda.is_available():
        assert verdicts["te-grouped-gemm"] == verdicts["megatron-fsdp"] == "SKIP"
        assert "SKIP megatron-fsdp: needs CUDA" in done.stdout
    assert (tmp_path / results[0].name.replace(".txt", "_logs") / "local-spec_full.log").is_file()
