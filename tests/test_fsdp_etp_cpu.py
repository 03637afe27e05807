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
  and expert weights carry their true (whole, not per-ETP-rank) global shapes;
* the parameter census (#1778), whose figures are megatron's theoretical-memory line: the total
  counts DTensor global sizes (the model's parameters, as without FSDP), the most loaded rank
  and the weight+optimizer memory are what the ranks keep in Megatron-FSDP's buffers and the
  optimizer's states after the first step (tests/_observed_launch.py measures them).
  Megatron-FSDP keeps gradients in the parameters' dtype (bf16) by default, not megatron's
  fp32; and `optim_grads` keeps whole weights next to sharded gradients and optimizer state.
"""

import json
import re

import pytest

from _launch import REPO, TINY_MODEL, audit_report, launch

ITERS = 2
OBSERVED = REPO / "tests" / "_observed_launch.py"
CENSUS = re.compile(r"parameters of the model built: total (\d+), most loaded rank (\d+)")
MEMORY = re.compile(r"weight and optimizer memory on the most loaded rank: ([0-9.]+) MB")
MEGATRON_REPORT = re.compile(r"Theoretical memory footprints: weight and optimizer=([0-9.]+) MB")


def tiny_model_parameters(swiglu: bool) -> int:
    """TINY_MODEL's parameters, counted from its sizes: per layer QKV and output projections,
    two RMSNorms, the router and 8 experts (fc1 doubled by SwiGLU, fc2); then the final norm,
    and the untied embedding and output layer (vocabulary 512)."""
    hidden, ffn, experts, vocab = 64, 64, 8, 512
    expert = hidden * ffn * (2 if swiglu else 1) + ffn * hidden
    layer = hidden * 3 * hidden + hidden * hidden + 2 * hidden + experts * hidden + experts * expert
    return 2 * layer + hidden + 2 * vocab * hidden


def check_census(log: str, memory_dir, nproc: int, swiglu: bool = True) -> None:
    total, most_loaded = map(int, CENSUS.search(log).groups())
    assert total == tiny_model_parameters(swiglu)  # global sizes, not this rank's shards
    kept = [json.loads((memory_dir / f"memory_rank{rank}.json").read_text())
            for rank in range(nproc)]
    assert most_loaded == max(rank["weights"] for rank in kept)
    reported = MEMORY.search(log).group(1)
    assert reported == f"{max(rank['bytes'] for rank in kept) / 2**20:.2f}", kept
    assert MEGATRON_REPORT.search(log).group(1) == reported

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
                 env={"MEMORY_DIR": str(tmp_path)}, script=OBSERVED, timeout=400).check()
    assert f"iteration        {ITERS}/       {ITERS}" in run.log
    assert "successfully saved checkpoint" in run.log
    check_census(run.log, tmp_path, 4, swiglu=layout not in WITHOUT_SWIGLU)

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


@pytest.mark.slow
def test_census_of_optim_grads_keeps_whole_weights(tmp_path):
    """The one strategy that shards gradients but not weights (2 ranks, one step)."""
    run = launch(2, [*TINY_MODEL, "--use-megatron-fsdp", "--use-distributed-optimizer",
                     "--ckpt-format", "fsdp_dtensor",
                     "--data-parallel-sharding-strategy", "optim_grads", "--train-iters", "1"],
                 env={"MEMORY_DIR": str(tmp_path)}, script=OBSERVED, timeout=300).check()
    check_census(run.log, tmp_path, 2)
    assert int(CENSUS.search(run.log).group(2)) == tiny_model_parameters(swiglu=True)
