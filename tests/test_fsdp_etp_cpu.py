"""Megatron-FSDP with expert parallelism trains and saves fsdp_dtensor checkpoints on megatron-core
0.19.x through pretrain_moe.py (4 CPU ranks, gloo).

In fp32 (no --bf16) Megatron-FSDP divides gradients inside the reduction, an NCCL PREMUL_SUM
that gloo lacks: the CPU backend bridges it (test_fp32_gradient_reduction). megatron-core 0.19.2
cannot save fp32 Megatron-FSDP fsdp_dtensor checkpoints of this model ("GPTModel has no
attribute `module`" during its fsdp_dtensor save, cause not traced), so that test only trains.

What each checkpoint run goes through:
* the fsdp-dtensor-optimizer-keys patch (Megatron-LM#4910): small parameters are empty on some
  ranks, which then hold no optimizer state for them; without the patch the save hangs in
  megatron's per-key uneven-DTensor collectives;
* the checkpoint audit CLI on the saved checkpoint: every tensor tiles its global shape once,
  and expert weights carry their true (whole, not per-ETP-rank) global shapes.
"""

import pytest

from _launch import TINY_MODEL, audit_report, launch

ITERS = 2

# layout -> (ranks, flags); each layout runs one Megatron-FSDP sharding strategy.
LAYOUTS = {
    # ETP 2 with EP 1: expert weights sharded over ETP and over expert data parallelism (2).
    "etp2-ep1-optim_grads_params": ["--expert-tensor-parallel-size", "2",
                                    "--data-parallel-sharding-strategy", "optim_grads_params"],
    # Without --swiglu: megatron-core 0.19.2 cannot save a SwiGLU model's optimizer under
    # no_shard (handle_swiglu_in_state_dict reads megatron_fsdp_slice, which only sharded
    # strategies set; Megatron-LM#5265).
    "ep2-etp2-no_shard": ["--expert-model-parallel-size", "2",
                          "--expert-tensor-parallel-size", "2",
                          "--data-parallel-sharding-strategy", "no_shard"],
}
WITHOUT_SWIGLU = {"ep2-etp2-no_shard"}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_fsdp_trains_and_saves_audited_checkpoint(layout, tmp_path):
    model = [flag for flag in TINY_MODEL if not (layout in WITHOUT_SWIGLU and flag == "--swiglu")]
    run = launch(4, [*model, *LAYOUTS[layout], "--moe-token-dispatcher-type", "alltoall",
                     "--use-megatron-fsdp", "--use-distributed-optimizer",
                     "--ckpt-format", "fsdp_dtensor", "--train-iters", str(ITERS),
                     "--save-interval", str(ITERS), "--save", str(tmp_path / "ckpt")],
                 timeout=400).check()
    assert f"iteration        {ITERS}/       {ITERS}" in run.log
    assert "successfully saved checkpoint" in run.log

    report = audit_report(tmp_path / "ckpt")
    assert report["format"] == "fsdp_dtensor"
    experts = [t for t in report["tensors"] if t["expert"] and t["key"].startswith("model.")]
    # 2 layers x 8 experts x (fc1, split into weight_w/weight_v by megatron for SwiGLU; fc2).
    assert len(experts) == 2 * 8 * (2 if layout in WITHOUT_SWIGLU else 3)
    for tensor in experts:
        assert tensor["global_shape"] == tensor["expected_shape"] == [64, 64], tensor
    assert report["expert_saved_bytes"] == report["expert_expected_bytes"]


@pytest.mark.slow
def test_fp32_gradient_reduction():
    """Without the bridge every rank fails its first step: "Cannot use ReduceOp.PREMUL_SUM with
    Gloo"."""
    fp32_model = [flag for flag in TINY_MODEL if flag != "--bf16"]
    run = launch(2, [*fp32_model, "--expert-tensor-parallel-size", "2",
                     "--use-megatron-fsdp", "--use-distributed-optimizer",
                     "--ckpt-format", "fsdp_dtensor",
                     "--data-parallel-sharding-strategy", "optim_grads_params",
                     "--train-iters", str(ITERS)], timeout=300).check()
    assert f"iteration        {ITERS}/       {ITERS}" in run.log
