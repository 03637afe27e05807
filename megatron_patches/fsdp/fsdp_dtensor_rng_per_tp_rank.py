"""An fsdp_dtensor resume restores each tensor-parallel rank's own RNG state, not TP rank 0's.

Upstream: none found; megatron-core 0.19.2 `megatron/training/checkpointing.py`
(`_load_base_checkpoint`, its fsdp_dtensor branch). Targets megatron-core 0.19.x.

`get_rng_state` keys an fsdp_dtensor checkpoint's RNG states by "(PP rank, TP rank)", read from
the groups its caller passes. The save passes the model's groups. The fsdp_dtensor load builds
its template with the groups `load_checkpoint` was given, which pretrain leaves None (the torch_dist
branch falls back to megatron's parallel-state groups; this one does not), and a None group is
rank 0. So every TP rank loads the "(PP 0, TP 0)" entry: after a resume all TP ranks continue TP
rank 0's 'model-parallel-rng' stream (dropout inside tensor-parallel regions then draws the same
mask on every TP shard) and pipeline stages their first stage's. Nothing fails unless the saved
entries differ in shape (the expert-rng-per-ep-rank streams do, which is how this was found).

The fix, at megatron's call site (the module attribute `get_rng_state`): called for fsdp_dtensor
with neither group, it uses megatron's tensor- and pipeline-parallel groups, as the torch_dist
branch does; every other call passes through unchanged.
"""

from __future__ import annotations

import functools

from megatron_patches.registry import Patch, PatchContext, register, unwrapped, wrapped_by

NAME = "fsdp-dtensor-rng-per-tp-rank"


def _with_model_groups(get_rng_state):
    @functools.wraps(get_rng_state)
    def get_rng_state_of_this_rank(ckpt_format, tp_group=None, pp_group=None, *args, **kwargs):
        if ckpt_format == "fsdp_dtensor" and tp_group is None and pp_group is None:
            from megatron.core import parallel_state

            tp_group = parallel_state.get_tensor_model_parallel_group()
            pp_group = parallel_state.get_pipeline_model_parallel_group()
        return get_rng_state(ckpt_format, tp_group, pp_group, *args, **kwargs)

    get_rng_state_of_this_rank.__wrapped_by__ = NAME
    return get_rng_state_of_this_rank


def _apply() -> None:
    from megatron.training import checkpointing

    if wrapped_by(checkpointing.get_rng_state, NAME):
        return
    checkpointing.get_rng_state = _with_model_groups(checkpointing.get_rng_state)


def _not_needed_because(context: PatchContext) -> str | None:
    """A load passing no groups can only be judged in a multi-rank resume; this reads whether
    megatron's get_rng_state keys fsdp_dtensor states by rank at all (the wrapper changes
    nothing where the caller passes its groups)."""
    from megatron.training import checkpointing

    if "fsdp_dtensor" not in unwrapped(checkpointing.get_rng_state).__code__.co_consts:
        return "megatron's get_rng_state does not key fsdp_dtensor RNG states by rank"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="megatron-core 0.19.2 checkpointing._load_base_checkpoint (fsdp_dtensor RNG template "
             "built without the model's groups)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="an fsdp_dtensor resume restores each TP/PP rank's own RNG state (not TP rank 0's)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
