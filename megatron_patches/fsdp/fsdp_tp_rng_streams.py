"""Megatron-FSDP keeps each tensor-parallel rank's own model-parallel RNG streams.

Upstream: none found; megatron-core 0.19.2 `megatron/core/distributed/fsdp/mcore_fsdp_adapter.py`
(`FullyShardedDataParallel.sync_rng_states_across_tp_group`, called at the end of `__init__`).
Targets megatron-core 0.19.x.

megatron seeds the RNG tracker per rank (`model_parallel_cuda_manual_seed`): its
'model-parallel-rng' stream differs between TP ranks by design (seed + 2718 + TP rank; dropout
inside tensor- and sequence-parallel regions must draw a different mask on each shard), its
expert stream between EP/ETP ranks. When Megatron-FSDP wraps the model, its adapter broadcasts TP
rank 0's whole RNG state dict over the TP group and loads it on every TP rank, tracker states
included. From then on every TP rank draws TP rank 0's masks: the attention dropout of its heads,
and under sequence parallelism the hidden dropout of its sequence chunk, repeat TP rank 0's;
nothing fails. (The same broadcast of the Python, NumPy, CPU and default CUDA states is kept: those
are meant to agree over TP, and a data loader may have moved TP rank 0's.)

The fix, at megatron's call site (the adapter's method): the broadcast runs as before, then this
rank's own tracker states, as megatron seeded them, are put back.
"""

from __future__ import annotations

import functools

from megatron_patches.registry import Patch, PatchContext, register, wrapped_by

NAME = "fsdp-tp-rng-streams"


def _keeping_own_tracker_states(sync_rng_states_across_tp_group):
    @functools.wraps(sync_rng_states_across_tp_group)
    def sync_keeping_own_tracker_states(self, *args, **kwargs):
        from megatron.core import tensor_parallel

        tracker = tensor_parallel.get_cuda_rng_tracker()
        own = {name: state.clone() for name, state in tracker.get_states().items()}
        result = sync_rng_states_across_tp_group(self, *args, **kwargs)
        tracker.set_states(own)
        return result

    sync_keeping_own_tracker_states.__wrapped_by__ = NAME
    return sync_keeping_own_tracker_states


def _adapter():
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    return mcore_fsdp_adapter


def _apply() -> None:
    adapter = _adapter().FullyShardedDataParallel
    if wrapped_by(adapter.sync_rng_states_across_tp_group, NAME):
        return
    adapter.sync_rng_states_across_tp_group = _keeping_own_tracker_states(
        adapter.sync_rng_states_across_tp_group)


def _not_needed_because(context: PatchContext) -> str | None:
    """Reads whether the adapter broadcasts the RNG tracker's states over TP at all."""
    adapter = _adapter()
    if not hasattr(adapter.FullyShardedDataParallel, "sync_rng_states_across_tp_group"):
        return "Megatron-FSDP's adapter does not sync RNG states across the TP group"
    constants = adapter._get_rng_state_dict.__code__.co_consts  # the dict's keys: one tuple
    names = {c for const in constants for c in (const if isinstance(const, tuple) else (const,))}
    if "rng_tracker_states" not in names:
        return "Megatron-FSDP's TP sync leaves the RNG tracker's states alone"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="megatron-core 0.19.2 mcore_fsdp_adapter.FullyShardedDataParallel."
             "sync_rng_states_across_tp_group (TP rank 0's tracker states on every TP rank)",
    versions=">=0.19,<0.20",
    summary="Megatron-FSDP with TP > 1 keeps each TP rank's own model-parallel and expert RNG "
            "streams (megatron's adapter gave every TP rank TP rank 0's: the same dropout masks "
            "on every TP shard)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
