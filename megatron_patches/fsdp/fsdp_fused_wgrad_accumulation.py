"""Megatron-FSDP with Transformer Engine's fused weight-gradient accumulation: TE adds each
micro-batch's weight gradients to a persistent (unsharded) gradient buffer instead of
overwriting it.

Upstream: Megatron-LM PR #6357 (merged after the 0.19 branch: "fix TE wgrad accumulate fusion for
ZeRO-1 and no_shard, caused by ... `param.overwrite_main_grad = True` for all sharding
strategies"). Targets megatron-core 0.19.x (read and tested on 0.19.2).

With `--gradient-accumulation-fusion` (megatron's default where TE is installed) TE writes a
weight gradient into `param.main_grad` itself, adding to it unless the parameter says
`overwrite_main_grad`. Megatron-FSDP 0.19.2 sets that flag on every parameter it gathers
(`MegatronFSDP.all_gather_and_wait_parameters_ready`) and on every expert weight of TE's fused
grouped MLP (`TEGroupedMLP._ensure_main_grad`). Where the parameter's gradient buffer is
sharded, `main_grad` is a fresh communication bucket each micro-batch, reduce-scattered after
the backward: overwriting it is right. Where it is not (`optim`, and any group of one rank, e.g.
the experts at expert-DP 1 under every strategy), `main_grad` is the persistent buffer the
micro-batches of a step add up in: overwriting keeps only the last micro-batch's gradients, a
silently smaller effective batch.

The fix, read from the buffer megatron built rather than from the strategy's name: right after
megatron sets the flag, each parameter's `overwrite_main_grad` is whether its gradient buffer
(`param._gbuf`) is data-distributed. Fused accumulation needs TE on a GPU; on CPU the test reads
the flags megatron leaves on the gathered parameters (tests/megatron_patches/fsdp/
test_fsdp_microbatch_grads_cpu.py, whose `gpu` test compares the gradients under fused
accumulation).

Needed where Megatron-FSDP's gather still sets the flag unconditionally.
"""

from __future__ import annotations

import functools
import inspect

from megatron_patches.registry import Patch, PatchContext, register, wrapped_by

NAME = "fsdp-fused-wgrad-accumulation"
_UNCONDITIONAL = "param.overwrite_main_grad = True"


def _megatron_fsdp():
    from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP

    return MegatronFSDP


def _not_needed_because(context: PatchContext) -> str | None:
    try:
        gather = _megatron_fsdp().all_gather_and_wait_parameters_ready
    except ImportError:
        return "this megatron-core has no Megatron-FSDP"
    if _UNCONDITIONAL not in inspect.getsource(gather):
        return "Megatron-FSDP no longer tells TE to overwrite every gathered parameter's main_grad"
    return None


def overwrite_only_sharded_grads(params) -> None:
    """Each Megatron-FSDP parameter's `overwrite_main_grad`: whether its gradient buffer is
    sharded (a fresh bucket per micro-batch), not the persistent buffer micro-batches add up in."""
    for param in params:
        buffer = getattr(param, "_gbuf", None)
        if buffer is not None and hasattr(param, "overwrite_main_grad"):
            param.overwrite_main_grad = bool(buffer.is_data_distributed)


def _wrap_gather(gather):
    @functools.wraps(gather)
    def all_gather_and_wait_parameters_ready(self, params, *args, **kwargs):
        params = list(params)
        result = gather(self, params, *args, **kwargs)
        overwrite_only_sharded_grads(params)
        return result

    all_gather_and_wait_parameters_ready.__wrapped_by__ = NAME
    return all_gather_and_wait_parameters_ready


def _wrap_ensure_main_grad(ensure_main_grad):
    @functools.wraps(ensure_main_grad)
    def _ensure_main_grad(linear_module):
        ensure_main_grad(linear_module)
        overwrite_only_sharded_grads(linear_module.parameters(recurse=False))

    _ensure_main_grad.__wrapped_by__ = NAME
    return staticmethod(_ensure_main_grad)


def _apply() -> None:
    cls = _megatron_fsdp()
    if not wrapped_by(cls.all_gather_and_wait_parameters_ready, NAME):
        cls.all_gather_and_wait_parameters_ready = _wrap_gather(
            cls.all_gather_and_wait_parameters_ready)
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    ensure = getattr(TEGroupedMLP, "_ensure_main_grad", None)
    if ensure is not None and not wrapped_by(ensure, NAME):
        TEGroupedMLP._ensure_main_grad = _wrap_ensure_main_grad(ensure)


register(Patch(
    name=NAME,
    upstream="Megatron-LM PR #6357 (after 0.19: TE wgrad accumulate fusion for ZeRO-1 and "
             "no_shard)",
    versions=">=0.19,<0.20",
    summary="Megatron-FSDP tells Transformer Engine to overwrite main_grad only where the "
            "gradient buffer is sharded; a persistent (unsharded) buffer accumulates every "
            "micro-batch's weight gradients",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
