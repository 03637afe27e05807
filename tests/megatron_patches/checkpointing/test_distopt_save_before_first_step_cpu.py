"""Patch distopt-save-before-first-step: an fp16 run with the distributed optimizer saves in the
torch format while its loss scaler still skips every step (no Adam moments exist yet), and a
resume from that checkpoint trains on as the uninterrupted run.

Reference: the uninterrupted run (2 ranks, the same command line without saving): the resumed
losses and loss scales of iterations 3-6 equal its own. Without the patch the save fails on
every rank with megatron-core 0.19.2's `KeyError: 'exp_avg'` (Megatron-LM #602) and nothing is
committed.
"""

from __future__ import annotations

import pytest

from _launch import TINY_MODEL, launch, printed_losses

pytestmark = pytest.mark.slow

NAME = "distopt-save-before-first-step"
SKIPPED = "number of skipped iterations"
# The tiny model's fp16 gradients overflow at this scale: the scaler skips (halving it) before
# the first step.
ARGS = [*("--fp16" if flag == "--bf16" else flag for flag in TINY_MODEL),
        "--initial-loss-scale", "4194304", "--use-distributed-optimizer",
        "--ckpt-format", "torch", "--train-iters", "6"]


def skipped(log: str) -> dict[int, int]:
    return {i: int(count) for i, count in printed_losses(log, SKIPPED).items()}


def test_saved_before_the_first_step_resumes_as_the_run_trained_on(tmp_path):
    save = tmp_path / "ckpt"
    stopped = launch(2, [*ARGS, "--save", str(save), "--save-interval", "2",
                         "--exit-interval", "2"], timeout=300)
    stopped.check()
    # The premise: iterations 1 and 2 were skipped, so the save at 2 came before any step.
    assert skipped(stopped.log) == {1: 1, 2: 1}, skipped(stopped.log)
    resumed = launch(2, [*ARGS, "--load", str(save)], timeout=300)
    resumed.check()
    uninterrupted = launch(2, ARGS, timeout=300)
    uninterrupted.check()
    for key in ("lm loss", "loss scale"):
        trained_on = {i: v for i, v in printed_losses(uninterrupted.log, key).items() if i > 2}
        assert printed_losses(resumed.log, key) == trained_on, key
    assert len(printed_losses(resumed.log)) >= 2  # iterations that stepped after the resume


def test_unpatched_the_save_fails_on_every_rank(tmp_path):
    save = tmp_path / "ckpt"
    run = launch(2, [*ARGS, "--save", str(save), "--save-interval", "2"], timeout=300,
                 env={"MEGATRON_PATCHES_DISABLE": NAME})
    assert run.exit_codes == [1, 1], run.log[-3000:]
    failures = [line for line in run.log.splitlines()
                if "saving iteration 2" in line and "KeyError: 'exp_avg'" in line]
    assert len(failures) == 2, run.log[-3000:]
    assert not (save / "iter_0000002").exists()
