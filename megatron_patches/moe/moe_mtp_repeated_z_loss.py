"""The router z-loss of a repeated MTP layer: its gradient counts the layer once, like its
logged value and like the load-balancing loss (local; found next to Megatron-LM#6748).

With `--mtp-use-repeated-layer` one MTP layer is applied at each of the `mtp_num_layers`
depths, so its router runs that many times per forward. megatron-core 0.19.2 divides the
load-balancing loss by `mtp_num_layers` before attaching it to the activations (gradient and
logged value alike), but `TopKRouter.apply_z_loss` attaches the full z-loss to the logits and
divides only the value it logs: the MTP router's z-loss gradient is `mtp_num_layers` times what
the logged z-loss (and the load-balancing treatment) says.

The fix: while a repeated MTP layer's router computes its z-loss, its coefficient is divided by
`mtp_num_layers` (restored right after, the call is synchronous). The attached z-loss is then
the logged one; the logged value itself is unchanged. Targets megatron-core 0.15.x - 0.19.x
where `TransformerConfig` has `mtp_use_repeated_layer` (tested on 0.19.2).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from megatron_patches.registry import Patch, PatchContext, register, wrapped_by

NAME = "moe-mtp-repeated-z-loss"


def _repeats(router) -> int:
    """How often one forward applies this router's layer (1 unless a repeated MTP layer)."""
    config = router.config
    if (getattr(router, "is_mtp_layer", False) and getattr(config, "mtp_use_repeated_layer", False)
            and config.mtp_num_layers):
        return config.mtp_num_layers
    return 1


def _z_loss_logit_grad(apply_z_loss, is_mtp_layer: bool) -> torch.Tensor:
    """The z-loss gradient megatron's apply_z_loss attaches to one row of logits, for a router
    of a repeated MTP layer applied at 2 depths (or of a decoder layer)."""
    from megatron.core.transformer.moe import router as router_module
    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    config = SimpleNamespace(moe_z_loss_coeff=1.0, mtp_use_repeated_layer=True, mtp_num_layers=2,
                             num_layers=1)
    router = SimpleNamespace(config=config, training=True, is_mtp_layer=is_mtp_layer,
                             tp_cp_group=SimpleNamespace(size=lambda: 1),
                             calculate_per_token_loss=False,
                             layer_number=1, tp_dp_cp_group=None)
    logits = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    # The probe's z-loss goes to a tracker of its own, and the backward creates the scaler's
    # loss scale on the logits' device if none is set yet: training's are left untouched.
    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    tracker = router_module.get_moe_metrics_tracker
    probe_tracker = MoEMetricsTracker()
    router_module.get_moe_metrics_tracker = lambda: probe_tracker
    try:
        (apply_z_loss(router, logits) * 0).sum().backward()  # only the attached z-loss remains
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale
        router_module.get_moe_metrics_tracker = tracker
    return logits.grad


def _not_needed(context: PatchContext) -> str | None:
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not hasattr(TransformerConfig, "mtp_use_repeated_layer"):
        return "this megatron-core has no repeated MTP layer (mtp_use_repeated_layer)"
    mtp = _z_loss_logit_grad(TopKRouter.apply_z_loss, is_mtp_layer=True)
    decoder = _z_loss_logit_grad(TopKRouter.apply_z_loss, is_mtp_layer=False)
    if torch.allclose(mtp * 2, decoder):
        return "megatron-core already scales a repeated MTP layer's z-loss gradient"
    return None


def _apply() -> None:
    from megatron.core.transformer.moe.router import TopKRouter

    megatron_z_loss = TopKRouter.apply_z_loss
    if wrapped_by(megatron_z_loss, NAME):
        return

    @functools.wraps(megatron_z_loss)
    def apply_z_loss(self, logits, *args, **kwargs):
        repeats, coeff = _repeats(self), self.config.moe_z_loss_coeff
        if repeats == 1 or coeff is None:
            return megatron_z_loss(self, logits, *args, **kwargs)
        self.config.moe_z_loss_coeff = coeff / repeats
        try:
            return megatron_z_loss(self, logits, *args, **kwargs)
        finally:
            self.config.moe_z_loss_coeff = coeff

    apply_z_loss.__wrapped_by__ = NAME
    TopKRouter.apply_z_loss = apply_z_loss


register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 router.py divides only the logged z-loss of a "
             "repeated MTP layer)",
    versions=">=0.15,<0.20",
    summary="megatron.core.transformer.moe.router.TopKRouter.apply_z_loss attaches a "
            "repeated MTP layer's z-loss divided by mtp_num_layers, as its logged value is",
    not_needed_because=_not_needed,
    apply=_apply,
))
