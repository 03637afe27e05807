"""Train, save torch_dist (or the legacy torch format), resume in a new process: the resumed
losses equal an uninterrupted run.

Real megatron-core pretrain() on CPU processes joined by gloo, one test per parallel layout.
The CPU path is deterministic (fixed seeds, OMP_NUM_THREADS=1, dropout 0, no atomics), so the
comparison is exact. The PP2 x VPP2 resume runs under torchrun, as users launch: new processes
that import megatron themselves continue bit for bit what ranks forked by the test harness
saved.
"""

import pytest

from moe_launcher.checkpoint_files import audit as checkpoint_audit

from _launch import TINY_MODEL, launch, printed_losses, tensorboard_scalars

K = 3  # iterations before the checkpoint; the runs go to 2K

# The 1-rank layout is bench/gpu_check.sh's local-spec step (same flags, same bit-exact check),
# which tests/bench/test_gpu_check.py runs; the allgather dispatcher is covered with TP2 x EP2. TP2 x EP2
# with all-to-all is in tp2-pp2-ep2, PP2 x EP2 in tp2-pp2-ep2 and pp2-vpp2-ep2 (and 2-rank EP2,
# ETP2 and PP2 HybridModel layouts resume in tests/moe_launcher/model/test_hybrid_model_cpu.py), to stay in CI's
# budget.
LAYOUTS = {
    "ep4": (4, ["--expert-model-parallel-size", "4"]),
    "etp2-ep2": (4, ["--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "2"]),
    # ETP defaults to TP; EP2 x ETP2 x PP2 would need 8 ranks, so experts use ETP 1.
    "tp2-pp2-ep2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                        "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                        "--sequence-parallel"]),
    "tp2-ep2-allgather": (4, ["--tensor-model-parallel-size", "2",
                              "--expert-model-parallel-size", "2", "--sequence-parallel",
                              "--moe-token-dispatcher-type", "allgather"]),
    # Interleaved (virtual) pipeline: 2 model chunks per pipeline rank, so 4 layers.
    "pp2-vpp2": (2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                     "--num-virtual-stages-per-pipeline-rank", "2"]),  # resumed by torchrun
    "pp2-vpp2-ep2": (4, ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                         "--num-virtual-stages-per-pipeline-rank", "2",
                         "--expert-model-parallel-size", "2"]),
    # The legacy torch format where ranks that share a file hold the same pieces: no false
    # refusal from torch-format-shard-guard (tests/megatron_patches/checkpointing/
    # test_torch_format_shards_cpu.py has the layouts it refuses).
    "torch-tp2-etp1-ep2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                               "--expert-model-parallel-size", "2",
                               "--expert-tensor-parallel-size", "1", "--ckpt-format", "torch"]),
    "torch-ep2": (2, ["--expert-model-parallel-size", "2", "--ckpt-format", "torch"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resume_matches_uninterrupted_run(layout, tmp_path):
    nproc, layout_args = LAYOUTS[layout]
    if "--moe-token-dispatcher-type" not in layout_args:
        layout_args = layout_args + ["--moe-token-dispatcher-type", "alltoall"]
    # (The torch format's distributed-optimizer state at --ckpt-step: torch-format-ckpt-step.)
    common = [*TINY_MODEL, "--use-distributed-optimizer", "--ckpt-format", "torch_dist",
              *layout_args,
              "--train-iters", str(2 * K), "--save-interval", str(K)]

    full = launch(nproc, [*common, "--save", str(tmp_path / "full"),
                          "--tensorboard-dir", str(tmp_path / "tb_full")]).check()
    assert (tmp_path / "full" / f"iter_{K:07d}").is_dir(), full.log[-3000:]

    resumed = launch(nproc, [*common, "--load", str(tmp_path / "full"), "--ckpt-step", str(K),
                             "--tensorboard-dir", str(tmp_path / "tb_resumed")],
                     torchrun=layout == "pp2-vpp2").check()
    assert f"successfully loaded checkpoint from {tmp_path / 'full'}" in resumed.log
    assert f"at iteration {K}" in resumed.log

    uninterrupted = tensorboard_scalars(tmp_path / "tb_full", "lm loss")
    after_resume = tensorboard_scalars(tmp_path / "tb_resumed", "lm loss")
    assert sorted(uninterrupted) == list(range(1, 2 * K + 1))
    assert sorted(after_resume) == list(range(K + 1, 2 * K + 1)), "resume did not start at K+1"
    for iteration in after_resume:
        assert after_resume[iteration] == uninterrupted[iteration], (
            f"iteration {iteration}: resumed loss {after_resume[iteration]!r} != "
            f"uninterrupted {uninterrupted[iteration]!r}")
    # Every line megatron prints is the loss of its iteration (--log-interval 1), the second
    # line of each process too (first-log-interval-reset): what users compare runs by.
    for run, written in ((full, uninterrupted), (resumed, after_resume)):
        assert printed_losses(run.log) == {i: f"{loss:.6E}" for i, loss in written.items()}
    if "torch" in layout_args:
        # The audit's reading of a torch-format save: every file the saved layout implies (by
        # megatron's RankGenerator) is the one megatron wrote, each from one piece.
        report = checkpoint_audit.audit_torch_format(str(tmp_path / "full" / f"iter_{K:07d}"))
        assert report.exit_status == checkpoint_audit.EXIT_COMPLETE, report
        assert report.layout.world == nproc and all(f["bytes"] for f in report.files), report
        written = {p.parent.name for p in (tmp_path / "full" / f"iter_{K:07d}").glob("*/*.pt")}
        assert written == {f["file"].split("/")[0] for f in report.files}, (written, report)
