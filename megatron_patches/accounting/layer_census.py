"""layer-census (NVIDIA/Megatron-LM#1778): one record of the model megatron built, made once
after `megatron.training.training.setup_model_and_optimizer` (a collective: every rank takes
part). It refuses a model whose layers differ from the flags, prints the layout, and registers
the record (moe_launcher/model/built_model.py) for the patches that declare
`requires=("layer-census",)`: the aux-loss divisor, FLOPs and the parameter census.
Targets megatron-core 0.15.x - 0.19.x.
"""

from __future__ import annotations

import functools

from megatron_patches.registry import Patch, register, wrapped_by
from moe_launcher.model import layer_layout
from moe_launcher.model.built_model import ModelRecord, make_record
from moe_launcher.runtime import collectives

NAME = "layer-census"


def _print_rank_0(message: str) -> None:
    if collectives.rank() == 0:
        print(message, flush=True)


def _apply(record: ModelRecord) -> None:
    from megatron.training import training
    if wrapped_by(training.setup_model_and_optimizer, NAME):
        return
    megatron_setup = training.setup_model_and_optimizer

    @functools.wraps(megatron_setup)
    def setup_model_and_optimizer(*args, **kwargs):
        model, optimizer, scheduler = megatron_setup(*args, **kwargs)
        from megatron.training import get_args
        margs = get_args()
        built = make_record(model)
        if margs.hybrid_layer_pattern is None:
            layer_layout.check_census(built.layers, num_layers=margs.num_layers,
                                      num_experts=margs.num_experts,
                                      moe_layer_freq=margs.moe_layer_freq,
                                      mtp_num_layers=margs.mtp_num_layers)
        else:
            layer_layout.check_hybrid_census(built.layers, margs.hybrid_layer_pattern,
                                             margs.pipeline_model_parallel_size)
        _print_rank_0(f"[megatron_patches] layer census: {built.layers.summary()}")
        record.keep(built)
        return model, optimizer, scheduler

    setup_model_and_optimizer.__wrapped_by__ = NAME
    training.setup_model_and_optimizer = setup_model_and_optimizer


MODEL_RECORD = ModelRecord()

PATCH = register(Patch(
    name=NAME,
    upstream=layer_layout.UPSTREAM,
    versions=">=0.15,<0.20",
    packages=("megatron.training",),
    summary="records the model built (layers per pipeline stage, parameter sharding) after "
            "megatron.training.training.setup_model_and_optimizer and refuses layers that "
            "differ from the flags",
    # The record is this project's own; the aux-loss, FLOPs and parameter patches read it.
    not_needed_because=lambda context: None,
    apply=functools.partial(_apply, MODEL_RECORD),
    record=MODEL_RECORD,
))
