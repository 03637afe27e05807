"""Distributed optimizer + torch Adam: the optimizer state after a load equals the state at save,
on every rank (megatron 0.19.2 without TE/apex shares one Adam `step` among all parameters after
a load and copies the pre-load step back; patch distopt-torch-adam-resume fixes both)."""

from pathlib import Path

import torch

from _launch import TINY_MODEL, launch

REPO = Path(__file__).resolve().parents[3]
OBSERVED = REPO / "tests" / "_observed_launch.py"
NPROC = 4
ARGS = [*TINY_MODEL, "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--use-distributed-optimizer", "--train-iters", "4"]


def test_optimizer_state_after_load_equals_state_at_save(tmp_path):
    (tmp_path / "saved").mkdir()
    (tmp_path / "loaded").mkdir()
    launch(NPROC, [*ARGS, "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                   "--exit-interval", "2"], env={"SNAPSHOT_DIR": str(tmp_path / "saved")},
           script=OBSERVED).check()
    launch(NPROC, [*ARGS, "--load", str(tmp_path / "ckpt"), "--exit-interval", "3"],
           env={"SNAPSHOT_DIR": str(tmp_path / "loaded")}, script=OBSERVED).check()

    for rank in range(NPROC):
        at_save = torch.load(tmp_path / "saved" / f"save_rank{rank}.pt")
        after_load = torch.load(tmp_path / "loaded" / f"load_rank{rank}.pt")
        assert at_save.keys() == after_load.keys(), f"rank {rank}: different optimizer state keys"
        steps = [key for key in at_save if key.endswith(".step")]
        assert steps and all(at_save[key].item() == 2 for key in steps), f"rank {rank}"
        for key, saved in at_save.items():
            assert torch.equal(saved, after_load[key]), f"rank {rank}: {key} differs after load"


def test_without_the_patch_the_load_fails(tmp_path):
    launch(NPROC, [*ARGS, "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                   "--exit-interval", "2"]).check()
    unpatched = launch(NPROC, [*ARGS, "--load", str(tmp_path / "ckpt"), "--exit-interval", "3"],
                       env={"MEGATRON_PATCHES_DISABLE": "distopt-torch-adam-resume"})
    assert unpatched.returncode != 0
    assert "distopt-torch-adam-resume: skipped (disabled by MEGATRON_PATCHES_DISABLE)" in unpatched.log
    assert "assert len(steps) == 1" in unpatched.log
