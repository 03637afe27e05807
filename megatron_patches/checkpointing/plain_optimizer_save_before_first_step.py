"""The plain (not distributed) optimizer: a torch_dist checkpoint saved before the optimizer's
first step holds the moments that step would start from, so the run can resume from it.

Local fix (megatron-core 0.19.2 `Float16OptimizerWithFloat16Params` / `FP32Optimizer`
`sharded_state_dict`, read and tested there); the distributed optimizer's side of the same gap
is distopt-save-before-first-step (Megatron-LM #602).

Adam keeps no moments for a parameter until its first step, and an fp16 run skips its first
steps while the loss scaler calibrates (the default initial scale, 2^32, overflows), so a save
in that window (a short --save-interval, a time-limit or signal save) writes a checkpoint
without them (`--optimizer adam`, megatron's default; SGD's momentum is not made at a save);
megatron makes them (`init_state_fn`) only for the load's template. The save succeeds, and every
resume from it fails on every rank ("optimizer.state.exp_avg... from model not in state dict";
checkpoint-load-guard refuses it in one line): the checkpoint is good for --no-load-optim only.
Before such a save the moments are made as megatron makes them for a load (zeros: what Adam's
first step starts from); torch's own Adam (no Transformer Engine or apex) also gets its step
count, 0, which megatron does not save at 0 and so is given back at a load of moments saved
without any step.

Needed while megatron's sharded_state_dict makes the optimizer state only for a load (judged
from its source).
"""

from __future__ import annotations

import functools
import inspect

import torch

from megatron_patches.checkpointing.distopt_torch_adam_resume import (
    TORCH_ADAM, create_first_step_state)
from megatron_patches.registry import Patch, PatchContext, register, unwrapped, wrapped_by

NAME = "plain-optimizer-save-before-first-step"
_MADE_FOR_LOADS_ONLY = "if is_loading:\n            self.init_state_fn("


def _plain_optimizers() -> tuple[type, ...]:
    from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params

    return Float16OptimizerWithFloat16Params, FP32Optimizer


def _params(optimizer) -> list:
    return [param for group in optimizer.param_groups for param in group["params"]]


def _step_zero_where_none_was_saved(state_dict: dict) -> None:
    """megatron saves torch Adam's step as one common step, and none at 0: a checkpoint of
    moments without any step (nor one in its groups, where Transformer Engine's FusedAdam keeps
    it) was saved before the first step, so each parameter's step is 0 (torch's Adam reads it
    as it takes the state)."""
    saved = state_dict.get("optimizer", state_dict.get("optimizer_state_dict"))
    if not isinstance(saved, dict) or "common_step" in saved.get("state", {}) or any(
            "step" in group for group in saved.get("param_groups", ())):
        return
    for param_state in saved["state"].values():
        if isinstance(param_state, dict) and param_state and "step" not in param_state:
            param_state["step"] = torch.tensor(0.0)


def _apply() -> None:
    for cls in _plain_optimizers():
        if wrapped_by(cls.sharded_state_dict, NAME):
            continue
        sharded_state_dict, load_state_dict = cls.sharded_state_dict, cls.load_state_dict
        signature = inspect.signature(sharded_state_dict)

        def with_first_step_state(self, *args, _original=sharded_state_dict,
                                  _signature=signature, **kwargs):
            is_loading = _signature.bind(self, *args, **kwargs).arguments.get("is_loading")
            inner = self.optimizer
            # Adam's first step makes zero moments, as its init_state_fn does (SGD's would
            # copy the first gradient into its momentum buffer: not made here).
            if not is_loading and self.config.optimizer == "adam" and any(
                    not inner.state.get(param) for param in _params(inner)):
                create_first_step_state(self)
            return _original(self, *args, **kwargs)

        def load_with_step(self, state_dict, _original=load_state_dict):
            if isinstance(self.optimizer, TORCH_ADAM):
                _step_zero_where_none_was_saved(state_dict)
            _original(self, state_dict)

        functools.update_wrapper(with_first_step_state, sharded_state_dict)
        functools.update_wrapper(load_with_step, load_state_dict)
        with_first_step_state.__wrapped_by__ = NAME
        cls.sharded_state_dict = with_first_step_state
        cls.load_state_dict = load_with_step


def _not_needed_because(context: PatchContext) -> str | None:
    if not any(_MADE_FOR_LOADS_ONLY in inspect.getsource(unwrapped(cls.sharded_state_dict))
               for cls in _plain_optimizers()):
        return "megatron's plain optimizers make their state for saves too"
    return None


register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 Float16OptimizerWithFloat16Params/FP32Optimizer."
             "sharded_state_dict: init_state_fn for loads only; cf. Megatron-LM #602)",
    versions=">=0.19,<0.20",
    summary="the plain optimizer's torch_dist save before its first step (fp16's skipped "
            "steps) holds zero moments, what that step starts from, so the run resumes from it "
            "instead of every resume failing on every rank",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
