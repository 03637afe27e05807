"""Router token counts stay fp32 under --bf16/--fp16, so expert-bias updates see exact counts.

Upstream: NVIDIA/Megatron-LM PR #7081 (merged after 0.19; "Preserve exact expert token counts
for expert-bias updates"). Targets megatron-core 0.19.x.

TopKRouter registers its token counters as float32 buffers: `local_tokens_per_expert` (the
per-expert counts of --moe-router-enable-expert-bias, summed over the micro-batches of a
global batch) and, for --moe-router-load-balancing-type global_aux_loss,
`global_tokens_per_expert` and `ga_steps`. Float16Module casts the whole model with
`module.bfloat16()` / `.half()`, buffers included; `TopKRouter._maintain_float32_expert_bias`
then restores `expert_bias` (and the quantile-balancing buffers) to fp32, but not the counters.
bf16 holds integers exactly only up to 256 (fp16: 2048): above that every accumulation rounds,
and finalize_model_grads' expert-bias update, `sign(mean count - count)`, changes sign for
experts whose count is close to the mean. The router silently pushes tokens towards the wrong
experts; the global aux loss is computed from rounded counts.

The fix, where megatron already restores the bias dtype: `_maintain_float32_expert_bias`
(called at every router forward, before routing, and around state-dict save/load) also returns
the counters to fp32. They are zero when cast (the cast happens at model build), so nothing is
lost by converting them back before the first count. fp32 counts are exact up to 2**24 per
expert per global batch.
"""

from __future__ import annotations

import functools

import torch

from megatron_patches.registry import Patch, PatchContext, register

NAME = "router-token-counts-fp32"
_COUNT_BUFFERS = ("local_tokens_per_expert", "global_tokens_per_expert", "ga_steps")


def _router_class():
    from megatron.core.transformer.moe.router import TopKRouter

    return TopKRouter


def _keep_counts_fp32(router) -> None:
    for name in _COUNT_BUFFERS:
        counts = getattr(router, name, None)
        if counts is not None and counts.is_floating_point() and counts.dtype != torch.float32:
            counts.data = counts.data.to(torch.float32)


def _apply() -> None:
    router_cls = _router_class()
    maintain = router_cls._maintain_float32_expert_bias
    if getattr(maintain, "__wrapped_by__", None) == NAME:
        return

    @functools.wraps(maintain)
    def maintain_float32_bias_and_counts(self):
        maintain(self)
        _keep_counts_fp32(self)

    maintain_float32_bias_and_counts.__wrapped_by__ = NAME
    router_cls._maintain_float32_expert_bias = maintain_float32_bias_and_counts


def _not_needed_because(context: PatchContext) -> str | None:
    """Runs megatron's restore on a router-shaped module whose buffers were cast to bf16."""
    router_cls = _router_class()
    probe = torch.nn.Module()
    for name in ("expert_bias", "local_tokens_per_expert"):
        probe.register_buffer(name, torch.zeros(4, dtype=torch.bfloat16))
    probe.qb_beta = probe.qb_beta_accum = None
    try:
        router_cls._maintain_float32_expert_bias(probe)
    except (AttributeError, TypeError):
        return None  # cannot tell: the wrapper converts only what it finds
    if probe.local_tokens_per_expert.dtype == torch.float32:
        return "TopKRouter keeps local_tokens_per_expert in fp32 itself"
    if not probe.local_tokens_per_expert.is_floating_point():
        return "TopKRouter counts tokens in an integer buffer"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="NVIDIA/Megatron-LM PR #7081",
    versions=">=0.19,<0.20",
    summary="router token counts (expert bias, global aux loss) kept in fp32 under bf16/fp16",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
