"""A resumed OptimizerParamScheduler writes the checkpoint's learning rate and weight decay into
the param groups the first step after the resume uses (patch scheduler-resume-weight-decay,
Megatron-LM PR #5213): the same values the uninterrupted run uses, although the command line of
the resumed run asks for another weight-decay schedule (--use-checkpoint-opt_param-scheduler).
With the patch left out (megatron-core 0.19.2's own load_state_dict) the first step gets the
command line's weight decay at the checkpoint's step instead."""

import pytest
import torch

import _unpatched

PATCH = "scheduler-resume-weight-decay"
SAVED_AT = 40


def scheduler(optimizer, start_wd, end_wd, wd_incr_style):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=10,
        lr_decay_steps=100, lr_decay_style="cosine", start_wd=start_wd, end_wd=end_wd,
        wd_incr_steps=100, wd_incr_style=wd_incr_style, use_checkpoint_opt_param_scheduler=True)


def adamw():
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))], lr=0.0)


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
@pytest.mark.parametrize("saved_style, command_line_style", [("linear", "cosine"),
                                                              ("cosine", "linear")])
def test_first_step_after_resume_uses_the_checkpoint_weight_decay(saved_style,
                                                                  command_line_style, patched,
                                                                  monkeypatch):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    _unpatched.apply_all()
    if not patched:
        _unpatched.leave_out(monkeypatch, PATCH, OptimizerParamScheduler, "load_state_dict")

    uninterrupted_optimizer = adamw()
    uninterrupted = scheduler(uninterrupted_optimizer, 0.01, 0.1, saved_style)
    uninterrupted.step(SAVED_AT)
    checkpoint = uninterrupted.state_dict()

    resumed_optimizer = adamw()
    resumed = scheduler(resumed_optimizer, 0.0, 0.3, command_line_style)
    resumed.load_state_dict(checkpoint)

    expected = uninterrupted_optimizer.param_groups[0]
    got = resumed_optimizer.param_groups[0]
    assert (resumed.start_wd, resumed.end_wd, resumed.wd_incr_style) == (0.01, 0.1, saved_style)
    assert got["lr"] == expected["lr"]
    if patched:
        assert got["weight_decay"] == expected["weight_decay"], (
            f"first step after resume: weight decay {got['weight_decay']}, "
            f"uninterrupted run {expected['weight_decay']}")
        return
    # megatron's own: the command line's schedule at the saved step, a run that was not saved
    command_line_optimizer = adamw()
    scheduler(command_line_optimizer, 0.0, 0.3, command_line_style).step(SAVED_AT)
    command_line_wd = command_line_optimizer.param_groups[0]["weight_decay"]
    print(f"unpatched first step after resume: weight decay {got['weight_decay']}, "
          f"uninterrupted run {expected['weight_decay']}")
    assert command_line_wd != expected["weight_decay"]
    assert got["weight_decay"] == command_line_wd
    resumed.step(1)  # the scheduler step after it switches to the checkpoint's schedule
    uninterrupted.step(1)
    assert got["weight_decay"] == expected["weight_decay"]


@pytest.mark.slow
def test_launched_resume_trains_as_the_uninterrupted_run_only_with_the_patch(tmp_path):
    """The same through pretrain_moe.py: a run saved at iteration 2 with one weight-decay
    schedule, resumed with --use-checkpoint-opt_param-scheduler from a command line that asks
    for another. Patched, iterations 3-4 are the uninterrupted run's, bit for bit; with
    MEGATRON_PATCHES_DISABLE=scheduler-resume-weight-decay the first step after the resume
    decays with the command line's schedule and iteration 4 differs."""
    from _launch import TINY_MODEL, launch, tensorboard_scalars

    base = [*TINY_MODEL, "--ckpt-format", "torch_dist", "--train-iters", "4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "1"]
    saved = ["--start-weight-decay", "0.01", "--end-weight-decay", "0.5",
             "--weight-decay-incr-style", "linear"]
    asked = ["--start-weight-decay", "0.0", "--end-weight-decay", "0.9",
             "--weight-decay-incr-style", "cosine"]
    launch(1, [*base, *saved, "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
               "--tensorboard-dir", str(tmp_path / "uninterrupted")]).check()
    uninterrupted = tensorboard_scalars(tmp_path / "uninterrupted", "lm loss")
    resumed = {}
    for name, env in (("patched", {}), ("unpatched", {"MEGATRON_PATCHES_DISABLE": PATCH})):
        launch(1, [*base, *asked, "--use-checkpoint-opt_param-scheduler", "--load",
                   str(tmp_path / "ckpt"), "--ckpt-step", "2", "--tensorboard-dir",
                   str(tmp_path / name)], env=env).check()
        resumed[name] = tensorboard_scalars(tmp_path / name, "lm loss")
    assert resumed["patched"] == {3: uninterrupted[3], 4: uninterrupted[4]}, resumed
    assert resumed["unpatched"][3] == uninterrupted[3]  # the step before it is the same
    assert resumed["unpatched"][4] != uninterrupted[4], resumed
