"""Patch fsdp-dtensor-loss-scale: Megatron-FSDP in fp16 (2 ranks, fsdp_dtensor) stopped at
iteration 3 and resumed trains iterations 4-6 as the run that was not stopped.

Reference: the uninterrupted run (same command line, no save): the resumed losses, loss scales
and gradient norms equal its own. The initial scale overflows the tiny model's gradients, so
the scaler has halved it by iteration 3. Without the patch megatron-core 0.19.2's fsdp_dtensor
checkpoint holds no scaler state: the resume starts again from --initial-loss-scale, skips
steps the uninterrupted run took and trains on other losses, exit 0. A checkpoint saved without
the patch still loads with it (from the initial scale, as before).
"""

from __future__ import annotations

import pytest

from _launch import TINY_MODEL, launch, printed_losses

pytestmark = pytest.mark.slow

NAME = "fsdp-dtensor-loss-scale"
INITIAL_SCALE = "4194304"
ARGS = [*("--fp16" if flag == "--bf16" else flag for flag in TINY_MODEL),
        "--initial-loss-scale", INITIAL_SCALE, "--train-iters", "6",
        "--use-megatron-fsdp", "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor",
        "--moe-token-dispatcher-type", "alltoall"]
KEYS = ("lm loss", "loss scale", "grad norm")


@pytest.fixture(scope="module")
def uninterrupted():
    run = launch(2, ARGS, timeout=300)
    run.check()
    return {key: {i: value for i, value in printed_losses(run.log, key).items() if i > 3}
            for key in KEYS}


def stopped_and_resumed(tmp_path, save_env=None):
    save = tmp_path / "ckpt"
    launch(2, [*ARGS, "--save", str(save), "--save-interval", "3", "--exit-interval", "3"],
           timeout=300, env=save_env).check()
    resumed = launch(2, [*ARGS, "--load", str(save)], timeout=300)
    resumed.check()
    return {key: printed_losses(resumed.log, key) for key in KEYS}


def test_resumes_with_the_loss_scale_it_stopped_at(uninterrupted, tmp_path):
    # The premise: the scaler moved off its initial value before the stop.
    assert float(uninterrupted["loss scale"][4]) < float(INITIAL_SCALE)
    assert stopped_and_resumed(tmp_path) == uninterrupted


def test_saved_without_the_patch_it_restarts_from_the_initial_scale(uninterrupted, tmp_path):
    resumed = stopped_and_resumed(tmp_path, save_env={"MEGATRON_PATCHES_DISABLE": NAME})
    assert float(resumed["loss scale"][4]) == float(INITIAL_SCALE)
    assert resumed != uninterrupted
