"""The dry run's activation figure (moe_launcher/activation_memory.py) against the tensors megatron's
own layers keep for their backward. The reference: megatron-core's GPT layer built from a command
line as pretrain_moe.py checks it (local spec, bf16, one gloo rank), run forward under torch's
saved-tensor hooks, which see every tensor autograd keeps; the weights and the batch's attention
mask (one tensor every layer shares) are left out; RoPE applied as the decoder applies it. The
figure's "local" kernels must be that count: exactly for dense layers, within 0.5% for MoE layers
(a few small tensors whose storage follows the random batch's routing). Its "te" kernels (the GPU
path, which the dry run prints) differ only in the norms, the core attention and the dropout masks,
which keep what Transformer Engine's kernels and CUDA's dropout keep. Recompute against megatron's
checkpointed forward of the same decoder; the pipeline's in-flight micro-batches against the 1F1B
counts of Narayanan et al. (SC'21), which megatron's schedule implements; and a whole pipeline
rank's figure against what each rank of a real run holds through its first training step.
"""

from __future__ import annotations

import json

import pytest
import torch

from _launch import REPO, TINY_MODEL, launch
from _megatron_cpu import environment_kept, kept_for_backward
from moe_launcher import activation_memory

SEQ = 128
MODEL = ["--hidden-size", "256", "--num-attention-heads", "8", "--ffn-hidden-size", "512",
         "--max-position-embeddings", "512", "--vocab-size", "1024", "--normalization",
         "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--bf16", "--moe-router-dtype", "fp32",
         "--moe-token-dispatcher-type", "alltoall", "--moe-layer-freq", "([0]+[1])"]
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]
LAYERS = {
    # Qwen3-style: grouped-query attention with q/k norms, softmax top-k routing
    # (and GLM-4.5's RoPE on half of each head)
    "gqa-qk-norms": ["--group-query-attention", "--num-query-groups", "2", "--qk-layernorm",
                     "--rotary-percent", "0.5", "--num-experts", "8", "--moe-router-topk", "2",
                     "--moe-ffn-hidden-size", "128", *NO_DROPOUT],
    # DeepSeek-V3-style: multi-latent attention (unfused RoPE), a shared expert, sigmoid
    # group-limited routing with expert bias and the sequence-wise balance loss
    "mla-shared-expert": ["--multi-latent-attention", "--q-lora-rank", "96", "--kv-lora-rank",
                          "64", "--qk-head-dim", "32", "--qk-pos-emb-head-dim", "16",
                          "--v-head-dim", "32", "--qk-layernorm", "--no-rope-fusion",
                          "--rope-type", "rope", "--num-experts", "8", "--moe-router-topk", "2",
                          "--moe-ffn-hidden-size", "128", "--moe-shared-expert-intermediate-size",
                          "64", "--moe-router-score-function", "sigmoid",
                          "--moe-router-enable-expert-bias", "--moe-router-num-groups", "4",
                          "--moe-router-group-topk", "2", "--moe-router-load-balancing-type",
                          "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4", *NO_DROPOUT],
    # megatron's default dropout (0.1: masks kept) and a gated shared expert (Qwen2-MoE)
    "dropout-gated-shared-expert": ["--num-experts", "4", "--moe-router-topk", "2",
                                    "--moe-ffn-hidden-size", "128",
                                    "--moe-shared-expert-intermediate-size", "64",
                                    "--moe-shared-expert-gate"],
}
# (and the dropout masks: bools on CUDA, the activation dtype in torch's CPU dropout)
KERNEL_PARTS = {"input norm", "attention norms", "pre-MLP norm", "core attention", "dropout"}


def _model(flags: list[str]):
    from moe_launcher.convert import megatron_side

    megatron_side.start()
    args, config = megatron_side.args_of_flags(flags, SEQ)
    with torch.device("cpu"):
        return args, megatron_side.build(config)


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("layers", LAYERS)
def test_a_layers_figure_is_what_megatrons_layer_keeps(layers, kind):
    with environment_kept():
        args, model = _model(["--num-layers", "2", *MODEL, *LAYERS[layers]])
        index = 0 if kind == "dense" else 1
        rotary = None if args.multi_latent_attention else model.rotary_pos_emb(SEQ)
        measured = kept_for_backward(model, lambda hidden, mask: model.decoder.layers[index](
            hidden, attention_mask=mask, rotary_pos_emb=rotary), SEQ)
    local = activation_memory.layer_parts(args, kind == "moe", "local")
    if kind == "dense":
        assert sum(local.values()) == measured, local
    else:
        assert sum(local.values()) == pytest.approx(measured, rel=5e-3), local
    on_gpu = activation_memory.layer_parts(args, kind == "moe", "te")
    assert local.keys() == on_gpu.keys()
    assert {part for part in local if local[part] != on_gpu[part]} <= KERNEL_PARTS
    # Transformer Engine's flash attention keeps no s x s scores, its norms no fp32 copies
    assert sum(on_gpu.values()) < sum(local.values())


