"""Patch plain-optimizer-save-before-first-step: an fp16 run with megatron's plain optimizer
(no --use-distributed-optimizer) saves in torch_dist while its loss scaler still skips every
step (no Adam moments exist yet), and a resume from that checkpoint trains on as the
uninterrupted run.

Reference: the uninterrupted run (2 ranks, the same command line without saving): the resumed
losses and loss scales of iterations 4-6 equal its own. Without the patch (and without
checkpoint-load-guard, which refuses such a checkpoint in one line) megatron-core 0.19.2's
resume fails on every rank at the load: the checkpoint has no moments.
"""

from __future__ import annotations

import pytest

from _launch import TINY_MODEL, launch, printed_losses

pytestmark = pytest.mark.slow

NAME = "plain-optimizer-save-before-first-step"
SKIPPED = "number of skipped iterations"
# The tiny model's fp16 gradients overflow at this scale: the scaler skips (halving it) three
# times before the first step.
ARGS = [*("--fp16" if flag == "--bf16" else flag for flag in TINY_MODEL),
        "--initial-loss-scale", "4194304", "--train-iters", "6"]


def skipped(log: str) -> dict[int, int]:
    return {i: int(count) for i, count in printed_losses(log, SKIPPED).items()}


def stopped_at_3(save, env=None):
    stopped = launch(2, [*ARGS, "--save", str(save), "--save-interval", "3",
                         "--exit-interval", "3"], timeout=300, env=env)
    stopped.check()
    # The premise: iterations 1-3 were skipped, so the save at 3 came before any step.
    assert skipped(stopped.log) == {1: 1, 2: 1, 3: 1}, skipped(stopped.log)


def test_saved_before_the_first_step_resumes_as_the_run_trained_on(tmp_path):
    stopped_at_3(tmp_path / "ckpt")
    resumed = launch(2, [*ARGS, "--load", str(tmp_path / "ckpt")], timeout=300)
    resumed.check()
    uninterrupted = launch(2, ARGS, timeout=300)
    uninterrupted.check()
    for key in ("lm loss", "loss scale"):
        trained_on = {i: v for i, v in printed_losses(uninterrupted.log, key).items() if i > 3}
        assert printed_losses(resumed.log, key) == trained_on, key
    assert len(printed_losses(resumed.log)) == 3  # iterations that stepped after the resume


def test_unpatched_every_resume_fails_at_the_load(tmp_path):
    unpatched = {"MEGATRON_PATCHES_DISABLE": f"{NAME},checkpoint-load-guard"}
    stopped_at_3(tmp_path / "ckpt", env=unpatched)
    resumed = launch(2, [*ARGS, "--load", str(tmp_path / "ckpt")], timeout=300, env=unpatched)
    assert resumed.exit_codes == [1, 1], resumed.log[-3000:]
    assert resumed.log.count("optimizer.state.exp_avg") >= 2, resumed.log[-3000:]
    assert "from model not in state dict" in resumed.log
    assert not printed_losses(resumed.log)
