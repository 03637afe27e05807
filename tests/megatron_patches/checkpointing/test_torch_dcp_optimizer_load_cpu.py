"""Patch torch-dcp-optimizer-load: a torch FSDP2 run (`--use-torch-fsdp2`, 2 ranks, bf16) saved
in `--ckpt-format torch_dcp` resumes where it stopped.

Reference: the uninterrupted run. Stopped at 2 of 4, the resume prints its losses 3 and 4 (the
saved weights, then the first step of the loaded optimizer: Adam's moments and its step, whose
bias correction restarted at 0 when the load's template lacked it, and the losses differed from
iteration 4 on). Unpatched, megatron-core 0.19.2 fails the load on every rank. (The torch_dist
save such a run cannot make is refused before work: test_preflight.py.)
"""

from __future__ import annotations

import pytest

from _launch import TINY_MODEL, launch, printed_losses

NAME = "torch-dcp-optimizer-load"
ARGS = [*TINY_MODEL, "--use-torch-fsdp2", "--ckpt-format", "torch_dcp", "--train-iters", "4"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """(its checkpoint folder, saved at 2 and 4; its printed losses)"""
    ckpt = tmp_path_factory.mktemp("torch_fsdp2") / "ckpt"
    run = launch(2, [*ARGS, "--save", str(ckpt), "--save-interval", "2"], timeout=300).check()
    return ckpt, printed_losses(run.log)


def resumed(ckpt, env=None):
    return launch(2, [*ARGS, "--load", str(ckpt), "--ckpt-step", "2"], env=env, timeout=300)


def test_resume_matches_the_uninterrupted_run(uninterrupted):
    ckpt, losses = uninterrupted
    run = resumed(ckpt).check()
    assert f"[megatron_patches] {NAME}: applied" in run.log
    assert sorted(losses) == [1, 2, 3, 4]
    assert printed_losses(run.log) == {3: losses[3], 4: losses[4]}, (printed_losses(run.log),
                                                                    losses)


def test_unpatched_every_rank_fails_at_the_load(uninterrupted):
    run = resumed(uninterrupted[0], env={"MEGATRON_PATCHES_DISABLE": NAME})
    assert run.exit_codes[0] != 0 and run.exit_codes[1] != 0, run.log[-3000:]
    assert "got an unexpected keyword argument 'is_loading'" in run.log, run.log[-3000:]
    assert not printed_losses(run.log)
