"""Megatron-FSDP with expert (tensor) parallelism through pretrain_moe.py on megatron-core 0.19.x,
4 CPU ranks, gloo, fsdp_dtensor checkpoints, the distributed optimizer, every patch on:

* each layout x sharding strategy trains, saves a checkpoint the audit CLI passes with every
  expert tensor at its true (whole, not per-ETP-rank) global shape, and resumes in new processes
  exactly where it stopped: the resumed run's losses equal the uninterrupted run's bit for bit
  (the CPU path is deterministic: same reduction order, no atomics). EP2 x ETP2 with
  optim_grads_params trains, saves and resumes under torchrun, as users launch;
* an ETP2 checkpoint on 4 ranks loads into ETP1 on 2 ranks (another DP size) with identical
  weights;
* a SIGKILL of a rank during an fsdp_dtensor save (ETP2 on 2 ranks, under torchrun, which then
  stops the other rank) leaves the tracker naming the previous checkpoint, which the audit
  passes and a restart resumes from;
* the parameter census (#1778), whose figures are megatron's theoretical-memory line: the total
  counts DTensor global sizes (the model's parameters, as without FSDP), the most loaded rank
  and the weight+optimizer memory are what the ranks keep in Megatron-FSDP's buffers and the
  optimizer's states after the first step (tests/_observed_launch.py measures them).
  Megatron-FSDP keeps gradients in the parameters' dtype (bf16) by default, not megatron's
  fp32; and `optim_grads` keeps whole weights next to sharded gradients and optimizer state;
* in fp32 (no --bf16) Megatron-FSDP divides gradients inside the reduction, an NCCL PREMUL_SUM
  that gloo lacks: the CPU backend bridges it. The fp32 run (ETP2, 2 ranks) also saves and
  resumes bit-exactly, which megatron-core 0.19.2 cannot do without the
  fsdp-dtensor-fp32-swiglu-keys patch: its fsdp_dtensor save looks each SwiGLU fc1 weight up one
  `module.` level deeper than an fp32 model has (bf16's Float16Module adds that level) and fails,
  "GPTModel has no attribute `module`".

What the runs go through: the fsdp-dtensor-optimizer-keys patch (Megatron-LM#4910; small
parameters are empty on some ranks, which then hold no optimizer state for them, and the save
hung), the fsdp-expert-etp-mesh patch (experts sharded over ETP), atomic-checkpoint-commit and
checkpoint-load-integrity. `no_shard` runs a model without SwiGLU: megatron-core 0.19.2 cannot
save a SwiGLU model's optimizer under no_shard (handle_swiglu_in_state_dict reads
megatron_fsdp_slice, which only sharded strategies set; Megatron-LM#5265).

Losses are read from tensorboard, one value per iteration. megatron's stdout line is not a
per-iteration value: `training_log` does not reset its loss sums at a process's first iteration
(`should_reset = not is_first_iteration`), so the second line a process prints averages two
iterations; comparing those lines looks like a resume bug that is not there.
"""

import json
import re
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from _launch import REPO, LiveRun, audit_report, launch, tensorboard_scalars, tiny_model
from moe_launcher.checkpoint_files.commit_protocol import TRACKER

pytestmark = pytest.mark.slow

ITERS, SAVED_AT = 4, 2
# TINY_MODEL with 4 experts instead of 8: half the expert weights and optimizer states to train,
# save and load (unpatched, megatron's fsdp_dtensor save ran collectives per tensor: ~6 s of an
# 8-expert run that saves twice; see fsdp-dtensor-batched-chunk-metadata). 4 experts still split
# over EP 2 and ETP 2.
EXPERTS = 4
MODEL = tiny_model(EXPERTS)
FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor",
        "--moe-token-dispatcher-type", "alltoall"]
LAYOUTS = {
    # experts sharded over ETP 2 and expert data parallelism 2; dense weights over DP 4
    "etp2-ep1": ["--expert-tensor-parallel-size", "2"],
    # EP 2 x ETP 2 uses all 4 ranks: expert data parallelism 1
    "ep2-etp2": ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"],
    # dense weights split by TP 2 (+ SP), experts whole (ETP 1) over EP 2
    "tp2-sp-ep2-etp1": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                        "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"],
}
STRATEGIES = ("optim_grads_params", "no_shard")
UNDER_TORCHRUN = ("ep2-etp2", "optim_grads_params")
HOOKED = REPO / "tests" / "_commit_hooks_launch.py"
OBSERVED = REPO / "tests" / "_observed_launch.py"
CENSUS = re.compile(r"parameters of the model built: total (\d+), most loaded rank (\d+)")
MEMORY = re.compile(r"weight and optimizer memory on the most loaded rank: ([0-9.]+) MB")
MEGATRON_REPORT = re.compile(r"Theoretical memory footprints: weight and optimizer=([0-9.]+) MB")


