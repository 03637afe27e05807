"""bench/gpu_check.sh, the prepared GPU check, runs on CPU too, through the same torchrun launches
and the same offline wheel path as on the workplace's GPU machine: `--prepare` downloads what the
device image lacks, and the check runs from a Python that has only the device image's packages
(bench/device_image_packages.txt) and installs the rest from those wheels without an index. The
CPU-capable steps pass and every step that needs CUDA says NOT RUN with its reason (so the script
cannot rot unseen)."""

import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
import torch

from _launch import REPO

sys.path.insert(0, str(REPO / "bench"))
import gpu_check  # noqa: E402
import gpu_check_wheels  # noqa: E402

CPU_STEPS = ["environment", "cpu-reference", "local-spec"]
CUDA_STEPS = ["flop-counter-cuda", "strict-device-nccl", "te-grouped-gemm", "megatron-fsdp",
              "throughput", "fused-accumulation"]


@pytest.fixture(scope="module")
def device_python(tmp_path_factory) -> Path:
    """A Python that has exactly the device image's distributions that this environment holds
    (torch, numpy, packaging, pytest, tensorboard...; not megatron-core, wandb or this project):
    a venv without packages whose one .pth names a folder of links to those distributions' files
    in this environment."""
    root = tmp_path_factory.mktemp("device")
    present = gpu_check_wheels.device_image()
    site = Path(sysconfig.get_paths()["purelib"])
    view = root / "device_image"
    view.mkdir(parents=True)
    for distribution in importlib.metadata.distributions(path=[str(site)]):
        if gpu_check_wheels.canonical(distribution.metadata["Name"]) not in present:
            continue
        for top in {Path(file).parts[0] for file in distribution.files or []}:
            if top not in ("__pycache__", "..") and not top.endswith(".pth") \
                    and (site / top).exists() and not (view / top).exists():
                (view / top).symlink_to(site / top)
    venv.create(root / "device", with_pip=False)
    python = root / "device" / "bin" / "python"
    device_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                                  "['purelib'])"], capture_output=True, text=True,
                                 check=True).stdout.strip()
    (Path(device_site) / "device_image.pth").write_text(f"{view}\n")
    return python


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU run bench/gpu_check.sh itself")
def test_gpu_check_runs_on_cpu_from_prepared_wheels(tmp_path, device_python):
    # A folder holding a wheel the check does not need is refused, left as it was (two versions
    # of one distribution would stop the install on the device).
    crowded = tmp_path / "crowded"
    crowded.mkdir()
    (crowded / "megatron_core-0.15.0-py3-none-any.whl").write_bytes(b"")
    refused = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--prepare",
                              str(crowded)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.splitlines() == [
        f"gpu_check_wheels: error: {crowded} holds wheels the check does not need "
        "(megatron_core-0.15.0-py3-none-any.whl); remove them or prepare into an empty folder"]
    assert [path.name for path in crowded.iterdir()] == ["megatron_core-0.15.0-py3-none-any.whl"]

    wheels = tmp_path / "whl"
    prepared = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--prepare",
                               str(wheels)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert prepared.returncode == 0, prepared.stderr
    # megatron-core 0.19.2 needs torch, numpy and packaging, all in the device image.
    assert [path.name.split("-")[:2] for path in wheels.iterdir()] == [["megatron_core", "0.19.2"]]
    assert 'carry=[".whl"]' in prepared.stdout

    probe = subprocess.run([device_python, "-c", "import torch, numpy, pytest, tensorboard\n"
                            "import importlib.util as u; print(u.find_spec('megatron'))"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    assert probe.stdout.strip() == "None", probe.stderr  # the device image's state

    done = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh")], cwd=REPO,
                          env={**os.environ, "GPU_CHECK_RESULTS": str(tmp_path),
                               "GPU_CHECK_WHEELS": str(wheels), "PYTHON": str(device_python),
                               "PYTHONPATH": ""},
                          capture_output=True, text=True, timeout=900)
    assert f"gpu_check_wheels: installed {next(wheels.iterdir()).name} into /tmp/" in done.stdout
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


def test_gpu_check_without_the_wheels_stops_in_one_line(tmp_path, device_python):
    (tmp_path / "whl").mkdir()
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh")], cwd=REPO,
                          env={**os.environ, "GPU_CHECK_RESULTS": str(tmp_path / "results"),
                               "GPU_CHECK_WHEELS": str(tmp_path / "whl"),
                               "PYTHON": str(device_python), "PYTHONPATH": ""},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("gpu_check_wheels: error: cannot install megatron-core==0.19.2 "
                           "offline from "), line
    assert line.endswith("No matching distribution found for megatron-core==0.19.2"), line
    assert not (tmp_path / "results").exists()


def test_a_step_runs_only_while_its_budget_fits_and_fails_past_it(tmp_path, monkeypatch):
    check = gpu_check.Check(tmp_path, tmp_path, gpu_check.Budget(60), on_gpu=False)
    started = []
    step = gpu_check.run_step(check, "local-spec", lambda: started.append(1))
    assert (step.verdict, started) == ("NOT RUN", [])
    assert step.detail.startswith("its budget of 100 s no longer fits: ")
    assert step.detail.endswith(" s left of the check's 60 s ($GPU_CHECK_SECONDS)")

    monkeypatch.setitem(gpu_check.STEP_SECONDS, "cpu-reference", 2)
    step = gpu_check.run_step(check, "cpu-reference", lambda: check.run(
        "a launch", ["sleep", "30"], "sleep.log", check.environment()))
    assert step.verdict == "FAIL"
    assert step.detail.startswith("a launch ran past the step's budget"), step.detail
    assert step.detail.endswith("s of its 2 s)"), step.detail
