"""FLOPs per iteration against torch's FlopCounterMode on real megatron-core GPT models (CPU, fp32).

Like with like on causal attention: FlopCounterMode counts the full S×S score and value
matmuls (the causal mask is applied to the scores, not skipped), so the model FLOPs compared
with it are computed with causal_fraction=1.0. The reported default keeps megatron's convention
of counting half; test_causal_convention_halves_only_core_attention pins that difference.
"""

import argparse

import _megatron_cpu as cpu
import pytest

from moe_launcher.model import built_model
from megatron_patches.accounting import flops_from_layer_census as flops
from moe_launcher.model.layer_layout import census_of_model

BATCH = 2

CASES = {
    "dense-gelu": dict(),
    "dense-swiglu": dict(gated_linear_unit=True, ffn_hidden_size=96),
    "gqa": dict(num_attention_heads=8, num_query_groups=2, gated_linear_unit=True),
    "moe-e8-top1": dict(num_moe_experts=8, moe_router_topk=1, moe_router_pre_softmax=True),
    "moe-e8-top2": dict(num_moe_experts=8, moe_router_topk=2),
    "moe-e64-top8": dict(num_moe_experts=64, moe_router_topk=8, moe_ffn_hidden_size=16),
    "moe-freq-int": dict(num_layers=4, num_moe_experts=8, moe_router_topk=2, moe_layer_freq=2),
    "moe-freq-list-dense-first": dict(num_layers=3, num_moe_experts=8, moe_router_topk=2,
                                      moe_layer_freq=[0, 1, 1]),
    "shared-experts-gate": dict(num_moe_experts=8, moe_router_topk=2, gated_linear_unit=True,
                                moe_shared_expert_intermediate_size=48,
                                moe_shared_expert_gate=True),
    "mla": dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16,
                qk_pos_emb_head_dim=8, v_head_dim=16),
    "mla-no-q-lora": dict(multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=16,
                          qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=24),
    "mtp1-moe": dict(num_moe_experts=8, moe_router_topk=2, mtp_num_layers=1),
    "capacity-padded": dict(num_moe_experts=8, moe_router_topk=2,
                            moe_expert_capacity_factor=1.5,
                            moe_pad_expert_input_to_capacity=True),
}


# HybridModel patterns (moe_launcher/model/hybrid_spec.py): layers of one family each.
HYBRID_CASES = {
    "hybrid-*E*E": ("*E*E", dict(num_layers=4, num_moe_experts=8, moe_router_topk=2)),
    "hybrid-dense-first": ("*-*E", dict(num_layers=4, num_moe_experts=8, moe_router_topk=2,
                                        gated_linear_unit=True)),
    "hybrid-gqa-shared": ("**EE", dict(num_layers=4, num_moe_experts=8, moe_router_topk=2,
                                       num_attention_heads=8, num_query_groups=2,
                                       moe_shared_expert_intermediate_size=48)),
    "hybrid-mtp": ("*E*E/*E", dict(num_layers=4, num_moe_experts=8, moe_router_topk=2,
                                   mtp_num_layers=1)),
    "hybrid-mla": ("+E+E", dict(num_layers=4, num_moe_experts=8, moe_router_topk=2,
                                **CASES["mla"])),
}


def _model_flops(config, model, seq_length, causal_fraction):
    census = census_of_model([model])
    shape = flops.ModelShape.from_config(config, cpu.VOCAB, BATCH, seq_length)
    return flops.flops_per_batch(shape, census, BATCH * seq_length, BATCH * seq_length ** 2,
                                 causal_fraction=causal_fraction)


# Every case at seq 128; a representative subset at 1024 keeps the suite fast on CPU.
SEQ_1024 = ("dense-swiglu", "moe-e64-top8", "mla", "mtp1-moe")


@pytest.mark.parametrize("case,seq_length",
                         [(c, 128) for c in CASES] + [(c, 1024) for c in SEQ_1024])
def test_flops_match_flop_counter(case, seq_length):
    config = cpu.tiny_config(**CASES[case])
    model = cpu.build_gpt(config, seq_length)
    measured = cpu.measured_flops(model, BATCH, seq_length)
    predicted = _model_flops(config, model, seq_length, causal_fraction=1.0)
    assert predicted == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("case", HYBRID_CASES)
def test_hybrid_flops_match_flop_counter(case):
    pattern, overrides = HYBRID_CASES[case]
    config = cpu.tiny_config(**overrides)
    model = cpu.build_hybrid(config, pattern, 128)
    measured = cpu.measured_flops(model, BATCH, 128)
    predicted = _model_flops(config, model, 128, causal_fraction=1.0)
    assert predicted == pytest.approx(measured, rel=0.01)


