"""`--optimizer sgd` resumes from a torch_dist checkpoint.

megatron-core 0.19.2 builds torch's SGD with `init_state_fn = None`
(`megatron.core.optimizer._get_megatron_optimizer_based_on_param_groups`), and every optimizer
wrapper calls `self.init_state_fn(...)` when it lays out the state to load
(`sharded_state_dict(is_loading=True)`): every rank of an SGD run dies at the resume with
`TypeError: 'NoneType' object is not callable` (issue 43). Adam, Lion and the emerging
optimizers get a function that creates their state before the load.

The patch gives SGD one where megatron's optimizer wrapper (`MegatronOptimizer.__init__`, under
every wrapper: FP32, mixed precision, distributed) receives none: each parameter's
`momentum_buffer`, zeros of its shape, which the load then overwrites with the saved one. SGD
without momentum keeps no state, so nothing is made. Needed where megatron hands SGD no state
function. Targets 0.15.x - 0.19.x.
"""

from __future__ import annotations

import functools
import inspect

import torch

from megatron_patches.registry import Patch, register

NAME = "sgd-resume-state"


def _momentum_buffers(optimizer: torch.optim.Optimizer, config=None) -> None:
    for group in optimizer.param_groups:
        if not group.get("momentum"):
            continue
        for param in group["params"]:
            state = optimizer.state[param]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(param.data)


def _not_needed_because(context):
    from megatron.core.optimizer import OptimizerConfig, _get_megatron_optimizer_based_on_param_groups

    config = OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.9)
    probe = torch.nn.Parameter(torch.zeros(2))
    build = _get_megatron_optimizer_based_on_param_groups
    arguments = dict(config=config, model_chunks=[], param_groups=[{"params": [probe]}])
    if "skip_megatron_wrapping" in inspect.signature(build).parameters:
        _, init_state_fn = build(**arguments, skip_megatron_wrapping=True)
    else:  # 0.15: the optimizer comes wrapped, and its wrapper keeps the function it was given
        init_state_fn = build(**arguments).init_state_fn
    if init_state_fn is not None:
        return "megatron gives SGD a state function"
    return None


def _apply():
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    build = MegatronOptimizer.__init__
    signature = inspect.signature(build)

    @functools.wraps(build)
    def __init__(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        if (isinstance(call.arguments.get("optimizer"), torch.optim.SGD)
                and "init_state_fn" in call.arguments and call.arguments["init_state_fn"] is None):
            call.arguments["init_state_fn"] = _momentum_buffers
        build(*call.args, **call.kwargs)

    __init__.__wrapped_by__ = NAME
    MegatronOptimizer.__init__ = __init__


PATCH = register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 optimizer/__init__.py: SGD built with "
             "init_state_fn None, called at every sharded load)",
    versions=">=0.15,<0.20",
    summary="--optimizer sgd gets a state function (momentum buffers made before the load), "
            "so it resumes from torch_dist instead of a TypeError on every rank",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
