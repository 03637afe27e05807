"""Megatron-FSDP with --fp16: the loss scaler's unscale skips the parameters this rank holds no
piece of, instead of failing on every rank at the first optimizer step.

Local fix (megatron-core 0.19.2, read and tested there): Megatron-FSDP hands the optimizer a
gradient of None for every parameter whose shard on this rank is empty
(`ParamAndGradBuffer.update_main_grads`: "optimizer_grad.numel() == 0: grad = None"). With a
data-parallel group of two or more ranks most parameters of a real model lie wholly in another
rank's shard. bf16 and fp32 steps never look at them (torch's optimizers skip a None gradient),
but fp16's loss scaler first collects every gradient to unscale it and check it for inf/NaN
(`DistributedOptimizer._collect_main_grad_data_for_unscaling`, `param.grad.data` for each, or
`decoupled_grad` for the precision-aware optimizer), and every rank raises `AttributeError:
'NoneType' object has no attribute 'data'` at iteration 1. megatron's own fp16 optimizer for
unsharded parameters skips a None gradient there; this does the same for the distributed one.
An empty shard has nothing to unscale and nothing that can overflow, and the inf/NaN verdict is
still reduced over the ranks that hold the pieces.

Needed while megatron's method reads a None gradient (judged by calling it on one parameter
without one).
"""

from __future__ import annotations

import functools
import types

import torch

from megatron_patches.registry import Patch, PatchContext, register, unwrapped, wrapped_by

NAME = "fsdp-fp16-empty-shard-grads"


def _distributed_optimizer():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DistributedOptimizer


def _collects_none_gradient(collect) -> bool:
    """Whether `collect` (the unbound method) gets past a parameter whose gradient is None."""
    without_grad = torch.nn.Parameter(torch.zeros(0))
    stand_in = types.SimpleNamespace(
        config=types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
        optimizer=types.SimpleNamespace(param_groups=[{"params": [without_grad]}]))
    try:
        collect(stand_in)
    except AttributeError:
        return False
    return True


def _not_needed_because(context: PatchContext) -> str | None:
    megatrons = unwrapped(_distributed_optimizer()._collect_main_grad_data_for_unscaling)
    if _collects_none_gradient(megatrons):
        return "the distributed optimizer's unscale skips a parameter without a gradient"
    return None


def _gradient_attribute(optimizer) -> str:
    # The precision-aware optimizer keeps the gradient beside the parameter (megatron's choice).
    return ("decoupled_grad" if optimizer.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            else "grad")


def _apply() -> None:
    cls = _distributed_optimizer()
    if wrapped_by(cls._collect_main_grad_data_for_unscaling, NAME):
        return

    @functools.wraps(cls._collect_main_grad_data_for_unscaling)
    def _collect_main_grad_data_for_unscaling(self):
        attribute = _gradient_attribute(self)
        gradients = (getattr(param, attribute, None) for group in self.optimizer.param_groups
                     for param in group["params"])
        return [gradient.data for gradient in gradients if gradient is not None]

    _collect_main_grad_data_for_unscaling.__wrapped_by__ = NAME
    cls._collect_main_grad_data_for_unscaling = _collect_main_grad_data_for_unscaling


register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 DistributedOptimizer._collect_main_grad_data_for_"
             "unscaling reads the None gradient Megatron-FSDP gives an empty shard)",
    versions=">=0.19,<0.20",
    summary="Megatron-FSDP --fp16: the loss scaler unscales and checks the gradients this rank "
            "holds and skips the parameters whose shard here is empty (None gradient), instead "
            "of an AttributeError on every rank at the first step",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
