"""Distributed optimizer with torch's Adam (no Transformer Engine / apex): resume correctly.

Without TE/apex, megatron's DistributedOptimizer wraps `torch.optim.Adam(W)`, whose per-parameter
state (`step`, `exp_avg`, `exp_avg_sq`) only exists after the first step. megatron-core
0.15-0.19 (distrib_optimizer.py) then breaks a resume in three ways:

1. `state_dict()` asserts that all parameters share one `step`; before the first step (when the
   load template is built) there is no state at all, so every `--load` fails.
2. `load_state_dict()` gives all parameters *one shared* `step` tensor. torch's Adam increments
   `step` in place once per parameter, so after a resume the step count races ahead and the
   bias correction differs: a resumed run silently trains differently.
3. Loading the parameter state copies the template's pre-load `step` back over the loaded one,
   and copies into fp32 main params that are leaves requiring grad (an in-place error).
4. A `--dist-ckpt-optim-fully-reshardable` checkpoint cannot be loaded at all:
   `load_parameter_state_from_fully_reshardable` leaves `step` out of the tensors it hands to
   `_set_main_param_and_optimizer_states`, which looks up every state key of the optimizer and
   raises `KeyError: 'step'` (0.19.2, no upstream fix as of 0.19.x).

The fix, at the level of the optimizer state: create torch Adam's state the way its first step
would (zeros, step 0) before megatron reads it; give each parameter its own `step` after a load;
and leave `step` to the param groups whenever parameter state is loaded (whether or not the
loaded tensors name it), copying under no_grad.
Targets megatron-core 0.15.x - 0.19.x installs without Transformer Engine and apex (CPU, bare
GPU); with TE/apex FusedAdam keeps `step` in the param groups and none of this applies.
"""

import functools

import torch

from megatron.core.optimizer import distrib_optimizer

from megatron_patches.registry import Patch, register

# torch's own Adam classes: megatron's optimizer without TE/apex (also read by
# plain-optimizer-save-before-first-step).
TORCH_ADAM = (torch.optim.Adam, torch.optim.AdamW)


def _uses_torch_adam(optimizer) -> bool:
    return isinstance(getattr(optimizer, "optimizer", None), TORCH_ADAM)


def create_adam_state(adam: torch.optim.Optimizer) -> None:
    """Creates the state torch's Adam creates at its first step, for parameters that lack it
    (also create_first_step_state's)."""
    for group in adam.param_groups:
        for param in group["params"]:
            state = adam.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(param)


def create_first_step_state(optimizer) -> None:
    """For a megatron optimizer (Float16/FP32Optimizer), the state its inner optimizer's first
    step makes, for parameters that lack it: torch Adam's own (its step too, which megatron's
    init_state_fn leaves out), else what megatron's init_state_fn makes (nothing without one:
    SGD). Used before saves and as load templates by the plain optimizer's patches."""
    inner = optimizer.optimizer
    if isinstance(inner, TORCH_ADAM):
        create_adam_state(inner)
    elif getattr(optimizer, "init_state_fn", None) is not None:
        optimizer.init_state_fn(inner, optimizer.config)


def _unshare_steps(adam: torch.optim.Optimizer) -> None:
    for state in adam.state.values():
        if "step" in state:
            state["step"] = state["step"].detach().clone()


def _apply():
    cls = distrib_optimizer.DistributedOptimizer
    state_dict, load_state_dict = cls.state_dict, cls.load_state_dict
    set_states = cls._set_main_param_and_optimizer_states

    @functools.wraps(state_dict)
    def state_dict_with_adam_state(self):
        if _uses_torch_adam(self):
            create_adam_state(self.optimizer)
        return state_dict(self)

    @functools.wraps(load_state_dict)
    def load_state_dict_unshared(self, state_dict_):
        load_state_dict(self, state_dict_)
        if _uses_torch_adam(self):
            _unshare_steps(self.optimizer)

    @functools.wraps(set_states)
    def set_states_keeping_step(self, model_param, tensors):
        if _uses_torch_adam(self):
            # `step` comes from the param groups (load_state_dict): a value here is the
            # template's (dp_reshardable), and fully_reshardable passes none at all.
            tensors = {**tensors, "step": None}
        with torch.no_grad():
            set_states(self, model_param, tensors)

    cls.state_dict = state_dict_with_adam_state
    cls.load_state_dict = load_state_dict_unshared
    cls._set_main_param_and_optimizer_states = set_states_keeping_step


def _not_needed_because(context):
    if distrib_optimizer.HAVE_APEX_OR_TE:
        return "Transformer Engine / apex present: FusedAdam keeps step in the param groups"
    return None


PATCH = register(Patch(
    name="distopt-torch-adam-resume",
    upstream="megatron-core distrib_optimizer.py without TE/apex (shared Adam step on load)",
    versions=">=0.15,<0.20",
    summary="torch Adam state created before use, one step tensor per param after load",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
