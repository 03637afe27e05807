"""Distributed optimizer: a checkpoint saved before the optimizer's first step holds the moments
that step would start from (zeros), instead of failing on every rank.

Upstream: NVIDIA/Megatron-LM#602 ("optimizer state is empty when save-interval=20", fp16,
closed as stale) and the traceback in #1053 (`optim_state: {}` in `save_parameter_state`).
Targets megatron-core 0.19.x (read and tested on 0.19.2).

Adam keeps no moments for a parameter until its first step. An fp16 run skips its first steps
while the loss scaler calibrates (the default initial scale, 2^32, overflows; a real model skips
a dozen or more), so a save in that window (a short --save-interval, a time-limit or signal
save) finds no moments. megatron's `_get_main_param_and_optimizer_states` then returns the main
weight alone and the callers index the moments by name: `--ckpt-format torch` fails in
`save_parameter_state` with `KeyError: 'exp_avg'` on every rank, nothing committed. (torch_dist
reads the moments the same way; on CPU torch Adam's moments exist by then, created by
distopt-torch-adam-resume in `state_dict()`, which torch_dist calls first and the torch format
after.) The moments a step has not made yet are returned as zeros of the main weight's shape:
what Adam's first step starts from, so a resume from such a checkpoint trains on as the run
that saved it. Left to megatron: the precision-aware optimizer (its master weights live in the
optimizer's state too, and do not exist before the first step either).

Needed while megatron's function returns no moments for a parameter that has not stepped
(judged on torch Adam with one parameter).
"""

from __future__ import annotations

import functools
import types

import torch

from megatron_patches.registry import Patch, PatchContext, register, unwrapped, wrapped_by

NAME = "distopt-save-before-first-step"
_ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _distributed_optimizer():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DistributedOptimizer


def _returns_moments_before_a_step(get_states) -> bool:
    param = torch.nn.Parameter(torch.zeros(2))
    stand_in = types.SimpleNamespace(
        model_param_group_index_map={param: (0, 0)}, optimizer=torch.optim.Adam([param]),
        config=types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
        optimizer_state_keys=_ADAM_MOMENTS)
    return set(_ADAM_MOMENTS) <= get_states(stand_in, param).keys()


def _not_needed_because(context: PatchContext) -> str | None:
    megatrons = unwrapped(_distributed_optimizer()._get_main_param_and_optimizer_states)
    if _returns_moments_before_a_step(megatrons):
        return "megatron returns the moments of a parameter that has not stepped yet"
    return None


def _apply() -> None:
    cls = _distributed_optimizer()
    get_states = cls._get_main_param_and_optimizer_states
    if wrapped_by(get_states, NAME):
        return

    @functools.wraps(get_states)
    def _get_main_param_and_optimizer_states(self, model_param):
        tensors = get_states(self, model_param)
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return tensors
        not_yet = [key for key in self.optimizer_state_keys if key not in tensors]
        if not_yet:
            main_weight = tensors["param"]
            tensors = {**tensors, **{key: torch.zeros_like(main_weight) for key in not_yet}}
        return tensors

    _get_main_param_and_optimizer_states.__wrapped_by__ = NAME
    cls._get_main_param_and_optimizer_states = _get_main_param_and_optimizer_states


register(Patch(
    name=NAME,
    upstream="Megatron-LM #602 (closed as stale), #1053",
    versions=">=0.19,<0.20",
    summary="the distributed optimizer's checkpoint before its first step (fp16's skipped "
            "steps) saves zero moments, what that step starts from, instead of KeyError "
            "'exp_avg' on every rank (torch format)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