def test_router_and_shared_gate_are_counted():
    """Megatron's formula leaves out 2·h·E per token for the router; ours does not."""
    shape = flops.ModelShape.from_config(cpu.tiny_config(**CASES["moe-e64-top8"]), cpu.VOCAB)
    gated = flops.ModelShape.from_config(cpu.tiny_config(**CASES["shared-experts-gate"]),
                                         cpu.VOCAB)
    ungated = flops.ModelShape.from_config(
        cpu.tiny_config(**{**CASES["shared-experts-gate"], "moe_shared_expert_gate": False}),
        cpu.VOCAB)
    h, tokens = 64, 1000
    assert flops.moe_mlp(shape, tokens) - tokens * 8 * flops._mlp(h, 16, False) == tokens * 2 * h * 64
    assert flops.moe_mlp(gated, tokens) - flops.moe_mlp(ungated, tokens) == tokens * 2 * h


def test_capacity_factor_caps_routed_rows():
    moe = flops.ModelShape.from_config(
        cpu.tiny_config(num_moe_experts=8, moe_router_topk=2, moe_expert_capacity_factor=0.5),
        cpu.VOCAB, micro_batch_size=1, seq_length=64).moe
    # 64 tokens x top-2 = 128 rows wanted; capacity ceil(128/8*0.5) = 8 per expert -> 64 rows.
    assert flops.routed_rows(moe, 64) == 64
    padded = flops.ModelShape.from_config(
        cpu.tiny_config(num_moe_experts=8, moe_router_topk=2, moe_expert_capacity_factor=1.5,
                        moe_pad_expert_input_to_capacity=True),
        cpu.VOCAB, micro_batch_size=1, seq_length=64).moe
    assert flops.routed_rows(padded, 640) == 10 * 8 * 24  # 10 router calls, 8 experts x 24


def test_causal_convention_halves_only_core_attention():
    config = cpu.tiny_config()
    model = cpu.build_gpt(config, 128)
    full = _model_flops(config, model, 128, causal_fraction=1.0)
    causal = _model_flops(config, model, 128, causal_fraction=0.5)
    shape = flops.ModelShape.from_config(config, cpu.VOCAB)
    core = 3 * config.num_layers * BATCH * 128 ** 2 * flops.attention_core(shape)
    assert full - causal == core / 2


def test_patch_replaces_megatron_flops_and_prints_them(capsys):
    from megatron.training import training

    from megatron_patches import registry

    statuses = {s.name: s for s in registry.apply_patches(registry.current_context(True))}
    assert statuses["flops-from-layer-census"].applied  # 0.19.2 has no router term
    config = cpu.tiny_config(**CASES["moe-e8-top2"])
    model = cpu.build_gpt(config, 128)
    args = argparse.Namespace(hybrid_layer_pattern=None, padded_vocab_size=cpu.VOCAB,
                              micro_batch_size=1, seq_length=128, global_batch_size=BATCH)
    registry.record_of("layer-census").keep(built_model.make_record([model]))  # as the layer-census patch does
    expected = _model_flops(config, model, 128, causal_fraction=0.5)
    assert training.num_floating_point_operations(args, BATCH) == pytest.approx(expected)
    assert training.num_floating_point_operations(args, BATCH) == pytest.approx(expected)
    assert capsys.readouterr().out.count(f"FLOPs per iteration: {int(expected)}\n") == 1


def test_megatron_leaves_out_the_router_of_a_gpt_moe_model():
    """megatron-core 0.19.2's own formula (the patch's wrapper taken off) for a MoE GPT built
    from a command line as pretrain_moe.py checks it: short of the census by exactly the
    routers' FLOPs (3 passes x 2 x hidden x experts per token and MoE layer), while the census,
    counted over the full causal square, equals torch's FlopCounterMode on the model built."""
    from megatron.training import training

    from megatron_patches.registry import unwrapped
    from moe_launcher.convert import megatron_side

    megatron_side.start()
    seq, hidden, experts, layers = 128, 64, 8, 2
    args, config = megatron_side.args_of_flags(
        ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", "4",
         "--ffn-hidden-size", "128", "--num-experts", str(experts), "--moe-router-topk", "2",
         "--moe-ffn-hidden-size", "32", "--swiglu", "--disable-bias-linear", "--normalization",
         "RMSNorm", "--position-embedding-type", "rope", "--max-position-embeddings", str(seq),
         "--vocab-size", str(cpu.VOCAB), "--hidden-dropout", "0", "--attention-dropout", "0"],
        seq)
    model = megatron_side.build(config)
    census = census_of_model([model])
    shape = flops.ModelShape.from_config(config, args.padded_vocab_size, BATCH, seq)
    counted = {fraction: flops.flops_per_batch(shape, census, BATCH * seq, BATCH * seq ** 2,
                                               causal_fraction=fraction)
               for fraction in (0.5, 1.0)}
    assert counted[1.0] == cpu.measured_flops(model, BATCH, seq)
    megatron = unwrapped(training.num_floating_point_operations)(args, BATCH)
    assert counted[0.5] - megatron == 3 * 2 * hidden * experts * BATCH * seq * layers


