"""Megatron-FSDP with --fp16: an fsdp_dtensor checkpoint keeps the loss scaler's state, so a
resume goes on with the scale it stopped at instead of starting over from --initial-loss-scale.

Local fix (megatron-core 0.19.2, read and tested there): the distributed optimizer's fsdp_dtensor
state dict (`sharded_param_state_fsdp_dtensor`) holds the parameter state and the groups only;
megatron's other formats save the grad scaler beside them (`state_dict()`'s 'grad_scaler') and
load it back. A resumed fp16 run therefore restarts from the initial scale (2^32 by default),
skips steps until the scale is low enough again, and trains on other iterations than the run
that saved, without a word. The scaler's state is saved under `grad_scaler` in the optimizer's
fsdp_dtensor state dict, asked for at a load only where the checkpoint holds it (one saved
without this patch loads as before, from the initial scale), and handed to the scaler after
megatron's load.

Needed while megatron's fsdp_dtensor optimizer state dict has no grad scaler (judged from
`sharded_param_state_fsdp_dtensor`'s source).
"""

from __future__ import annotations

import functools
import inspect

from megatron_patches.registry import Patch, PatchContext, register, unwrapped, wrapped_by
from moe_launcher.checkpoint_files import reads as checkpoint_reads

NAME = "fsdp-dtensor-loss-scale"
KEY = "grad_scaler"
# What megatron's fsdp_dtensor optimizer state dict holds, and the checkpoint keys under it
_FSDP_DTENSOR_STATE = "param_to_group_meta"
_SAVED_PREFIX = f"optimizer.{KEY}."


def _distributed_optimizer():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DistributedOptimizer


def _checkpoint_holds_loss_scale() -> bool:
    """Whether the checkpoint this load reads saved the scaler (megatron names it as its own
    fsdp_dtensor load does), from the `.metadata` read the load's checks keep
    (checkpoint_files/reads.py: one read per rank inside checkpoint-load-integrity's scope)."""
    from megatron.training.checkpointing import get_load_checkpoint_path_by_args
    from megatron.training.global_vars import get_args

    try:
        saved = checkpoint_reads.read_metadata(get_load_checkpoint_path_by_args(get_args()))
    except FileNotFoundError:
        return False
    return any(key.startswith(_SAVED_PREFIX) for key in saved.state_dict_metadata)


def _scales_loss(optimizer) -> bool:
    return (optimizer.ddp_config.use_megatron_fsdp
            and getattr(optimizer, "grad_scaler", None) is not None)


def _apply() -> None:
    cls = _distributed_optimizer()
    if wrapped_by(cls.sharded_state_dict, NAME):
        return
    sharded_state_dict, load_state_dict = cls.sharded_state_dict, cls.load_state_dict
    signature = inspect.signature(sharded_state_dict)

    @functools.wraps(sharded_state_dict)
    def sharded_state_dict_with_loss_scale(self, *args, **kwargs):
        state = sharded_state_dict(self, *args, **kwargs)
        is_loading = signature.bind(self, *args, **kwargs).arguments.get("is_loading", False)
        if (_scales_loss(self) and isinstance(state, dict) and _FSDP_DTENSOR_STATE in state
                and (not is_loading or _checkpoint_holds_loss_scale())):
            # At a load the scaler's own state is the template the checkpoint is read into.
            state[KEY] = self.grad_scaler.state_dict()
        return state

    @functools.wraps(load_state_dict)
    def load_state_dict_with_loss_scale(self, state_dict):
        saved = state_dict.pop(KEY, None) if _scales_loss(self) else None
        load_state_dict(self, state_dict)
        if saved is not None:
            self.grad_scaler.load_state_dict(saved)

    sharded_state_dict_with_loss_scale.__wrapped_by__ = NAME
    cls.sharded_state_dict = sharded_state_dict_with_loss_scale
    cls.load_state_dict = load_state_dict_with_loss_scale


def _not_needed_because(context: PatchContext) -> str | None:
    source = inspect.getsource(unwrapped(_distributed_optimizer().sharded_param_state_fsdp_dtensor))
    if KEY in source:
        return "megatron's fsdp_dtensor optimizer state dict holds the grad scaler"
    return None


register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 DistributedOptimizer.sharded_param_state_fsdp_dtensor "
             "saves no grad scaler)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="Megatron-FSDP --fp16: fsdp_dtensor checkpoints keep the loss scaler's state (scale, "
            "growth and hysteresis trackers) and a resume goes on with it, instead of "
            "restarting from --initial-loss-scale",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
