"""After a resume the first step uses the checkpoint's weight-decay schedule, not the flags'.

Upstream: NVIDIA/Megatron-LM PR #5213 (dev branch only, not in core_r0.19.0). Targets
megatron-core 0.19.x (0.15.3's load_state_dict has the same order; not tested there).

`OptimizerParamScheduler.load_state_dict` restores the learning-rate fields, then calls
`self.step(num_steps)` (which writes `lr` and `weight_decay` into every optimizer param group),
and only afterwards restores `start_wd`, `end_wd`, `wd_incr_steps` and `wd_incr_style` from the
checkpoint. With --use-checkpoint-opt_param-scheduler and a command line whose weight-decay
flags differ from the checkpoint's, the param groups keep a weight decay computed from the
command line's schedule; training's first optimizer step after the resume uses it, and only the
scheduler step after it switches to the checkpoint's schedule. The resumed run is silently not
the run that was saved.

The fix: once megatron's load_state_dict has restored every field, write the param groups again
from the restored schedule (`step(0)`: same step count, nothing advanced).
"""

from __future__ import annotations

import functools

import torch

from megatron_patches.registry import Patch, PatchContext, register

NAME = "scheduler-resume-weight-decay"


def _scheduler_class():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler


def _apply() -> None:
    scheduler_cls = _scheduler_class()
    load_state_dict = scheduler_cls.load_state_dict
    if getattr(load_state_dict, "__wrapped_by__", None) == NAME:
        return

    @functools.wraps(load_state_dict)
    def load_state_dict_then_set_groups(self, state_dict):
        load_state_dict(self, state_dict)
        self.step(0)  # param groups from the schedule just restored

    load_state_dict_then_set_groups.__wrapped_by__ = NAME
    scheduler_cls.load_state_dict = load_state_dict_then_set_groups


def _scheduler(optimizer, wd: float):
    return _scheduler_class()(
        optimizer, init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10,
        lr_decay_style="constant", start_wd=wd, end_wd=wd, wd_incr_steps=10,
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=True)


def _not_needed_because(context: PatchContext) -> str | None:
    """Loads a checkpointed schedule with another weight decay into megatron's scheduler."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    saved = _scheduler(optimizer, wd=0.5).state_dict()
    _scheduler(optimizer, wd=0.0).load_state_dict(saved)
    if optimizer.param_groups[0]["weight_decay"] == 0.5:
        return "OptimizerParamScheduler.load_state_dict sets the checkpoint's weight decay"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="NVIDIA/Megatron-LM PR #5213",
    versions=">=0.19,<0.20",
    summary="param groups get the checkpoint's weight decay when the scheduler state is loaded",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
