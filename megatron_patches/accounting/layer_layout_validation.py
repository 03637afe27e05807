"""layer-layout-validation (NVIDIA/Megatron-LM#1778): megatron-core places
`--decoder-first/last-pipeline-num-layers` layers wrongly in some splits (with PP=1 it builds
another number of layers, silently). Wrapping `megatron.training.arguments.validate_args`, the
launcher's layout arithmetic (moe_launcher/model/layer_layout.py) refuses such a split before
megatron validates the flags. Needed only where megatron's own placement accepts the split.
Targets megatron-core 0.15.x - 0.19.x.
"""

from __future__ import annotations

import functools

from megatron_patches.registry import Patch, PatchContext, register, wrapped_by
from moe_launcher.model.layer_layout import UPSTREAM, LayerLayout, validate_layer_layout

NAME = "layer-layout-validation"


def _megatron_accepts_pp1_first_last() -> bool:
    """Asks megatron's own placement: does PP=1, N=20, first=5, last=5 build 20 layers?"""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    try:
        config = TransformerConfig(num_layers=20, hidden_size=8, num_attention_heads=1,
                                   num_layers_in_first_pipeline_stage=5,
                                   num_layers_in_last_pipeline_stage=5)
        return get_num_layers_to_build(config, vp_stage=None, pp_rank=0) != 20
    except (AssertionError, ValueError):
        return False


def _validation_not_needed(context: PatchContext) -> str | None:
    if _megatron_accepts_pp1_first_last():
        return None
    return "megatron-core refuses PP=1 with uneven first/last stage layers itself"


def _apply_validation() -> None:
    from megatron.training import arguments
    if wrapped_by(arguments.validate_args, NAME):
        return
    megatron_validate_args = arguments.validate_args

    @functools.wraps(megatron_validate_args)
    def validate_args(args, *rest, **kwargs):
        layout = LayerLayout.from_args(args)
        if layout is not None:
            validate_layer_layout(layout)
        return megatron_validate_args(args, *rest, **kwargs)

    validate_args.__wrapped_by__ = NAME
    arguments.validate_args = validate_args


PATCH = register(Patch(
    name=NAME,
    upstream=UPSTREAM,
    versions=">=0.15,<0.20",
    packages=("megatron.training",),
    summary="refuses --decoder-first/last-pipeline-num-layers splits that megatron misplaces, "
            "before megatron.training.arguments.validate_args",
    not_needed_because=_validation_not_needed,
    apply=_apply_validation,
))
