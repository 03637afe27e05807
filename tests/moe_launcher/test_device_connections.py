"""CUDA_DEVICE_MAX_CONNECTIONS: the launcher sets it to 1 only where megatron requires it (TP or
CP without FSDP of either kind), so torch FSDP2 and Megatron-FSDP runs pass megatron's check
that it is not 1; a torch-FSDP2 run trains through the launcher."""

import os
import re
import subprocess

import pytest

from _launch import REPO, TINY_MODEL, launch
from moe_launcher.platform_defaults import set_environment_defaults

ONE = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
# argv -> the environment the launcher leaves (megatron's rule in validate_args)
CASES = {
    "data-parallel-only": ([], {}),
    "tp2": (["--tensor-model-parallel-size", "2"], ONE),
    "cp2": (["--context-parallel-size=2"], ONE),
    "tp1-cp1": (["--tensor-model-parallel-size", "1", "--context-parallel-size", "1"], {}),
    "torch-fsdp2": (["--use-torch-fsdp2"], {}),
    "tp2-torch-fsdp2": (["--tensor-model-parallel-size", "2", "--use-torch-fsdp2"], {}),
    "tp2-megatron-fsdp": (["--tensor-model-parallel-size", "2", "--use-megatron-fsdp"], {}),
    "tp2-overlap-moe-ep-comm": (["--tensor-model-parallel-size", "2",
                                 "--overlap-moe-expert-parallel-comm"], {}),
}


@pytest.mark.parametrize("argv, expected", CASES.values(), ids=CASES)
def test_one_device_connection_only_where_megatron_requires_it(argv, expected):
    environ = {}
    lines = set_environment_defaults(argv, environ)
    assert environ == expected
    assert len(lines) == len(expected)


def test_a_value_already_set_wins():
    environ = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    assert set_environment_defaults(["--tensor-model-parallel-size", "2"], environ) == []
    assert environ == {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}


@pytest.mark.slow
def test_torch_fsdp2_trains_through_the_launcher(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    run = launch(2, [*TINY_MODEL, "--use-torch-fsdp2", "--ckpt-format", "torch_dist",
                     "--train-iters", "2"]).check()
    assert re.search(r"use_torch_fsdp2 \.+ True", run.log)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in run.log
    assert re.search(r"iteration +2/ +2 \|.*lm loss: \d", run.log), run.log[-3000:]


@pytest.mark.parametrize("recipe, seen", [("mixtral_8x7b_pp", "1"), ("mixtral_8x7b_fsdp", "unset")])
def test_train_sh_exports_it_before_python_starts_for_the_recipes_that_need_it(
        recipe, seen, tmp_path):
    # A stand-in interpreter reports the environment train.sh starts Python with.
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\necho "seen=${CUDA_DEVICE_MAX_CONNECTIONS-unset}"\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k != "CUDA_DEVICE_MAX_CONNECTIONS" and not k.startswith("SLURM_")}
    done = subprocess.run(["bash", str(REPO / "examples" / "moe" / "train.sh")], cwd=REPO,
                          env={**env, "RECIPE": recipe, "DRY_RUN": "1", "PYTHON": str(python)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"seen={seen}" in done.stdout.splitlines(), done.stdout