def test_patch_counts_hybrid_models_too(capsys):
    """A HybridModel run gets the census FLOPs and the printed line, like a GPT run; a pattern
    with layers the census does not model would keep megatron's formula."""
    from megatron.training import training

    from megatron_patches import registry

    registry.apply_patches(registry.current_context(True))
    pattern, overrides = HYBRID_CASES["hybrid-*E*E"]
    config = cpu.tiny_config(**overrides)
    model = cpu.build_hybrid(config, pattern, 128)
    args = argparse.Namespace(hybrid_layer_pattern=pattern, padded_vocab_size=cpu.VOCAB,
                              micro_batch_size=1, seq_length=128, global_batch_size=BATCH)
    registry.record_of("layer-census").keep(built_model.make_record([model]))
    expected = _model_flops(config, model, 128, causal_fraction=0.5)
    assert training.num_floating_point_operations(args, BATCH) == pytest.approx(expected)
    assert capsys.readouterr().out.count(f"FLOPs per iteration: {int(expected)}\n") == 1
    assert flops.unmodelled_families(pattern) == ""
    assert flops.unmodelled_families("M*E|G-D") == "MGD"


def test_mfu_peaks_and_log_line():
    from megatron_patches.accounting import mfu_log as mfu

    assert mfu.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert mfu.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert mfu.peak_tflops("NVIDIA GH200 480GB") == 989.0
    assert mfu.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert mfu.peak_tflops("cpu") is None
    line = " iteration       10/     100 | throughput per GPU (TFLOP/s/GPU): 494.5 | loss: 1.0 |"
    logged, value = mfu.with_mfu(line, 989.0)
    assert value == pytest.approx(0.5)
    assert "(TFLOP/s/GPU): 494.5 | MFU: 50.0% | loss" in logged
    assert mfu.with_mfu(line, None) == (line, None)


def test_mfu_patch_says_once_on_cpu(capsys):
    from megatron.training import training

    from megatron_patches import registry  # noqa: F401  (importing mfu registers mfu-log)
    from megatron_patches.accounting import mfu_log as mfu

    statuses = {s.name: s for s in registry.apply_patches(registry.current_context(True))}
    assert statuses["mfu-log"].applied
    line = " iteration        1/      10 | throughput per GPU (TFLOP/s/GPU): 1.0 |"
    training.print_rank_last(line)
    training.print_rank_last(line)
    out = capsys.readouterr().out
    assert out.count("MFU: not reported") == 1 and out.count(line) == 2


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
def test_mfu_in_the_iteration_line_and_tensorboard_only_with_the_patch(patched, monkeypatch,
                                                                      capsys, tmp_path):
    """The line megatron's training_log prints through training.print_rank_last, on a device
    with a known peak (an H100 SXM, 989 dense bf16 TFLOP/s; this machine has no GPU): with
    mfu-log it carries MFU and TensorBoard gets 'mfu'; with the patch left out (megatron's own
    print_rank_last) neither exists (the missing feature)."""
    import types

    from megatron.training import global_vars, training
    from torch.utils.tensorboard import SummaryWriter

    import _unpatched
    from _launch import tensorboard_scalars
    from megatron_patches.accounting import mfu_log as mfu

    _unpatched.apply_all()
    if not patched:
        _unpatched.leave_out(monkeypatch, "mfu-log", training, "print_rank_last")
    monkeypatch.setattr(mfu, "device_name", lambda: "NVIDIA H100 80GB HBM3")
    writer = SummaryWriter(str(tmp_path))
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS",
                        types.SimpleNamespace(log_timers_to_tensorboard=True))
    monkeypatch.setattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", writer)
    monkeypatch.setattr(global_vars, "_GLOBAL_WANDB_WRITER", None)
    # megatron-core 0.19.2 training_log's format (training.py), iteration 3 of 10
    line = (" iteration {:8d}/{:8d} |".format(3, 10)
            + " elapsed time per iteration (ms): 10.0 |"
            + f" throughput per GPU (TFLOP/s/GPU): {494.5:.1f} |" + " global batch size:     8 |")
    training.print_rank_last(line)
    writer.flush()
    out = capsys.readouterr().out
    scalars = tensorboard_scalars(tmp_path, "mfu")
    if patched:
        assert "(TFLOP/s/GPU): 494.5 | MFU: 50.0% | global batch" in out, out
        assert scalars == {3: pytest.approx(0.5)}
    else:
        assert line in out and "MFU" not in out, out
        assert scalars == {}


@pytest.mark.slow
@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
def test_a_cpu_run_prints_its_throughput_only_with_the_patch(patched):
    """The same 2-iteration run of the tiny MoE through pretrain_moe.py: megatron-core 0.19.2
    prints the throughput with one decimal, so every iteration line of a CPU run says 0.0
    TFLOP/s/GPU (MEGATRON_PATCHES_DISABLE=mfu-log); with mfu-log the line carries three
    significant digits of megatron's own value."""
    import re

    from _launch import TINY_MODEL, launch

    run = launch(1, [*TINY_MODEL, "--train-iters", "2"],
                 env={} if patched else {"MEGATRON_PATCHES_DISABLE": "mfu-log"}).check()
    printed = re.findall(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+) \|", run.log)
    assert len(printed) == 2, run.log[-3000:]
    if patched:
        assert all(float(value) > 0 and len(value.lstrip("0.")) >= 3 for value in printed), printed
    else:
        assert printed == ["0.0", "0.0"], printed
