"""fp32 Megatron-FSDP can save and load fsdp_dtensor checkpoints of a SwiGLU model.

Upstream: local (none found); megatron-core 0.19.2
`megatron/core/transformer/fsdp_dtensor_checkpoint.py` (`handle_swiglu_in_state_dict`), called
from `megatron/training/checkpointing.py` (`preprocess_fsdp_dtensor_state_dict`, on every
fsdp_dtensor save and load). Targets megatron-core 0.19.x.

`preprocess_fsdp_dtensor_state_dict` gets the unwrapped model, `MegatronFSDP`, and the model
state dict `MegatronFSDP.state_dict()` wrote. To split each SwiGLU `linear_fc1` into `_w`/`_v`,
megatron looks the parameter up as `model.get_parameter("module." + key)`: it assumes a module
between `MegatronFSDP` and the model whose state dict leaves out its own `module.` level. That is
`Float16Module`, which megatron builds only for --bf16/--fp16 (its `state_dict` hands the inner
model's keys up unchanged). So under bf16 the key `module.decoder...linear_fc1.weight` names
the parameter `module.module.decoder...` (MegatronFSDP > Float16Module > GPTModel), and the
lookup finds it. In fp32 there is no Float16Module: the key already is the parameter's name
(MegatronFSDP > GPTModel), megatron asks for `module.module.decoder...`, and every fp32
fsdp_dtensor save (and load) fails with "GPTModel has no attribute `module`". The optimizer
half of the same function names its parameters after the keys with one `module.` removed, which
is right in both precisions; only the model keys' lookup is wrong.

The fix, at megatron's call site (the module attribute
`megatron.training.checkpointing.handle_swiglu_in_state_dict`): a model state-dict key that
megatron's lookup cannot resolve but that is itself the name of one of the model's parameters
(fp32) is handed to megatron one `module.` level shorter, the form its lookup resolves to that
same parameter, and megatron's result is renamed back (its `_w`/`_v` keys too). The keys saved
are then the same in fp32 and bf16. A state dict megatron already resolves (bf16) passes through
unchanged.
"""

from __future__ import annotations

import functools

from megatron_patches.registry import Patch, PatchContext, register, unwrapped, wrapped_by

NAME = "fsdp-dtensor-fp32-swiglu-keys"
_PREFIX = "module."
_SPLIT_SUFFIXES = ("_w", "_v")  # the keys megatron makes of one SwiGLU fc1 key


def _shortened_keys(model, model_state_dict) -> dict[str, str]:
    """{key: the key megatron's `get_parameter("module." + key)` resolves} for the keys it does
    not resolve but that name one of `model`'s parameters themselves."""
    names = {name for name, _ in model.named_parameters()}
    return {key: key[len(_PREFIX):] for key in model_state_dict
            if key.startswith(_PREFIX) and key in names and _PREFIX + key not in names}


def _renamed_back(key: str, original: dict[str, str]) -> str:
    if key in original:
        return original[key]
    stem, suffix = key[:-2], key[-2:]
    if suffix in _SPLIT_SUFFIXES and stem in original:
        return original[stem] + suffix
    return key


def _with_parameter_keys(handle_swiglu_in_state_dict):
    @functools.wraps(handle_swiglu_in_state_dict)
    def handle_swiglu_in_state_dict_by_parameter_name(model, model_state_dict,
                                                      optimizer_state_dict, *args, **kwargs):
        shortened = _shortened_keys(model, model_state_dict)
        if not shortened:
            return handle_swiglu_in_state_dict(model, model_state_dict, optimizer_state_dict,
                                               *args, **kwargs)
        original = {short: key for key, short in shortened.items()}
        model_sd, optimizer_sd = handle_swiglu_in_state_dict(
            model, {shortened.get(k, k): v for k, v in model_state_dict.items()},
            optimizer_state_dict, *args, **kwargs)
        return {_renamed_back(k, original): v for k, v in model_sd.items()}, optimizer_sd

    handle_swiglu_in_state_dict_by_parameter_name.__wrapped_by__ = NAME
    return handle_swiglu_in_state_dict_by_parameter_name


def _apply() -> None:
    from megatron.training import checkpointing

    if wrapped_by(checkpointing.handle_swiglu_in_state_dict, NAME):
        return
    checkpointing.handle_swiglu_in_state_dict = _with_parameter_keys(
        checkpointing.handle_swiglu_in_state_dict)


class _LookupSeen(Exception):
    pass


def _not_needed_because(context: PatchContext) -> str | None:
    """Hands megatron's own handle_swiglu_in_state_dict an fp32-shaped model (a wrapper whose
    `module` is the model, no Float16Module between) and the key its state dict has for the
    SwiGLU fc1 weight, and sees whether the name megatron looks up is that parameter's."""
    import torch
    from megatron.training import checkpointing

    class Wrapper(torch.nn.Module):  # MegatronFSDP's place
        config = None  # what get_attr_wrapped_model finds first: no MoE config

        def __init__(self):
            super().__init__()
            self.module = torch.nn.Module()
            self.module.decoder = torch.nn.Module()
            self.module.decoder.mlp = torch.nn.Module()
            self.module.decoder.mlp.linear_fc1 = torch.nn.Linear(2, 4, bias=False)
            self.asked = []

        def get_parameter(self, target):
            self.asked.append(target)
            raise _LookupSeen

    model = Wrapper()
    key = "module.decoder.mlp.linear_fc1.weight"
    try:
        unwrapped(checkpointing.handle_swiglu_in_state_dict)(
            model, {key: model.get_submodule("module.decoder.mlp.linear_fc1").weight}, None)
    except _LookupSeen:
        pass
    except Exception as e:  # megatron changed its function: the wrapper may not fit it
        return f"megatron's handle_swiglu_in_state_dict no longer takes this form ({e!r})"
    if not model.asked:
        return "megatron's handle_swiglu_in_state_dict does not look SwiGLU parameters up by name"
    if model.asked[0] in dict(torch.nn.Module.named_parameters(model)):
        return "megatron's handle_swiglu_in_state_dict finds an fp32 model's SwiGLU parameters"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 fsdp_dtensor_checkpoint.handle_swiglu_in_state_dict "
             "looks SwiGLU weights up one `module.` level deeper than an fp32 model has)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="fp32 Megatron-FSDP saves and loads fsdp_dtensor checkpoints of SwiGLU models "
            "(megatron looks fc1 up as module.<key>, a level only bf16/fp16's Float16Module has)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
