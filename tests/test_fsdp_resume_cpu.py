"""Megatron-FSDP resumes from an fsdp_dtensor checkpoint exactly where it stopped (megatron-core
0.19.x through pretrain_moe.py, 2 CPU ranks, gloo).

One layout: ETP 2 on 2 ranks with `optim_grads_params`, so the dense weights are sharded over
data parallelism (2) and the expert weights over ETP (the fsdp-expert-etp-mesh patch), and small
parameters are empty on one rank (the fsdp-dtensor-optimizer-keys patch). The checkpoint is
taken after step 1; the resumed run's iteration-2 loss checks the restored weights, its
iteration-3 loss the restored optimizer state (Adam moments and step).

Losses are read from tensorboard, one value per iteration. megatron's stdout line is not a
per-iteration value: `training_log` does not reset its loss sums at a process's first iteration
(`should_reset = not is_first_iteration`), so even with --log-interval 1 the second line a
process prints averages two iterations. The uninterrupted run prints (loss1 + loss2) / 2 at
iteration 2 while the resumed run prints loss2 alone; comparing those lines looks like a resume
bug that is not there.
"""

import pytest

from _launch import TINY_MODEL, launch, tensorboard_scalars

ITERS = 3
SAVED_AT = 1


@pytest.mark.slow
def test_resume_matches_uninterrupted_run(tmp_path):
    common = [*TINY_MODEL, "--expert-tensor-parallel-size", "2",
              "--data-parallel-sharding-strategy", "optim_grads_params",
              "--moe-token-dispatcher-type", "alltoall", "--use-megatron-fsdp",
              "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor",
              "--train-iters", str(ITERS)]
    launch(2, [*common, "--save-interval", str(SAVED_AT), "--save", str(tmp_path / "full"),
               "--tensorboard-dir", str(tmp_path / "tb_full")], timeout=400).check()
    resumed = launch(2, [*common, "--load", str(tmp_path / "full"), "--ckpt-step", str(SAVED_AT),
                         "--tensorboard-dir", str(tmp_path / "tb_resumed")], timeout=400).check()
    assert f"successfully loaded checkpoint from {tmp_path / 'full'}" in resumed.log
    assert f"at iteration {SAVED_AT}" in resumed.log

    uninterrupted = tensorboard_scalars(tmp_path / "tb_full", "lm loss")
    after_resume = tensorboard_scalars(tmp_path / "tb_resumed", "lm loss")
    assert sorted(uninterrupted) == list(range(1, ITERS + 1))
    assert sorted(after_resume) == list(range(SAVED_AT + 1, ITERS + 1))
    for iteration in after_resume:
        assert after_resume[iteration] == uninterrupted[iteration], (
            f"iteration {iteration}: resumed loss {after_resume[iteration]!r} != "
            f"uninterrupted {uninterrupted[iteration]!r}")
