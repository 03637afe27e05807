"""Fully reshardable distributed-optimizer checkpoints: every parameter's state from its own
offset, with any number of gradient buckets (NVIDIA/Megatron-LM#5077, merged after 0.19).

With `--dist-ckpt-optim-fully-reshardable`, `DistributedOptimizer.sharded_param_state_
fully_reshardable` slices each parameter's main param and Adam moments out of the world tensors
`get_parameter_state_dp_zero` gathers. Those tensors hold the buckets back to back with each
bucket's end padding (for DP divisibility, a multiple of 128 elements) stripped, but the slices
use `buffer.param_index_map`, whose offsets still count that padding. With more than one bucket
per buffer (`--ddp-bucket-size`, big models by default) every parameter after the first padded
bucket end is saved from a shifted offset, its tail zero-filled with a warning ("param range
exceeds unpadded buffer"). The save succeeds; a resume loads shifted or zeroed master weights
and moments. One bucket per buffer is unaffected.

The fix, for the duration of that call only: the buffers' `param_index_map` offsets are rebased
to the coalesced world tensors (each bucket moved down by the padding stripped before it), the
same correction #5077 makes inside the function. Loading uses the same function for its
templates and is rebased alike; `load_parameter_state_from_fully_reshardable` slices by the
parameter's own range and is right as it is. Checkpoints written without the fix stay wrong.
Targets megatron-core 0.15.x - 0.19.x (tested on 0.19.2; 0.15.3 has the same code).
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace

import torch

from megatron.core.optimizer import distrib_optimizer

from megatron_patches.registry import Patch, PatchContext, register

UPSTREAM = "NVIDIA/Megatron-LM#5077"


def coalesced_index_map(buffer) -> dict:
    """`buffer.param_index_map` with offsets into the buckets laid back to back without their
    end padding (the layout get_parameter_state_dp_zero gathers)."""
    stripped_before, coalesced_start = [], 0
    for (bucket_start, _), bucket in zip(buffer.bucket_indices, buffer.buckets):
        stripped_before.append(bucket_start - coalesced_start)
        coalesced_start += bucket.numel_unpadded
    return {param: (start - stripped_before[bucket_id], end - stripped_before[bucket_id],
                    bucket_id)
            for param, (start, end, bucket_id) in buffer.param_index_map.items()}


@contextlib.contextmanager
def _coalesced_offsets(buffers):
    padded = [buffer.param_index_map for buffer in buffers]
    try:
        for buffer in buffers:
            buffer.param_index_map = coalesced_index_map(buffer)
        yield
    finally:
        for buffer, index_map in zip(buffers, padded):
            buffer.param_index_map = index_map


def _saves_second_bucket_from_its_offset() -> bool:
    """Runs megatron's sharded_param_state_fully_reshardable on one buffer of two buckets, each
    one 3-element parameter, the first padded to 4: is the second saved from elements 3..5 of
    the coalesced world tensor?"""
    from megatron.core.dist_checkpointing import ShardedTensor

    first, second = torch.zeros(3), torch.zeros(3)
    buffer = SimpleNamespace(
        param_index_map={first: (0, 3, 0), second: (4, 7, 1)}, bucket_indices=[(0, 4), (4, 8)],
        buckets=[SimpleNamespace(numel_unpadded=3), SimpleNamespace(numel_unpadded=3)],
        numel_unpadded=6)
    world = {0: {torch.float32: {"param": torch.arange(6.0), "numel_unpadded": 6}}}
    optimizer = SimpleNamespace(buffers=[buffer], gbuf_ranges=[{torch.float32: [{}, {}]}],
                                get_parameter_state_dp_zero=lambda **_: world)
    model_state = {name: ShardedTensor.from_rank_offsets(name, param, replica_id=0)
                   for name, param in (("first", first), ("second", second))}
    logger, disabled = distrib_optimizer.logger, distrib_optimizer.logger.disabled
    logger.disabled = True  # the buggy slice warns; that is the probe's answer, not news
    try:
        state = distrib_optimizer.DistributedOptimizer.sharded_param_state_fully_reshardable(
            optimizer, model_state, metadata={})
    finally:
        logger.disabled = disabled
    return torch.equal(state[1]["param"].data, torch.tensor([3.0, 4.0, 5.0]))


def _not_needed(context: PatchContext) -> str | None:
    try:
        if _saves_second_bucket_from_its_offset():
            return "megatron-core already saves fully reshardable state from bucket-aware offsets"
    except Exception as error:  # an unknown layout of the function: the wrapper would not fit
        return f"cannot probe sharded_param_state_fully_reshardable ({type(error).__name__}: " \
               f"{error})"
    return None


def _apply() -> None:
    cls = distrib_optimizer.DistributedOptimizer
    megatron_sharded = cls.sharded_param_state_fully_reshardable
    if getattr(megatron_sharded, "_coalesced_offsets", False):
        return

    @functools.wraps(megatron_sharded)
    def sharded_param_state_fully_reshardable(self, *args, **kwargs):
        with _coalesced_offsets(self.buffers):
            return megatron_sharded(self, *args, **kwargs)

    sharded_param_state_fully_reshardable._coalesced_offsets = True
    cls.sharded_param_state_fully_reshardable = sharded_param_state_fully_reshardable


register(Patch(
    name="distopt-reshardable-bucket-offsets",
    upstream=UPSTREAM,
    versions=">=0.15,<0.20",
    summary="megatron.core.optimizer.distrib_optimizer.DistributedOptimizer."
            "sharded_param_state_fully_reshardable slices each parameter's state at offsets "
            "without the bucket-end padding the gathered state lacks",
    not_needed_because=_not_needed,
    apply=_apply,
))
