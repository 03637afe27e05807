"""Megatron-FSDP fsdp_dtensor checkpoints: every rank offers the same optimizer-state keys.

Upstream: NVIDIA/Megatron-LM#4910 (open; PR #3510 fixed the same thing for `fully_shard()` only,
PR #6573 would turn the hang into an error). megatron-core 0.16 - 0.19.

Megatron-FSDP shards each parameter group's flat buffer across the data-parallel ranks, so a
small parameter (a norm, the router) often lies wholly in one rank's shard and is empty on the
others. Such a parameter gets no gradient there (param_and_grad_buffer.py sets `grad = None`
for an empty local shard), so the optimizer (torch Adam and TE FusedAdam alike) never creates
its state on that rank, and `DistributedOptimizer.sharded_param_state_fsdp_dtensor` lists only
the parameters with state. `preprocess_state_dict_for_uneven_dtensor` then runs one
`all_gather_object` per DTensor key over the key's shard group, in sorted key order: ranks with
different key lists pair different tensors' collectives, and the save (and the load, which
builds the same dict) hangs, or on one shared group silently exchanges the wrong shapes.
(fsdp-dtensor-batched-chunk-metadata, which replaces those gathers, counts each group's shards
first: without this patch the ranks then stop with an error instead.)

The fix: the optimizer's fsdp_dtensor state dict gets, for each parameter without state on this
rank, the entries the other ranks hold for a parameter: a DTensor like the parameter with its
(empty) local shard, so nothing is written or read for it, for each DTensor entry, and the
world's largest value for each scalar tensor entry (Adam's `step`, the same on every rank that
steps). The optimizer itself is not changed. Whether it is needed is decided from behaviour: an
optimizer holding one parameter without state is asked for its fsdp_dtensor state dict.
"""

from __future__ import annotations

import functools
import types

import torch

from megatron_patches.registry import Patch, PatchContext, register, wrapped_by

NAME = "fsdp-dtensor-optimizer-keys"


def _distrib_optimizer():
    from megatron.core.optimizer import distrib_optimizer

    return distrib_optimizer.DistributedOptimizer


def _lists_parameters_without_state(cls) -> bool:
    """Asks megatron's own method for the fsdp_dtensor state of an optimizer holding one
    parameter that has no state yet."""
    param = torch.nn.Parameter(torch.zeros(0))
    optimizer = object.__new__(cls)
    optimizer.__dict__.update(
        ddp_config=types.SimpleNamespace(use_megatron_fsdp=True),
        optimizer=torch.optim.Adam([param]),
        param_to_name={param: "probe"},
    )
    return "probe" in cls.sharded_param_state_fsdp_dtensor(optimizer)["state"]


def _not_needed_because(context: PatchContext) -> str | None:
    cls = _distrib_optimizer()
    if not hasattr(cls, "sharded_param_state_fsdp_dtensor"):
        return "this megatron-core has no fsdp_dtensor optimizer state"
    if _lists_parameters_without_state(cls):
        return "the fsdp_dtensor optimizer state lists parameters that have no state"
    return None


def _entry_kinds(states) -> list[str]:
    """'name:dtensor' / 'name:scalar' for each tensor entry of this rank's optimizer states."""
    from torch.distributed.tensor import DTensor

    kinds = set()
    for state in states:
        for key, value in state.items():
            if isinstance(value, DTensor):
                kinds.add(f"{key}:dtensor")
            elif isinstance(value, torch.Tensor) and value.numel() == 1:
                kinds.add(f"{key}:scalar")
    return sorted(kinds)


def _empty_like(param):
    """A DTensor like `param` holding this rank's (empty) local shard. Not torch.zeros_like:
    DTensor would size the local shard from the global shape by even chunks, while
    Megatron-FSDP's shards are uneven."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(torch.zeros_like(param.to_local()), param.device_mesh,
                              param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _fill_missing_states(optimizer, state_dict: dict) -> None:
    from moe_launcher.runtime import collectives

    packed = state_dict["state"]
    kinds = collectives.union(_entry_kinds(packed.values()))
    scalars = [kind.split(":")[0] for kind in kinds if kind.endswith(":scalar")]
    largest = collectives.reduce_numbers(
        [max((float(s[key]) for s in packed.values() if key in s), default=float("-inf"))
         for key in scalars], op="max")
    scalar_values = dict(zip(scalars, largest))
    # In parameter order, the same on every rank: megatron's SWiGLU split runs a collective per
    # entry in dict order (make_fsdp_dtensor's run_check).
    ordered = {}
    for group in optimizer.optimizer.param_groups:
        for param in group["params"]:
            name = optimizer._param_name(param)
            if name in packed:
                ordered[name] = packed.pop(name)
                continue
            state = {}
            for kind in kinds:
                key, what = kind.split(":")
                if what == "dtensor":
                    state[key] = _empty_like(param)
                else:
                    state[key] = torch.tensor(scalar_values[key])
            ordered[name] = state
    ordered.update(packed)
    state_dict["state"] = ordered


def _apply() -> None:
    cls = _distrib_optimizer()
    original = cls.sharded_param_state_fsdp_dtensor
    if wrapped_by(original, NAME):
        return

    @functools.wraps(original)
    def sharded_param_state_fsdp_dtensor(self, is_loading: bool = False):
        state_dict = original(self, is_loading)
        _fill_missing_states(self, state_dict)
        return state_dict

    sharded_param_state_fsdp_dtensor.__wrapped_by__ = NAME
    cls.sharded_param_state_fsdp_dtensor = sharded_param_state_fsdp_dtensor


register(Patch(
    name=NAME,
    upstream="NVIDIA/Megatron-LM#4910 (open; PR #3510 fixed fully_shard() only)",
    versions=">=0.16,<0.20",
    summary="fsdp_dtensor optimizer state lists every parameter on every rank (no save/load hang)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
