"""Patch fsdp-model-to-main-weights (issue 40 item 2): Megatron-FSDP in bf16 loads weights
without their optimizer state (--no-load-optim here; --finetune and an import's release
checkpoint take the same path, megatron's reload_model_params) and trains on from them.

Reference: megatron's own DDP path (distributed optimizer, torch_dist) doing the same resume
from the same uninterrupted run (the same CPU initialisation, whatever the layout): the resumed
losses agree to 1e-4. Stale main weights would show at iteration 4: the optimizer's first step
would write the initial weights back (iteration 2's loss level). Without the patch every rank
raises megatron's NotImplementedError after the load.
"""

from __future__ import annotations

import pytest

from _launch import TINY_MODEL, launch, tensorboard_scalars

pytestmark = pytest.mark.slow

NAME = "fsdp-model-to-main-weights"
PATHS = {
    "fsdp": ["--use-megatron-fsdp", "--use-distributed-optimizer", "--ckpt-format",
             "fsdp_dtensor", "--moe-token-dispatcher-type", "alltoall"],
    "ddp": ["--use-distributed-optimizer", "--ckpt-format", "torch_dist",
            "--moe-token-dispatcher-type", "alltoall"],
}


def args(path: str) -> list[str]:
    return [*TINY_MODEL, *PATHS[path], "--train-iters", "4"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """path -> its uninterrupted run's folder: iterations 1-4 on 2 ranks, saved at 2."""
    root = tmp_path_factory.mktemp("model_to_main")
    for path in PATHS:
        launch(2, [*args(path), "--save", str(root / path / "ckpt"), "--save-interval", "2",
                   "--tensorboard-dir", str(root / path / "tb")], timeout=300).check()
    return root


def resumed(saved, path: str, tb, env=None):
    return launch(2, [*args(path), "--load", str(saved / path / "ckpt"), "--ckpt-step", "2",
                      "--no-load-optim", "--tensorboard-dir", str(tb)], timeout=300, env=env)


def test_fsdp_resumes_without_optimizer_state_as_ddp_does(saved, tmp_path):
    resumed(saved, "fsdp", tmp_path / "fsdp").check()
    resumed(saved, "ddp", tmp_path / "ddp").check()
    fsdp = tensorboard_scalars(tmp_path / "fsdp", "lm loss")
    ddp = tensorboard_scalars(tmp_path / "ddp", "lm loss")
    assert sorted(fsdp) == sorted(ddp) == [3, 4]
    assert all(fsdp[i] == pytest.approx(ddp[i], rel=1e-4) for i in fsdp), (fsdp, ddp)
    uninterrupted = tensorboard_scalars(saved / "fsdp" / "tb", "lm loss")
    assert fsdp[3] == pytest.approx(uninterrupted[3], rel=1e-6)  # the saved weights
    assert fsdp[4] != pytest.approx(uninterrupted[4], rel=1e-4)  # a fresh optimizer's step


def test_unpatched_every_rank_fails_after_the_load(saved, tmp_path):
    run = resumed(saved, "fsdp", tmp_path / "tb", env={"MEGATRON_PATCHES_DISABLE": NAME})
    assert run.exit_codes == [1, 1], run.log[-3000:]
    assert run.log.count("NotImplementedError: Megatron-FSDP does not implement a "
                         "model-to-main parameter update") == 2, run.log[-3000:]
    assert not tensorboard_scalars(tmp_path / "tb", "lm loss")
