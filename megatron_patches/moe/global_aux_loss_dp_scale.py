"""--moe-router-load-balancing-type global_aux_loss trains at its coefficient, not 1/DP of it.

Upstream: NVIDIA/Megatron-LM issue #3672 (open; fix proposed in PR #3769, closed unmerged).
Targets megatron-core 0.19.x (the same code since global_aux_loss appeared).

`TopKRouter._apply_global_aux_loss` counts tokens per expert over the TP x DP x CP group and
divides by that group's token count squared, while the router probabilities in the loss are
this rank's own: each rank's loss is its 1/DP share of the global-batch loss. megatron's
gradient reduction then averages the router's gradient over data parallelism (main loss and
aux losses are per-rank means, so averaging is right for them), which divides the global aux
loss gradient by DP once more. A run with DP=64 balances its experts with 1/64 of the
coefficient asked for; nothing in the log shows it (the logged value, summed over the group,
is the true global loss).

The fix scales the global aux loss, and the coefficient it is logged against, by the DP size
(TP x DP x CP ranks / TP x CP ranks) where megatron attaches it to the router output
(`attach_and_log_load_balancing_loss`, called with the name "global_load_balancing_loss"): the
gradient becomes the global-batch loss's gradient, the logged value stays what it was.
"""

from __future__ import annotations

import functools

from megatron_patches.registry import Patch, PatchContext, register

NAME = "global-aux-loss-dp-scale"
GLOBAL_AUX_LOSS = "global_load_balancing_loss"  # the name megatron logs and attaches it under


def _router_class():
    from megatron.core.transformer.moe.router import TopKRouter

    return TopKRouter


def data_parallel_share(router) -> int:
    """How many data-parallel ranks share the global aux loss's token count."""
    return router.tp_dp_cp_group.size() // router.tp_cp_group.size()


def _apply() -> None:
    router_cls = _router_class()
    attach = router_cls.attach_and_log_load_balancing_loss
    if getattr(attach, "__wrapped_by__", None) == NAME:
        return

    @functools.wraps(attach)
    def attach_global_aux_loss_at_full_scale(self, activation, aux_loss_coeff, aux_loss,
                                             aux_loss_name, *args, **kwargs):
        if aux_loss_name == GLOBAL_AUX_LOSS:
            dp = data_parallel_share(self)
            aux_loss, aux_loss_coeff = aux_loss * dp, aux_loss_coeff * dp
        return attach(self, activation, aux_loss_coeff, aux_loss, aux_loss_name, *args, **kwargs)

    attach_global_aux_loss_at_full_scale.__wrapped_by__ = NAME
    router_cls.attach_and_log_load_balancing_loss = attach_global_aux_loss_at_full_scale


def _not_needed_because(context: PatchContext) -> str | None:
    """The factor only shows in a data-parallel group of two or more ranks, which does not exist
    when patches are decided; so this reads which names megatron's global aux loss uses."""
    apply_global = getattr(_router_class(), "_apply_global_aux_loss", None)
    if apply_global is None:
        return "TopKRouter has no global aux loss"
    if "tp_cp_group" in apply_global.__code__.co_names:
        return "TopKRouter._apply_global_aux_loss derives the DP share itself (uses tp_cp_group)"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="NVIDIA/Megatron-LM#3672",
    versions=">=0.19,<0.20",
    summary="global aux loss gradient scaled by the DP size it was divided by",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
