"""bench/gpu_check.sh, the prepared GPU check, runs on CPU too, through the same torchrun launches:
the CPU-capable steps pass and every step that needs CUDA says NOT RUN with its reason (so the
script cannot rot unseen)."""

import os
import re
import subprocess
import sys

import pytest
import torch

from _launch import REPO

CPU_STEPS = ["environment", "cpu-reference", "local-spec"]
CUDA_STEPS = ["flop-counter-cuda", "strict-device-nccl", "te-grouped-gemm", "megatron-fsdp",
              "throughput", "fused-accumulation"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU run bench/gpu_check.sh itself")
def test_gpu_check_runs_on_cpu(tmp_path):
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh")], cwd=REPO,
                          env={**os.environ, "GPU_CHECK_RESULTS": str(tmp_path),
                               "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = (tmp_path / "gpu_check_cpu.txt").read_text().splitlines()
    verdicts = dict(re.match(r"(PASS|FAIL|NOT RUN) ([\w-]+): ", line).group(2, 1)
                    for line in lines[1:-1])
    assert list(verdicts) == ["environment", "cpu-reference", "flop-counter-cuda", "local-spec",
                              "strict-device-nccl", "te-grouped-gemm", "megatron-fsdp",
                              "throughput", "fused-accumulation"], lines
    assert all(verdicts[step] == "PASS" for step in CPU_STEPS), lines
    assert all(verdicts[step] == "NOT RUN" for step in CUDA_STEPS), lines
    # What needs CUDA says so, the strict-mode half of the NCCL comparison and the fused test's
    # pytest still ran, and Transformer Engine's absence is in the last line.
    for step in ("flop-counter-cuda", "megatron-fsdp", "throughput"):
        assert f"NOT RUN {step}: needs CUDA" in lines
    assert "NOT RUN strict-device-nccl: needs CUDA (strict mode ran: refuses 7 of 15" in done.stdout
    assert re.search(r"^NOT RUN fused-accumulation: needs .+ \(pytest skipped it\)$",
                     "\n".join(lines), re.M), lines
    assert "FlopCounterMode on cpu" in done.stdout
    assert lines[-1].startswith("gpu_check: 3 passed, 0 failed, 6 not run; TE step not run: ")
    assert lines[-1] == done.stdout.strip().splitlines()[-1]
    assert "gpu throughput ratio" not in done.stdout
    logs = tmp_path / "gpu_check_cpu_logs"
    assert "[ranks]" not in (logs / "local-spec_full.log").read_text()  # torchrun, not forked
