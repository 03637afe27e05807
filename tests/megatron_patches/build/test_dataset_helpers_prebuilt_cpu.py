"""Patch dataset-helpers-prebuilt: megatron's initialisation runs `make` in the installed
megatron/core/datasets folder (compile_helpers), which the PyPI wheel ships with its compiled
helpers_cpp but without a Makefile. Without the patch a run stops there, before any iteration;
with it (every other launched test) the wheel's helpers are used."""

import os
import re

import pytest

from _launch import TINY_MODEL, launch


@pytest.mark.slow
def test_without_the_patch_a_wheel_install_stops_at_megatrons_make(tmp_path):
    import megatron.core.datasets as datasets

    assert not os.path.exists(os.path.join(os.path.dirname(datasets.__file__), "Makefile"))
    run = launch(1, [*TINY_MODEL, "--train-iters", "1"],
                 env={"MEGATRON_PATCHES_DISABLE": "dataset-helpers-prebuilt"}, timeout=300)
    assert run.returncode != 0, run.log[-3000:]
    # make's own complaint (or, where make is not installed, the missing program)
    assert ("Failed to compile the C++ dataset helper functions" in run.log
            or "No such file or directory: 'make'" in run.log), run.log[-3000:]
    assert not re.search(r"iteration\s+1/", run.log)
