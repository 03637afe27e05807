"""Megatron-FSDP `optim_grads` / `optim_grads_params`: a gradient buffer whose data-parallel group
has one rank is scaled once per step, not once per micro-batch.

Upstream: NVIDIA/Megatron-LM#6660 (closed), fixed by PR #6773 after the 0.19 branch. Targets
megatron-core 0.19.x (read and tested on 0.19.2).

These strategies reduce gradients after every backward pass. A buffer whose reduction group has
one rank is not sharded (`is_data_distributed` needs a group wider than one rank): it is the
persistent buffer the micro-batches accumulate into, and every reduction over its one rank
scales it in place by the gradient scaling factor (1/DP; megatron's mul_ before a SUM, or
NCCL's PREMUL_SUM writing onto its input). After k micro-batches micro-batch i carries
(1/DP)^(k-i+1) instead of 1/DP. Such groups are the experts' when EP x ETP spans the
data-parallel ranks (expert-DP 1, e.g. EP2 on 2 ranks, or olmoe_1b_7b_fsdp: DP8, EP4 x ETP2,
32 micro-batches), so the expert gradients keep mostly the last micro-batch's. At DP 1 the
factor is 1 and nothing is lost.

The fix: after each backward such a buffer is reduced without a scaling factor (a SUM over one
rank: an identity), and its factor is applied once, in finish_grad_sync, before the gradients
are handed to the optimizer. Left to megatron: buffers of wider groups, `optim` and `no_shard`
(reduced once per step), per-token loss (no factor), --ddp-average-in-collective (AVG), hybrid
FSDP (its helper buffers), and --megatron-fsdp-grad-comm-dtype other than the buffer's dtype,
where 0.19.2 adds a one-rank buffer's reduced copy back onto it (not fixed here, unverified).

Needed unless Megatron-FSDP decides per parameter whether to reduce after every backward
(`MegatronFSDP._reduces_grad_every_backward`, PR #6773's fix, which skips one-rank groups).
"""

from __future__ import annotations

import functools

from megatron_patches.registry import Patch, PatchContext, register, wrapped_by

NAME = "fsdp-one-rank-grad-scaling"
REDUCED_EVERY_BACKWARD = ("optim_grads", "optim_grads_params")


def _megatron_fsdp():
    from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP

    return MegatronFSDP


def _not_needed_because(context: PatchContext) -> str | None:
    try:
        cls = _megatron_fsdp()
    except ImportError:
        return "this megatron-core has no Megatron-FSDP"
    if hasattr(cls, "_reduces_grad_every_backward"):
        return "Megatron-FSDP reduces one-rank gradient groups once per step"
    return None


def _rescaled_every_backward(fsdp) -> list:
    """The gradient buffers megatron would scale in place after every backward pass."""
    config = fsdp.ddp_config
    if (fsdp.data_parallel_sharding_strategy not in REDUCED_EVERY_BACKWARD
            or config.outer_dp_sharding_strategy != "no_shard" or config.average_in_collective):
        return []
    comm_dtype = fsdp.mp_policy.grad_comm_dtype
    buffers = [group.main_grad_buffer for group in fsdp.param_and_grad_buffer.parameter_groups]
    return [gbuf for gbuf in buffers
            if gbuf is not None and not gbuf.is_data_distributed
            and gbuf.data_parallel_group.size() == 1
            and gbuf.gradient_scaling_factor is not None
            and comm_dtype in (None, gbuf.dtype)]


def _apply() -> None:
    cls = _megatron_fsdp()
    if wrapped_by(cls.__init__, NAME):
        return
    init, attach = cls.__init__, cls.attach_grad_to_optimizer_state

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._once_per_step_scaling = [(gbuf, gbuf.gradient_scaling_factor)
                                       for gbuf in _rescaled_every_backward(self)]
        for gbuf, _ in self._once_per_step_scaling:
            gbuf.gradient_scaling_factor = None

    @functools.wraps(attach)
    def attach_grad_to_optimizer_state(self):
        # finish_grad_sync calls this once per step, after the reductions have completed.
        for gbuf, factor in getattr(self, "_once_per_step_scaling", ()):
            gbuf.data.mul_(factor)
        return attach(self)

    __init__.__wrapped_by__ = NAME
    cls.__init__ = __init__
    cls.attach_grad_to_optimizer_state = attach_grad_to_optimizer_state


register(Patch(
    name=NAME,
    upstream="Megatron-LM #6660 (fixed by PR #6773 after 0.19)",
    versions=">=0.19,<0.20",
    summary="Megatron-FSDP optim_grads(_params): one-rank gradient groups (expert-DP 1) are "
            "scaled by their factor once per step in finish_grad_sync, not after every backward",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
