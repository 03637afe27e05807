"""Layer layout (NVIDIA/Megatron-LM#1778): refused splits name their flags, accepted splits are
the ones megatron places correctly, and the census counts what megatron really built."""

import argparse

import torch

import _megatron_cpu as cpu  # noqa: F401  (activates the CPU backend before megatron loads)
import pytest

from moe_launcher.model import built_model
from moe_launcher.model.layer_layout import (
    LayerLayout,
    census_of_model,
    check_census,
    validate_layer_layout,
)
from moe_launcher.runtime.refusals import LayerLayoutError

FIRST = "--decoder-first-pipeline-num-layers"
LAST = "--decoder-last-pipeline-num-layers"

# (num_layers, PP, VPP, first, last) -> flags the error must name; the table.
REFUSED = [
    ((20, 1, None, 5, 5), [f"{FIRST}=5", "--num-layers=20"]),  # 0.19.2 builds 5 layers
    ((20, 1, None, 1, 1), [f"{FIRST}=1", "--num-layers=20"]),  # builds 1 dense layer
    ((20, 1, None, 10, 10), [f"{FIRST}=10", "--num-layers=20"]),  # ValueError though 10+10=20
    ((4, 2, None, 5, None), [f"{FIRST}=5"]),  # builds 5 layers
    ((4, 3, None, 3, 3), [f"{FIRST}=3", f"{LAST}=3", "-2 layers"]),  # layers 2-3 twice
    ((10, 4, None, 7, 7), [f"{FIRST}=7", f"{LAST}=7", "-4 layers"]),  # layers 4-7 twice
    ((20, 1, None, None, 5), [f"{LAST}=5"]),
    ((4, 2, None, 1, 2), ["1 + 2 = 3", "not 4"]),
    ((8, 4, None, 3, 4), ["1 layers are left for 2 middle"]),
    ((11, 4, None, 3, 3), ["5 layers left for 2 middle pipeline stages do not split evenly"]),
    ((4, 2, None, 0, None), [f"{FIRST}=0"]),
    ((16, 4, 2, 3, 3), ["pipeline stage 0 would hold 3 layers", "2 virtual stages"]),
    ((24, 4, 2, 4, None), ["20 layers left for 3 middle"]),
    ((18, 4, 2, 2, 2), ["pipeline stage 1 would hold 7 layers", "2 virtual stages"]),
    ((10, 4, None, None, None), ["do not split evenly over 4"]),
]

ACCEPTED = [
    ((30, 4, None, 6, 6), [6, 9, 9, 6]),
    ((4, 2, None, 2, 2), [2, 2]),
    ((20, 1, None, 20, 20), [20]),  # a no-op on one stage
    ((20, 1, None, None, None), [20]),
    ((4, 2, None, 1, None), [1, 3]),
    ((10, 4, None, None, 1), [3, 3, 3, 1]),
    ((16, 4, 2, 2, 2), [2, 6, 6, 2]),
    ((16, 4, 2, 4, 4), [4, 4, 4, 4]),
    ((8, 4, 2, None, None), [2, 2, 2, 2]),
    ((26, 4, 2, 2, None), [2, 8, 8, 8]),
]


@pytest.mark.parametrize("fields,named", REFUSED)
def test_refused_layouts_name_their_flags(fields, named):
    with pytest.raises(LayerLayoutError) as refused:
        validate_layer_layout(LayerLayout(*fields))
    message = str(refused.value)
    for text in named + ["NVIDIA/Megatron-LM#1778", "Fix:"]:
        assert text in message