def tiny_model_parameters(swiglu: bool) -> int:
    """MODEL's parameters, counted from its sizes: per layer QKV and output projections, two
    RMSNorms, the router and the experts (fc1 doubled by SwiGLU, fc2); then the final norm, and
    the untied embedding and output layer (vocabulary 512)."""
    hidden, ffn, experts, vocab = 64, 64, EXPERTS, 512
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


def fsdp_args(layout: str, strategy: str) -> list[str]:
    model = [flag for flag in MODEL if not (strategy == "no_shard" and flag == "--swiglu")]
    return [*model, *FSDP, *LAYOUTS[layout], "--data-parallel-sharding-strategy", strategy,
            "--train-iters", str(ITERS)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """(layout, strategy) -> the directory of its uninterrupted run: ITERS iterations, saving at
    SAVED_AT and at the end (ckpt/), losses in tb/. Each run once per module."""
    runs = {}

    def run(layout: str, strategy: str) -> Path:
        if (layout, strategy) not in runs:
            directory = tmp_path_factory.mktemp(f"{layout}-{strategy}")
            run = launch(4, [*fsdp_args(layout, strategy), "--save", str(directory / "ckpt"),
                             "--save-interval", str(SAVED_AT),
                             "--tensorboard-dir", str(directory / "tb")],
                         env={"MEMORY_DIR": str(directory)}, script=OBSERVED, timeout=400,
                         torchrun=(layout, strategy) == UNDER_TORCHRUN)
            (directory / "run.log").write_text(run.check().log)
            runs[layout, strategy] = directory
        return runs[layout, strategy]

    return run


def model_tensors(iteration_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(str(iteration_dir), str(out))
    model = torch.load(out, weights_only=False)["model"]
    return {k: v for k, v in model.items() if torch.is_tensor(v)}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_saves_an_audited_checkpoint_and_resumes_where_it_stopped(layout, strategy,
                                                                  uninterrupted, tmp_path):
    full = uninterrupted(layout, strategy)
    check_census((full / "run.log").read_text(), full, 4, swiglu=strategy != "no_shard")
    if strategy == "optim_grads_params":  # what fsdp-dtensor-optimizer-keys saves past
        held = [json.loads((full / f"memory_rank{rank}.json").read_text()) for rank in range(4)]
        assert any(rank["without_state"] for rank in held), held
    report = audit_report(full / "ckpt" / f"iter_{SAVED_AT:07d}")
    assert report["format"] == "fsdp_dtensor"
    experts = [t for t in report["tensors"] if t["expert"] and t["key"].startswith("model.")]
    # 2 layers x the experts x (fc1, split into weight_w/weight_v by megatron for SwiGLU; fc2)
    assert len(experts) == 2 * EXPERTS * (2 if strategy == "no_shard" else 3)
    for tensor in experts:
        assert tensor["global_shape"] == tensor["expected_shape"] == [64, 64], tensor
    assert report["expert_saved_bytes"] == report["expert_expected_bytes"]

    resumed = launch(4, [*fsdp_args(layout, strategy), "--load", str(full / "ckpt"),
                         "--ckpt-step", str(SAVED_AT), "--tensorboard-dir", str(tmp_path / "tb")],
                     timeout=400, torchrun=(layout, strategy) == UNDER_TORCHRUN).check()
    assert f"at iteration {SAVED_AT}" in resumed.log, resumed.log[-3000:]
    before = tensorboard_scalars(full / "tb", "lm loss")
    after = tensorboard_scalars(tmp_path / "tb", "lm loss")
    assert sorted(before) == list(range(1, ITERS + 1))
    assert sorted(after) == list(range(SAVED_AT + 1, ITERS + 1))
    for iteration in after:
        assert after[iteration] == before[iteration], (
            f"iteration {iteration}: resumed loss {after[iteration]!r} != uninterrupted "
            f"{before[iteration]!r}")



def test_unpatched_tp2_resume_fails_on_every_rank(uninterrupted, tmp_path):
    """fsdp-dtensor-rng-per-tp-rank left out: megatron's fsdp_dtensor load asks every TP rank
    for the "(PP 0, TP 0)" RNG entry, which holds TP rank 0's expert streams only (the
    expert-rng-per-ep-rank patch keys them by (EP, ETP) rank; ETP = TP here), so TP rank 1's
    key is missing and the resume fails on every rank. Without both patches it loads and
    restores TP rank 0's streams on every TP rank (test_fsdp_tp_rng_streams_cpu.py)."""
    layout = "tp2-sp-ep2-etp1"
    full = uninterrupted(layout, "optim_grads_params")
    failed = launch(4, [*fsdp_args(layout, "optim_grads_params"), "--load", str(full / "ckpt"),
                        "--ckpt-step", str(SAVED_AT)],
                    env={"MEGATRON_PATCHES_DISABLE": "fsdp-dtensor-rng-per-tp-rank"}, timeout=400)
    assert failed.returncode != 0, failed.log[-3000:]
    missing = re.findall(r"\[rank(\d)\]: RuntimeError: Missing key in checkpoint state_dict: "
                         r"rng_state\.\(0, 0\)\.0\.expert_rng_states_by_ep_etp_rank", failed.log)
    assert sorted(set(missing)) == ["0", "1", "2", "3"], failed.log[-3000:]

def test_etp2_checkpoint_loads_into_etp1_on_another_dp_size(uninterrupted, tmp_path):
    source = uninterrupted("etp2-ep1", "optim_grads_params") / "ckpt"
    resaved = tmp_path / "etp1"
    # --train-iters SAVED_AT: nothing to train after the load; megatron saves what it loaded
    # (with the checkpoint's learning-rate schedule, which the shorter run would otherwise refuse).
    args = [*fsdp_args("etp2-ep1", "optim_grads_params"), "--expert-tensor-parallel-size", "1",
            "--train-iters", str(SAVED_AT), "--use-checkpoint-opt_param-scheduler"]
    run = launch(2, [*args, "--load", str(source), "--ckpt-step", str(SAVED_AT),
                     "--save", str(resaved), "--save-interval", "1000"], timeout=400).check()
    assert f"at iteration {SAVED_AT}" in run.log, run.log[-3000:]
    saved = model_tensors(source / f"iter_{SAVED_AT:07d}", tmp_path / "etp2.pt")
    loaded = model_tensors(resaved / f"iter_{SAVED_AT:07d}", tmp_path / "etp1.pt")
    assert saved.keys() == loaded.keys() and len(saved) > 20
    unequal = [key for key in saved if not torch.equal(saved[key], loaded[key])]
    assert not unequal, unequal


def test_sigkill_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    save, gate = tmp_path / "ckpt", tmp_path / "gate"
    args = [*fsdp_args("etp2-ep1", "optim_grads_params"), "--save", str(save), "--load", str(save),
            "--save-interval", "1"]
    # Held after megatron's save of iteration 2 returned and before the commit renames it.
    run = LiveRun(args, nproc=2, script=HOOKED, torchrun=True,
                  env={"COMMIT_HOOK": f"commit:iter_{2:07d}:wait={gate}"})
    try:
        deadline = time.monotonic() + 400
        while not Path(f"{gate}.reached").exists():
            assert time.monotonic() < deadline and run.proc.poll() is None, run.log()[-3000:]
            time.sleep(0.2)
        run.rank(1).kill()
        run.finish(120)
    finally:
        run.stop()
    assert (save / TRACKER).read_text().strip() == "1"
    assert audit_report(save / f"iter_{1:07d}")["format"] == "fsdp_dtensor"
    restarted = launch(2, args, timeout=400).check()
    assert "at iteration 1" in restarted.log and f"iteration        {ITERS}/" in restarted.log
    assert (save / TRACKER).read_text().strip() == str(ITERS)


def test_fp32_trains_saves_and_resumes_where_it_stopped(tmp_path):
    """fp32 gradient reduction: without the CPU backend's bridge every rank fails its first step
    ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). The fp32 checkpoint is audited like the bf16
    ones and the resumed run's losses equal the uninterrupted run's bit for bit; without
    fsdp-dtensor-fp32-swiglu-keys the first save fails."""
    fp32_model = [flag for flag in MODEL if flag != "--bf16"]
    args = [*fp32_model, *FSDP, *LAYOUTS["etp2-ep1"],
            "--data-parallel-sharding-strategy", "optim_grads_params", "--train-iters", str(ITERS)]
    full, resumed_tb = tmp_path / "full", tmp_path / "resumed-tb"
    run = launch(2, [*args, "--save", str(full / "ckpt"), "--save-interval", str(SAVED_AT),
                     "--tensorboard-dir", str(full / "tb")], timeout=300).check()
    assert f"iteration        {ITERS}/       {ITERS}" in run.log
    report = audit_report(full / "ckpt" / f"iter_{SAVED_AT:07d}")
    experts = [t for t in report["tensors"] if t["expert"] and t["key"].startswith("model.")]
    assert len(experts) == 2 * EXPERTS * 3  # fc1 split into weight_w/weight_v as in bf16, and fc2
    assert all(t["global_shape"] == t["expected_shape"] == [64, 64] for t in experts), experts

    resumed = launch(2, [*args, "--load", str(full / "ckpt"), "--ckpt-step", str(SAVED_AT),
                         "--tensorboard-dir", str(resumed_tb)], timeout=300).check()
    assert f"at iteration {SAVED_AT}" in resumed.log, resumed.log[-3000:]
    before = tensorboard_scalars(full / "tb", "lm loss")
    after = tensorboard_scalars(resumed_tb, "lm loss")
    assert sorted(before) == list(range(1, ITERS + 1))
    assert sorted(after) == list(range(SAVED_AT + 1, ITERS + 1))
    assert after == {iteration: before[iteration] for iteration in after}, (after, before)

    unpatched = tmp_path / "unpatched"
    failed = launch(2, [*args, "--train-iters", "1", "--save", str(unpatched),
                        "--save-interval", "1"],
                    env={"MEGATRON_PATCHES_DISABLE": "fsdp-dtensor-fp32-swiglu-keys"},
                    timeout=300)
    assert failed.returncode != 0
    failure = "saving iteration 1 to .* AttributeError: GPTModel has no attribute `module`"
    assert re.search(failure, failed.log), failed.log[-3000:]
    assert not (unpatched / TRACKER).exists()


def test_census_of_optim_grads_keeps_whole_weights(tmp_path):
    """The one strategy that shards gradients but not weights (2 ranks, one step)."""
    run = launch(2, [*MODEL, "--use-megatron-fsdp", "--use-distributed-optimizer",
                     "--ckpt-format", "fsdp_dtensor",
                     "--data-parallel-sharding-strategy", "optim_grads", "--train-iters", "1"],
                 env={"MEMORY_DIR": str(tmp_path)}, script=OBSERVED, timeout=300).check()
    check_census(run.log, tmp_path, 2)
    assert int(CENSUS.search(run.log).group(2)) == tiny_model_parameters(swiglu=True)



def test_unpatched_optimizer_save_hangs_where_a_rank_holds_empty_shards(tmp_path):
    """fsdp-dtensor-optimizer-keys left out (Megatron-LM #4910): after the first step some rank's
    optimizer holds parameters without state (their shard is empty there), so the ranks offer
    different optimizer keys and the save's per-key collectives never pair up: 20 s after megatron
    began storing the optimizer state (a patched save of this model takes under a second here)
    no rank has finished and every rank is alive, waiting. Stopped by the test.
    fsdp-dtensor-batched-chunk-metadata is left out too: it counts each group's shards before it
    gathers them, so with it the ranks stop with an error instead of hanging."""
    args = [*fsdp_args("etp2-ep1", "optim_grads_params"), "--train-iters", "1",
            "--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    run = LiveRun(args, nproc=2, script=OBSERVED,
                  env={"MEGATRON_PATCHES_DISABLE": "fsdp-dtensor-optimizer-keys,"
                                                   "fsdp-dtensor-batched-chunk-metadata",
                       "MEMORY_DIR": str(tmp_path)})
    try:
        storing = "Storing distributed optimizer sharded state of type fsdp_dtensor"
        assert run.wait_for(storing, 1, time.monotonic() + 300), run.log()[-3000:]
        assert not run.wait_for("successfully saved", 1, time.monotonic() + 20), run.log()[-3000:]
        assert run.proc.poll() is None and len(run.ranks()) == 2, run.log()[-3000:]
    finally:
        run.stop()
    assert "fsdp-dtensor-optimizer-keys: skipped (disabled by MEGATRON_PATCHES_DISABLE)" in run.log()
    held = [json.loads((tmp_path / f"memory_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert any(rank["without_state"] for rank in held), held
    assert not (tmp_path / "ckpt" / TRACKER).exists()
