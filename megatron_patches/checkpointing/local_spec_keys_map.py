"""The local GPT layer spec's checkpoint key map, as a patch changes it.

megatron's local spec (`get_gpt_layer_local_submodules`) keeps norms in modules of their own and
maps their checkpoint keys onto Transformer Engine's fused ones in `sharded_state_dict_keys_map`.
Patches that correct that map (moe-norm-checkpoint-key, mla-norm-checkpoint-keys) wrap megatron's
builder through `wrap_keys_map`: one wrapper a patch, given the builder's bound arguments and the
map megatron made, returning the map to use.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable

from megatron.core.models.gpt import gpt_layer_specs

from megatron_patches.registry import wrapped_by


def wrap_keys_map(patch_name: str, change: Callable[[dict, dict], dict]) -> None:
    """Wraps megatron's local submodules builder (once for `patch_name`) so that the submodules
    it returns carry `change(bound arguments, megatron's keys map)` as their keys map."""
    build = gpt_layer_specs.get_gpt_layer_local_submodules
    if wrapped_by(build, patch_name):
        return
    signature = inspect.signature(build)

    @functools.wraps(build)
    def local_submodules(*args, **kwargs):
        submodules = build(*args, **kwargs)
        keys_map = submodules.sharded_state_dict_keys_map or {}
        changed = change(signature.bind(*args, **kwargs).arguments, keys_map)
        if changed == keys_map:
            return submodules
        return dataclasses.replace(submodules, sharded_state_dict_keys_map=changed)

    local_submodules.__wrapped_by__ = patch_name
    gpt_layer_specs.get_gpt_layer_local_submodules = local_submodules
