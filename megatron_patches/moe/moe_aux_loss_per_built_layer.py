"""The logged MoE aux losses, averaged over the MoE layers megatron built (NVIDIA/Megatron-LM#1778).

megatron's MoEMetricsTracker divides the summed per-layer aux losses by a layer count derived
from the flags (`_count_moe_layers(num_layers, moe_layer_freq, mtp_num_layers)`); it counts an
MTP layer as MoE whatever its inner layer is, and with a misplaced pipeline split the flags are
not the model. This patch divides by the MoE layers in the record of the model built
(moe_launcher/model/built_model.py; MTP layers whose inner layer is MoE included, dense ones not). A repeated MTP
layer (`--mtp-use-repeated-layer`, 0.19.x) is one MoE layer however many depths apply it: its
router records each depth's loss divided by the depths into one slot, so it counts once
(megatron adds `mtp_num_layers` for dense and repeated MTP layers alike; Megatron-LM#6748,
merged after 0.19).
Targets megatron-core 0.15.x - 0.19.x.
"""

from __future__ import annotations

import functools

from moe_launcher.model import built_model
from megatron_patches import registry
from megatron_patches.accounting import layer_census  # registered first: this patch requires it
from megatron_patches.registry import Patch, PatchContext, register

UPSTREAM = "NVIDIA/Megatron-LM#1778"
PATCH_NAME = "moe-aux-loss-per-built-layer"


def _not_needed(context: PatchContext) -> str | None:
    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker
    # Two layers, only the first MoE, one MTP layer copying the dense last layer: one MoE
    # layer is built, so a divisor of 1 is right.
    if MoEMetricsTracker._count_moe_layers(2, [1, 0], 1) == 1:
        return "megatron-core already divides the aux loss by the MoE layers built"
    return None


def moe_layers_logged(built: built_model.BuiltModel) -> int:
    """The tracker slots the MoE layers built fill: one per MoE decoder layer and per MoE MTP
    layer (the census counts a repeated MTP layer once per depth it is applied at)."""
    mtp_moe = built.layers.mtp_moe
    if getattr(built.config, "mtp_use_repeated_layer", False) and built.config.mtp_num_layers:
        mtp_moe //= built.config.mtp_num_layers
    return built.layers.moe + mtp_moe


def _apply() -> None:
    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker
    megatron_count = MoEMetricsTracker._count_moe_layers
    if registry.wrapped_by(megatron_count, PATCH_NAME):
        return

    @functools.wraps(megatron_count)
    def _count_moe_layers(num_layers, moe_layer_freq, mtp_num_layers):
        built = registry.record_of(layer_census.PATCH.name).built
        if built is None or built.layers.moe_layers_with_mtp == 0:
            return megatron_count(num_layers, moe_layer_freq, mtp_num_layers)
        return moe_layers_logged(built)

    _count_moe_layers.__wrapped_by__ = PATCH_NAME
    MoEMetricsTracker._count_moe_layers = staticmethod(_count_moe_layers)


register(Patch(
    name=PATCH_NAME,
    upstream=UPSTREAM,
    versions=">=0.15,<0.20",
    summary="averages logged MoE aux losses over the MoE layers built (MoE MTP layers "
            "included, a repeated one once) in "
            "megatron.core.transformer.moe.moe_logging.MoEMetricsTracker._count_moe_layers",
    not_needed_because=_not_needed,
    apply=_apply,
    requires=(layer_census.PATCH.name,),
))
