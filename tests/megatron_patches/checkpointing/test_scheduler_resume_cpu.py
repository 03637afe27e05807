"""A resumed OptimizerParamScheduler writes the checkpoint's learning rate and weight decay into
the param groups the first step after the resume uses (patch scheduler-resume-weight-decay,
Megatron-LM PR #5213): the same values the uninterrupted run uses, although the command line of
the resumed run asks for another weight-decay schedule (--use-checkpoint-opt_param-scheduler)."""

import pytest
import torch


def scheduler(optimizer, start_wd, end_wd, wd_incr_style):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=10,
        lr_decay_steps=100, lr_decay_style="cosine", start_wd=start_wd, end_wd=end_wd,
        wd_incr_steps=100, wd_incr_style=wd_incr_style, use_checkpoint_opt_param_scheduler=True)


def adamw():
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))], lr=0.0)


@pytest.mark.parametrize("saved_style, command_line_style", [("linear", "cosine"),
                                                              ("cosine", "linear")])
def test_first_step_after_resume_uses_the_checkpoint_weight_decay(saved_style,
                                                                  command_line_style):
    from megatron_patches import registry

    registry.load_patches()
    registry.apply_patches(registry.current_context(cpu_backend=True))

    uninterrupted_optimizer = adamw()
    uninterrupted = scheduler(uninterrupted_optimizer, 0.01, 0.1, saved_style)
    uninterrupted.step(40)
    checkpoint = uninterrupted.state_dict()

    resumed_optimizer = adamw()
    resumed = scheduler(resumed_optimizer, 0.0, 0.3, command_line_style)
    resumed.load_state_dict(checkpoint)

    expected = uninterrupted_optimizer.param_groups[0]
    got = resumed_optimizer.param_groups[0]
    assert (resumed.start_wd, resumed.end_wd, resumed.wd_incr_style) == (0.01, 0.1, saved_style)
    assert got["lr"] == expected["lr"]
    assert got["weight_decay"] == expected["weight_decay"], (
        f"first step after resume: weight decay {got['weight_decay']}, "
        f"uninterrupted run {expected['weight_decay']}")
