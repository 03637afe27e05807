"""The record of the model built (built_model.py): made once, read by every consumer; without
the layer-census patch its consumers say they are skipped and megatron's own figures stay;
parameter counts hold DTensor shards, not DTensor.numel()'s global size."""

import json
import re

import _megatron_cpu as cpu
import pytest
import torch

from _launch import REPO, TINY_MODEL, launch
from megatron_patches import registry
from moe_launcher.model import built_model

CONSUMERS = ("moe-aux-loss-per-built-layer", "flops-from-layer-census", "parameter-census")


def test_record_names_every_parameter_and_finds_it_by_tensor():
    config = cpu.tiny_config(num_layers=2, num_moe_experts=4, moe_router_topk=2)
    model = cpu.build_gpt(config, seq_length=16)
    built = built_model.make_record([model])
    named = dict(model.named_parameters())
    assert [p.name for p in built.parameters] == list(named)
    for name, param in named.items():
        sharding = built.parameter(name)
        assert built.parameter_of(param) is sharding and sharding.held_numel == param.numel()
        assert sharding.global_shape == sharding.local_shape == tuple(param.shape)
        # EP = 1, ETP = TP = 1: megatron keeps the experts in the dense groups, unsplit.
        assert not sharding.expert and not sharding.dtensor and sharding.split_over == 1
    total = sum(p.numel() for p in named.values())
    assert built.unique_parameters == built.held_per_rank[0].total == total
    assert (built.layers.moe, built.layers.per_stage) == (2, (2,))
    assert built.parameter_of(torch.zeros(3)) is None


def test_setup_is_wrapped_once_by_the_record():
    from megatron.training import theoretical_memory_usage, training

    registry.load_patches()
    context = registry.current_context(cpu_backend=True)
    registry.apply_patches(context)
    registry.apply_patches(context)
    chain, function = [], training.setup_model_and_optimizer
    while function is not None:  # the wrappers, then megatron's own function beneath
        chain.append(function)
        function = getattr(function, "__wrapped__", None)
    # two patches wrap megatron's setup, the record and the first-step check, each once
    # (functools.wraps copies a wrapper's attributes onto the one around it)
    assert len(chain) == 3
    assert registry.wrapped_by(chain[0], "layer-census")
    assert registry.wrapped_by(chain[0], "resumed-run-checks-first-iteration")
    assert not hasattr(chain[-1], "__wrapped_by__")
    assert registry.wrapped_by(theoretical_memory_usage.compute_weight_and_optimizer_memory,
                               "parameter-census")


def test_requirement_not_applied_skips_the_patch_saying_why():
    base = registry.Patch(name="probe-base", upstream="test", versions=">=0", summary="",
                          not_needed_because=lambda context: None,
                          apply=lambda: pytest.fail("disabled: must not apply"))
    consumer = registry.Patch(name="probe-consumer", upstream="test", versions=">=0", summary="",
                              not_needed_because=lambda context: None,
                              apply=lambda: pytest.fail("needs probe-base: must not apply"),
                              requires=("probe-base",))
    with pytest.raises(ValueError, match="must be registered"):
        registry.register(consumer)
    registry.register(base)
    registry.register(consumer)
    try:
        context = registry.current_context(cpu_backend=True)
        context = registry.PatchContext(context.megatron_version, True,
                                        frozenset({"probe-base"}))
        statuses = {s.name: s for s in registry.apply_patches(context)}
        assert statuses["probe-consumer"].line() == (
            "[megatron_patches] probe-consumer: skipped "
            "(needs probe-base, disabled by MEGATRON_PATCHES_DISABLE)")
    finally:
        for name in ("probe-consumer", "probe-base"):
            registry._REGISTRY.pop(name)
            registry._APPLIED.pop(name, None)


def _megatron_flops_formula():
    from megatron.training import training

    return registry.unwrapped(training.num_floating_point_operations)


@pytest.mark.slow
def test_without_layer_census_consumers_are_skipped_and_megatron_figures_stay(tmp_path):
    run = launch(1, [*TINY_MODEL, "--train-iters", "1", "--save", str(tmp_path),
                     "--save-interval", "1", "--ckpt-format", "torch"],
                 env={"MEGATRON_PATCHES_DISABLE": "layer-census"}).check()
    for name in CONSUMERS:
        assert (f"[megatron_patches] {name}: skipped (needs layer-census, disabled by "
                f"MEGATRON_PATCHES_DISABLE)") in run.log, run.log[-4000:]
    assert "layer census:" not in run.log and "FLOPs per iteration" not in run.log
    assert "parameters of the model built" not in run.log
    assert "Total number of parameters in billions" in run.log  # megatron's own estimate
    # The FLOPs megatron accumulated into the checkpoint are its own formula's.
    saved = torch.load(tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt",
                       weights_only=False)
    args = saved["args"]
    assert saved["num_floating_point_operations_so_far"] == pytest.approx(
        _megatron_flops_formula()(args, args.global_batch_size))


@pytest.mark.slow
def test_dtensor_shards_are_counted_as_held_and_global_shapes_once():
    log = launch(2, [], script=REPO / "tests" / "_dtensor_census_worker.py",
                 timeout=300).check().log
    report = json.loads(re.search(r"^census (.*)$", log, re.M).group(1))
    total = report["total"]
    plain, fsdp = report["plain"], report["fsdp"]
    assert plain["unique"] == fsdp["unique"] == total
    assert plain["held"] == [total, total]
    # Megatron-FSDP shards dim 0 over 2 ranks (the 5-row tensor as 3 + 2 rows); numel() of a
    # DTensor is its global size, which the old count took as held on every rank.
    assert fsdp["numel"] == total
    assert fsdp["held"] == fsdp["sharded"] == [24 + 12 + 9, 24 + 12 + 6]
    assert fsdp["global_shapes"] == plain["global_shapes"] == {
        "dense": [8, 6], "expert": [4, 6], "odd": [5, 3]}
    assert fsdp["local_shapes"]["odd"] == [3, 3]
    # TP2 / ETP2 over the same ranks: plain tensors and TP DTensors have the same global shapes.
    tp = report["tp_plain"]
    assert tp["unique"] == total and tp["held"] == [24 + 12 + 15] * 2
    assert tp["global_shapes"] == plain["global_shapes"]
    assert tp["local_shapes"] == {"dense": [4, 6], "expert": [4, 3], "odd": [5, 3]}
    assert tp["split_over"] == {"dense": 2, "expert": 2, "odd": 1}
    assert report["tp_dtensor"]["unique"] == report["tp_dtensor_total"]
    assert report["tp_dtensor"]["global_shapes"] == {"dense": [8, 6], "expert": [4, 6]}
