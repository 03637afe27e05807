"""Patch torch-format-ckpt-step: a torch-format checkpoint of the distributed optimizer resumed
with `--ckpt-step` at an iteration older than the newest trains on from that iteration.

Reference: the run that saved the checkpoints (2 ranks, iterations 1-6, saved at 2, 4 and 6):
resumed from iteration 2 the losses of iterations 3-6 equal its own (the torch format resumes
bit for bit). Without the patch megatron-core 0.19.2 loads iteration 2's model with iteration
6's optimizer state and reports iteration 6 as resumed: the run ends without training an
iteration, exit 0.
"""

from __future__ import annotations

import pytest

from _launch import TINY_MODEL, launch, printed_losses

pytestmark = pytest.mark.slow

NAME = "torch-format-ckpt-step"
ARGS = [*TINY_MODEL, "--use-distributed-optimizer", "--ckpt-format", "torch",
        "--train-iters", "6"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    save = tmp_path_factory.mktemp("ckpt_step") / "ckpt"
    run = launch(2, [*ARGS, "--save", str(save), "--save-interval", "2"], timeout=300)
    run.check()
    assert sorted(path.name for path in save.glob("iter_*")) == [
        "iter_0000002", "iter_0000004", "iter_0000006"]
    return save, printed_losses(run.log)


def resumed(save, env=None):
    return launch(2, [*ARGS, "--load", str(save), "--ckpt-step", "2"], timeout=300, env=env)


def test_resumes_the_iteration_named(saved):
    save, losses = saved
    run = resumed(save)
    run.check()
    assert printed_losses(run.log) == {i: loss for i, loss in losses.items() if i > 2}


def test_unpatched_it_resumes_the_newest_optimizer_state_and_iteration(saved):
    save, _ = saved
    run = resumed(save, env={"MEGATRON_PATCHES_DISABLE": NAME})
    run.check()
    # megatron names the iteration it was asked for, then reports the tracker's as loaded
    assert f"loading checkpoint from {save} at iteration 2" in run.log, run.log[-3000:]
    assert f"successfully loaded checkpoint from {save}" in run.log
    assert run.log.count("] at iteration 6") == 1, run.log[-3000:]
    assert not printed_losses(run.log), run.log[-3000:]