@pytest.mark.parametrize("recompute", [("uniform", 1), ("uniform", 2), ("block", 1)])
def test_full_recompute_keeps_what_megatrons_checkpointed_decoder_keeps(recompute):
    """megatron's checkpointed forward of a decoder of three dense layers: the inputs of the
    blocks it checkpoints (and the layers it does not, whole), and the decoder's final norm,
    which is not recomputed."""
    method, layers = recompute
    flags = ["--num-layers", "3", *MODEL[:-2], *NO_DROPOUT]
    recomputing = ["--recompute-granularity", "full", "--recompute-method", method,
                   "--recompute-num-layers", str(layers)]
    with environment_kept():
        args, model = _model([*flags, *recomputing])
        model.train()
        rotary = model.rotary_pos_emb(SEQ)
        measured = kept_for_backward(model, lambda hidden, mask: model.decoder(
            hidden, attention_mask=mask, rotary_pos_emb=rotary), SEQ)
        measured -= rotary.untyped_storage().nbytes()  # (one tensor every checkpoint shares)
    kept, rebuilt = activation_memory.chunk_bytes(args, [0, 0, 0], "local")
    shape = activation_memory.Shape.of(args, "local")
    final_norm = activation_memory.norm_bytes(args, shape, args.hidden_size, shape.tokens)
    assert kept + final_norm == measured
    assert rebuilt == layers * activation_memory.layer_bytes(args, False, "local")


@pytest.mark.parametrize("microbatches", [2, 16])
def test_each_pipeline_rank_holds_the_micro_batches_of_1f1b(microbatches):
    """Without interleaving rank r holds pp - r micro-batches (fewer when the step has fewer);
    interleaved with v chunks, rank r runs (pp - r - 1) * 2 + (v - 1) * pp warm-up forwards of
    a chunk each and holds one more."""
    pp = 4
    for rank in range(pp):
        peak, held = activation_memory.peak_in_flight([1.0], pp, rank, microbatches, pp)
        assert held == peak == min(pp - rank, microbatches)
        peak, held = activation_memory.peak_in_flight([1.0, 1.0], pp, rank, microbatches, pp)
        assert held == peak == min((pp - rank - 1) * 2 + pp + 1, 2 * microbatches)
    # chunks of different sizes: the peak weighs what is held, not how many
    peak, held = activation_memory.peak_in_flight([1.0, 3.0], pp, 0, 16, pp)
    assert held == 11 and held < peak < 3 * held


RUNS = {
    # 1F1B: the first stage holds 2 micro-batches of 2 layers, the last 1 and the loss
    "pp2": (2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2"]),
    # interleaved (2 chunks of a layer a rank): the first rank holds 5 chunk micro-batches; an
    # MTP layer and its own loss on the last
    "pp2-interleaved-mtp": (2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                                "--num-layers-per-virtual-pipeline-stage", "1",
                                "--mtp-num-layers", "1"]),
    # heads, vocabulary and MLP split over TP, tokens over SP, the experts' tokens gathered
    # over ETP
    "tp2-sp-ep2-etp2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                            "--expert-model-parallel-size", "2",
                            "--expert-tensor-parallel-size", "2",
                            "--moe-token-dispatcher-type", "alltoall"]),
    # each layer's input kept, one layer rebuilt at a time; the MTP layer's two inputs, and
    # the MTP layer rebuilt beside the decoder's final norm
    "pp2-full-recompute-mtp": (2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                                   "--recompute-granularity", "full", "--recompute-method",
                                   "uniform", "--recompute-num-layers", "1",
                                   "--mtp-num-layers", "1"]),
    # glm45_air_fsdp's recompute of the MoE part, and of core attention (the local spec's
    # s x s scores; Transformer Engine's flash attention keeps q, k and v either way)
    "selective-moe-core-attention": (1, ["--recompute-granularity", "selective",
                                         "--recompute-modules", "moe", "core_attn"]),
    # every expert's input padded to its capacity (1.5 x its share)
    "capacity-padded": (1, ["--moe-expert-capacity-factor", "1.5",
                            "--moe-pad-expert-input-to-capacity",
                            "--moe-token-dispatcher-type", "alltoall"]),
}


@pytest.mark.parametrize("run", RUNS)
def test_each_ranks_figure_is_what_it_holds_through_a_training_step(run, tmp_path):
    """A real run's first step on CPU ranks (megatron's schedule, process groups, loss): each
    rank's most bytes held for the backward at once (tests/_observed_launch.py
    $ACTIVATION_DIR) is the figure for its pipeline rank within 2% (experts' tokens per rank
    vary with the routing, and the tiny model's per-token index tensors weigh more than at
    real sizes)."""
    world, layout = RUNS[run]
    launch(world, [*TINY_MODEL, "--train-iters", "1", *layout],
           env={"ACTIVATION_DIR": str(tmp_path)},
           script=REPO / "tests" / "_observed_launch.py").check()
    for rank in range(world):
        held = json.loads((tmp_path / f"activation_rank{rank}.json").read_text())
        assert held["planned"] == pytest.approx(held["peak"], rel=0.02), (rank, held)
