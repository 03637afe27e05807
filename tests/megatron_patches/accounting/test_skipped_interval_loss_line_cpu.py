"""Patch skipped-interval-loss-line: an fp16 run whose loss scaler skips an iteration after it
has stepped (2 ranks, --log-interval 1) prints no loss on that iteration's line.

Reference: megatron's own TensorBoard record of the same run, each iteration's own loss
(megatron computes it for a skipped step too): every loss printed equals it, and the skipped
iteration's is far from 0. Without the patch megatron-core 0.19.2 prints `lm loss:
0.000000E+00` on that line.
"""

from __future__ import annotations

import pytest

from _launch import TINY_MODEL, launch, printed_losses, tensorboard_scalars

pytestmark = pytest.mark.slow

NAME = "skipped-interval-loss-line"
# The tiny model's fp16 gradients overflow at this scale at iterations 1, 2 and 5 (the fp32
# gradient buffer of test_fsdp_fp16_cpu's reference path).
ARGS = [*("--fp16" if flag == "--bf16" else flag for flag in TINY_MODEL),
        "--initial-loss-scale", "4194304", "--train-iters", "6",
        "--use-distributed-optimizer", "--accumulate-allreduce-grads-in-fp32"]


def skipped_lines(log: str) -> list[int]:
    return [i for i, count in printed_losses(log, "number of skipped iterations").items()
            if count != "0"]


def run(tmp_path, env=None):
    launched = launch(2, [*ARGS, "--tensorboard-dir", str(tmp_path / "tb")], timeout=300,
                      env=env)
    launched.check()
    return launched.log, tensorboard_scalars(tmp_path / "tb", "lm loss")


def test_a_skipped_line_prints_no_loss(tmp_path):
    log, own = run(tmp_path)
    skipped = skipped_lines(log)
    printed = printed_losses(log)
    # The premise: a step was skipped after one was taken.
    after_a_step = [i for i in skipped if any(j < i for j in printed)]
    assert after_a_step, (skipped, printed)
    assert not set(printed) & set(skipped)
    assert sorted(printed) == [i for i in range(1, 7) if i not in skipped]
    assert all(float(printed[i]) == pytest.approx(own[i], rel=1e-6) for i in printed)
    assert all(own[i] > 1.0 for i in after_a_step)  # TensorBoard has each skipped step's loss


def test_unpatched_a_skipped_line_prints_a_loss_of_zero(tmp_path):
    log, own = run(tmp_path, env={"MEGATRON_PATCHES_DISABLE": NAME})
    printed = printed_losses(log)
    zeros = [i for i in skipped_lines(log) if printed.get(i) == "0.000000E+00"]
    assert zeros, printed
    assert all(own[i] > 1.0 for i in zeros)
