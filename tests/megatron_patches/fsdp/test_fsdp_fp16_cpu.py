"""Patch fsdp-fp16-empty-shard-grads: Megatron-FSDP trains in fp16 on 2 data-parallel ranks,
where each rank holds no piece of several parameters (Megatron-FSDP gives those a None
gradient).

Reference: megatron's own DDP path with the distributed optimizer, fp32 gradient reduction
(`--accumulate-allreduce-grads-in-fp32`, Megatron-FSDP's fp32 main gradients) and the same
loss scaler, from the same CPU initialisation: the same iterations are skipped for inf/NaN
gradients (the initial scale overflows twice, then once more later), the same loss scales and
gradient norms, the losses to 1e-5. Without the patch every rank fails at the first step in
megatron's unscale (`AttributeError` on a None gradient).
"""

from __future__ import annotations

import pytest

from _launch import TINY_MODEL, launch, printed_losses

pytestmark = pytest.mark.slow

NAME = "fsdp-fp16-empty-shard-grads"
FP16 = ["--fp16" if flag == "--bf16" else flag for flag in TINY_MODEL]
# Overflows the tiny model's fp16 gradients at first, so the scaler skips steps and halves it.
LOSS_SCALE = ["--initial-loss-scale", "4194304", "--train-iters", "6"]
PATHS = {
    "fsdp": ["--use-megatron-fsdp", "--use-distributed-optimizer", "--ckpt-format",
             "fsdp_dtensor", "--moe-token-dispatcher-type", "alltoall"],
    "ddp": ["--use-distributed-optimizer", "--accumulate-allreduce-grads-in-fp32",
            "--moe-token-dispatcher-type", "alltoall"],
}


def train(path: str, env=None):
    return launch(2, [*FP16, *PATHS[path], *LOSS_SCALE], timeout=300, env=env)


def logged(log: str, key: str) -> dict[int, float]:
    return {iteration: float(value) for iteration, value in printed_losses(log, key).items()}


def test_fsdp_fp16_steps_and_skips_as_megatrons_ddp_path():
    fsdp, ddp = train("fsdp"), train("ddp")
    fsdp.check()
    ddp.check()
    scales = logged(fsdp.log, "loss scale")
    assert scales == logged(ddp.log, "loss scale")
    assert sorted(scales) == list(range(1, 7))
    # The scaler skipped steps (it halves on an overflow) and stepped (a gradient norm is
    # printed for an iteration that updated the weights).
    assert len(set(scales.values())) > 1, scales
    norms = logged(fsdp.log, "grad norm")
    assert norms == logged(ddp.log, "grad norm")
    assert len(norms) >= 3, norms
    losses, reference = logged(fsdp.log, "lm loss"), logged(ddp.log, "lm loss")
    assert sorted(losses) == sorted(reference)
    assert all(losses[i] == pytest.approx(reference[i], rel=1e-5) for i in losses), \
        (losses, reference)


def test_unpatched_every_rank_fails_at_the_first_step():
    run = train("fsdp", env={"MEGATRON_PATCHES_DISABLE": NAME})
    assert run.exit_codes == [1, 1], run.log[-3000:]
    assert run.log.count("AttributeError: 'NoneType' object has no attribute 'data'") == 2, \
        run.log[-3000:]
    assert "_collect_main_grad_data_for_unscaling" in run.log
    assert not printed_losses(run.log, "loss scale")
