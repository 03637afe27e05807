"""A `--ckpt-format torch_dcp` checkpoint (megatron's format for `--use-torch-fsdp2`) resumes with
its optimizer state.

Local fix (megatron-core 0.19.2 `load_checkpoint`, torch_dcp branch, read and tested there).
megatron builds the load's template with `optimizer.state_dict(is_loading=True)`, but the
optimizer it builds is a `ChainedOptimizer`, whose `state_dict()` takes no argument: every
torch_dcp resume failed on every rank once the model was built ("ChainedOptimizer.state_dict()
got an unexpected keyword argument 'is_loading'"), so a torch FSDP2 run could save and never
resume. `FP32Optimizer.state_dict()` (fp32 runs) takes none either.

The template must hold every state entry the checkpoint holds, or the load leaves it out: for
torch's own Adam (no Transformer Engine or apex) that includes `step`, which megatron's
`init_state_fn` does not make; without it Adam's bias correction restarted at 0 and the resume
trained on other losses from its second step. So a chain's template is each optimizer's with
the state its first step would make (distopt-torch-adam-resume's create_first_step_state: torch
Adam's own, else megatron's `init_state_fn`'s, as `state_dict(is_loading=True)` makes it).

Needed while megatron's ChainedOptimizer.state_dict takes no `is_loading` (judged from its
signature).
"""

from __future__ import annotations

import functools
import inspect

from megatron_patches.checkpointing.distopt_torch_adam_resume import create_first_step_state
from megatron_patches.registry import Patch, PatchContext, register, unwrapped, wrapped_by

NAME = "torch-dcp-optimizer-load"


def _chained_optimizer() -> type:
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    return ChainedOptimizer


def _template(optimizer) -> dict:
    """One chained optimizer's state dict as a load's template: the state its first step makes."""
    create_first_step_state(optimizer)
    return optimizer.state_dict()


def _apply() -> None:
    cls = _chained_optimizer()
    if wrapped_by(cls.state_dict, NAME):
        return
    state_dict = cls.state_dict

    @functools.wraps(state_dict)
    def state_dict_for_loads_too(self, is_loading: bool = False):
        if not is_loading:
            return state_dict(self)
        templates = [_template(optimizer) for optimizer in self.chained_optimizers]
        return templates[0] if len(templates) == 1 else templates

    state_dict_for_loads_too.__wrapped_by__ = NAME
    cls.state_dict = state_dict_for_loads_too


def _not_needed_because(context: PatchContext) -> str | None:
    parameters = inspect.signature(unwrapped(_chained_optimizer().state_dict)).parameters
    if "is_loading" in parameters:
        return "megatron's ChainedOptimizer.state_dict takes is_loading"
    return None


register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 load_checkpoint torch_dcp branch: "
             "optimizer.state_dict(is_loading=True) on a ChainedOptimizer, which takes none)",
    versions=">=0.19,<0.20",
    summary="a --ckpt-format torch_dcp checkpoint (--use-torch-fsdp2) resumes with its optimizer "
            "state, torch Adam's step included, instead of a TypeError on every rank",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