def _megatron_layer_numbers(layout: LayerLayout) -> list[list[int]]:
    """The 1-based layer numbers megatron's own placement gives each pipeline rank."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(
        num_layers=layout.num_layers, hidden_size=8, num_attention_heads=1,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=layout.pipeline_parallel,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers)
    stages = []
    for rank in range(layout.pipeline_parallel):
        numbers = []
        for vp in range(layout.virtual_pipeline or 1):
            vp_stage = vp if layout.virtual_pipeline else None
            count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=rank)
            offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=rank)
            numbers += [offset + i + 1 for i in range(count)]
        stages.append(numbers)
    return stages


@pytest.mark.parametrize("fields,per_stage", ACCEPTED)
def test_accepted_layouts_are_placed_correctly_by_megatron(fields, per_stage):
    layout = LayerLayout(*fields)
    assert validate_layer_layout(layout) == per_stage
    placed = _megatron_layer_numbers(layout)
    assert [len(numbers) for numbers in placed] == per_stage
    assert sorted(n for numbers in placed for n in numbers) == list(range(1, layout.num_layers + 1))


@pytest.mark.parametrize("fields", [(4, 3, None, 3, 3), (10, 4, None, 7, 7)])
def test_refused_layouts_really_are_misplaced_by_megatron(fields):
    """The refusals are not over-cautious: megatron builds some layer numbers twice."""
    placed = _megatron_layer_numbers(LayerLayout(*fields))
    numbers = sorted(n for stage in placed for n in stage)
    assert numbers != list(range(1, fields[0] + 1))


def _args(**overrides):
    fields = dict(num_layers=20, pipeline_model_parallel_size=1,
                  virtual_pipeline_model_parallel_size=None,
                  num_virtual_stages_per_pipeline_rank=None,
                  num_layers_per_virtual_pipeline_stage=None,
                  pipeline_model_parallel_layout=None, hybrid_layer_pattern=None,
                  account_for_embedding_in_pipeline_split=False,
                  account_for_loss_in_pipeline_split=False,
                  decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None)
    fields.update(overrides)
    return argparse.Namespace(**fields)


def test_from_args_derives_virtual_pipeline_like_megatron():
    assert LayerLayout.from_args(_args(
        num_layers=16, pipeline_model_parallel_size=4,
        num_layers_per_virtual_pipeline_stage=2)).virtual_pipeline == 2
    assert LayerLayout.from_args(_args(
        num_layers=16, pipeline_model_parallel_size=4, num_virtual_stages_per_pipeline_rank=2,
        decoder_first_pipeline_num_layers=2)) == LayerLayout(16, 4, 2, 2, None)
    # A custom layout is megatron's to check.
    assert LayerLayout.from_args(_args(pipeline_model_parallel_layout="Et|tL")) is None


def test_patch_refuses_before_megatron_validates_args():
    from megatron.training import arguments

    from megatron_patches import registry
    from megatron_patches.accounting import layer_layout_validation

    statuses = {s.name: s for s in registry.apply_patches(registry.current_context(True))}
    assert statuses[layer_layout_validation.PATCH.name].applied  # 0.19.2 builds 5 of 20 layers
    assert registry.wrapped_by(arguments.validate_args, layer_layout_validation.NAME)
    with pytest.raises(LayerLayoutError, match=f"{FIRST}=5"):
        arguments.validate_args(_args(decoder_first_pipeline_num_layers=5,
                                      decoder_last_pipeline_num_layers=5))


def test_census_of_a_built_moe_model_with_mtp():
    # Dense first layer, MoE after; the MTP layer copies the last (MoE) layer.
    config = cpu.tiny_config(num_layers=3, num_moe_experts=4, moe_router_topk=1,
                             moe_router_pre_softmax=True,
                             moe_layer_freq=[0, 1, 1], mtp_num_layers=1)
    model = cpu.build_gpt(config, seq_length=16)
    census = census_of_model([model])
    assert (census.dense, census.moe, census.mtp, census.mtp_moe) == (1, 2, 1, 1)
    assert census.per_stage == (3,) and census.layer_numbers == (1, 2, 3)
    check_census(census, num_layers=3, num_experts=4, moe_layer_freq=[0, 1, 1], mtp_num_layers=1)


def test_census_refuses_a_model_megatron_built_wrong():
    """PP=1, N=4, first=1, last=1 slips through 0.19.2's checks and builds 1 layer."""
    config = cpu.tiny_config(num_layers=4, num_layers_in_first_pipeline_stage=1,
                             num_layers_in_last_pipeline_stage=1)
    model = cpu.build_gpt(config, seq_length=16)
    census = census_of_model([model])
    assert census.decoder_layers == 1
    with pytest.raises(LayerLayoutError, match=r"1 decoder layers built for --num-layers=4"):
        check_census(census, num_layers=4, num_experts=None)


def test_aux_loss_is_averaged_over_moe_layers_built():
    """One MoE layer of three, plus a dense MTP layer: megatron would divide by 2, not 1."""
    import torch
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_patches import registry

    registry.load_patches()  # registers moe-aux-loss-per-built-layer
    config = cpu.tiny_config(num_layers=3, num_moe_experts=4, moe_router_topk=2,
                             moe_layer_freq=[1, 0, 0], mtp_num_layers=1)
    model = cpu.build_gpt(config, seq_length=16)
    built = built_model.make_record([model])
    assert built.layers.moe_layers_with_mtp == 1
    statuses = {s.name: s for s in registry.apply_patches(registry.current_context(True))}
    assert statuses["moe-aux-loss-per-built-layer"].applied
    registry.record_of("layer-census").keep(built)  # as the layer-census patch does

    cpu.train_step_loss(model, batch=2, seq_length=16)
    tracker = get_moe_metrics_tracker()
    per_layer = tracker.metrics["load_balancing_loss"].values.clone()
    total_loss = {}
    tracker.report(loss_scale=1.0, iteration=1, force_initialize=True,
                   track_names=["load_balancing_loss"], num_layers=3, moe_layer_freq=[1, 0, 0],
                   mtp_num_layers=1, total_loss_dict=total_loss)
    recorded = per_layer[per_layer != 0]
    assert recorded.numel() == 1
    torch.testing.assert_close(total_loss["load_balancing_loss"], recorded.mean())
