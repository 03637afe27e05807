"""Every expert-parallel rank resumes with its own expert RNG state, not EP rank 0's.

Upstream: Megatron-LM PR #6858 (merged after 0.19; megatron-core 0.19.2
`megatron/training/checkpointing.py`). Targets megatron-core 0.19.x.

megatron keeps one CUDA RNG tracker stream for the expert region, 'expert-parallel-rng', seeded
per expert rank (seed + 1024 + 100 * EP rank + ETP rank). `get_rng_state` saves the RNG state
as one object per (PP, TP) rank, written by data-parallel rank 0 of that slice, and
`load_checkpoint` restores it on every data-parallel rank. Expert-parallel ranks are
data-parallel ranks of the dense grid, so after a resume every EP rank continues EP rank 0's
expert stream: the resumed run is not the run that was saved wherever the expert region draws
random numbers (--moe-router-force-load-balancing, Transformer Engine expert layers), and the
EP ranks draw identical "random" numbers from then on.

The fix, on megatron's own call sites (module attributes of megatron.training.checkpointing):

* `get_rng_state` adds to each saved RNG state the expert stream of every (EP, ETP) rank of its
  (PP, TP) slice, gathered over the slice's data-parallel (with CP) group: one small object
  gather per save (and per load, where the same function builds the load template);
* after `_load_base_checkpoint` reads a checkpoint, each rank puts its own (EP, ETP) stream
  into the loaded tracker states, which megatron then restores as before.

A checkpoint saved without these streams, or with another expert layout (no stream for this
rank's (EP, ETP) rank), keeps megatron's behaviour; rank 0 says so once.
"""

from __future__ import annotations

import functools

from moe_launcher.runtime import collectives
from megatron_patches.registry import Patch, PatchContext, register, unwrapped, wrapped_by

NAME = "expert-rng-per-ep-rank"
STREAMS = "expert_rng_states_by_ep_etp_rank"  # the entry this patch adds to the saved RNG state


def _checkpointing():
    from megatron.training import checkpointing

    return checkpointing


def _expert_rank() -> tuple[int, int]:
    from megatron.core import parallel_state

    return (parallel_state.get_expert_model_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_rank())


def _expert_tracker_name() -> str:
    from megatron.core import tensor_parallel

    return tensor_parallel.get_expert_parallel_rng_tracker_name()


def _rng_state_dicts(rng_state) -> list[dict]:
    """The per-rank RNG state dicts inside what get_rng_state returns or a checkpoint holds:
    a list (torch, torch_dist once loaded), a ShardedObject of a list (torch_dist template) or
    a dict of lists by "(pp, tp)" (fsdp_dtensor)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if isinstance(rng_state, ShardedObject):
        rng_state = rng_state.data
    if isinstance(rng_state, dict) and "rng_tracker_states" not in rng_state:
        rng_state = [state for states in rng_state.values() for state in states]
    if isinstance(rng_state, dict):
        rng_state = [rng_state]
    return [state for state in rng_state or [] if isinstance(state, dict)]


def _slice_expert_streams(dp_cp_group) -> dict:
    """(EP rank, ETP rank) -> expert RNG stream, for every rank of this (PP, TP) slice."""
    from megatron.core import tensor_parallel

    own = tensor_parallel.get_cuda_rng_tracker().get_states().get(_expert_tracker_name())
    everyone = collectives.gather_objects((_expert_rank(), own), group=dp_cp_group)
    return {rank: stream for rank, stream in everyone if stream is not None}


def _with_expert_streams(get_rng_state):
    @functools.wraps(get_rng_state)
    def get_rng_state_with_expert_streams(*args, **kwargs):
        from megatron.core import parallel_state

        rng_state = get_rng_state(*args, **kwargs)
        dp_cp_group = (kwargs.get("dp_cp_group")
                       or parallel_state.get_data_parallel_group(with_context_parallel=True))
        streams = _slice_expert_streams(dp_cp_group)
        for state in _rng_state_dicts(rng_state):
            state[STREAMS] = streams
        return rng_state

    get_rng_state_with_expert_streams.__wrapped_by__ = NAME
    return get_rng_state_with_expert_streams


def _restore_own_stream(state_dict) -> bool:
    """Puts this rank's expert stream into the loaded tracker states; False where the
    checkpoint has none for this rank."""
    states = _rng_state_dicts(state_dict.get("rng_state"))
    if not states:
        return True  # no RNG state to restore: megatron decides (--no-load-rng, old format)
    found = True
    for state in states:
        stream = state.get(STREAMS, {}).get(_expert_rank())
        trackers = state.get("rng_tracker_states")
        if stream is None or not trackers or _expert_tracker_name() not in trackers:
            found = False
            continue
        state["rng_tracker_states"] = {**trackers, _expert_tracker_name(): stream}
    return found


def _with_own_stream_restored(load_base_checkpoint):
    @functools.wraps(load_base_checkpoint)
    def load_base_checkpoint_with_own_expert_stream(load_dir, args, rank0=False, **kwargs):
        result = load_base_checkpoint(load_dir, args, rank0=rank0, **kwargs)
        state_dict = result[0]
        # rank0=True reads only what every rank shares (args, iteration), not the RNG state,
        # and is not always called on every rank: no collective there.
        if not rank0 and isinstance(state_dict, dict) and "rng_state" in state_dict:
            restored = _restore_own_stream(state_dict)
            if collectives.any_rank(not restored) and collectives.rank() == 0:
                print(f"[megatron_patches] {NAME}: the checkpoint holds no expert RNG stream "
                      "for some expert rank (saved unpatched or with another expert layout); "
                      "those ranks resume with megatron's restored expert RNG state", flush=True)
        return result

    return load_base_checkpoint_with_own_expert_stream


def _apply() -> None:
    checkpointing = _checkpointing()
    if wrapped_by(checkpointing.get_rng_state, NAME):
        return
    checkpointing.get_rng_state = _with_expert_streams(checkpointing.get_rng_state)
    checkpointing._load_base_checkpoint = _with_own_stream_restored(
        checkpointing._load_base_checkpoint)


def _not_needed_because(context: PatchContext) -> str | None:
    """Telling needs two expert ranks, which do not exist when patches are decided; so this
    reads whether megatron's get_rng_state asks for the expert ranks at all."""
    names = unwrapped(_checkpointing().get_rng_state).__code__.co_names
    if any("expert" in name for name in names):
        return "megatron's get_rng_state saves the RNG state per expert rank"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="Megatron-LM PR #6858 (checkpointing.get_rng_state saves RNG per (PP, TP) rank)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="each expert rank's expert RNG stream saved and restored to that rank",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
