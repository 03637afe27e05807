"""Each expert-parallel rank resumes with its own expert RNG state (patch expert-rng-per-ep-rank):
after an EP2 torch_dist save and a resume in new processes, every rank's 'expert-parallel-rng'
tracker state equals the one it had when the checkpoint was saved. With the patch left out of the
resume (MEGATRON_PATCHES_DISABLE) megatron restores the RNG state per (PP, TP) rank only, and EP
rank 1 resumes with EP rank 0's expert RNG.

Both resumes load the same (patched) save: the patch only adds an entry to the saved RNG state,
which megatron's own load does not read, so the unpatched resume restores what it would from a
checkpoint saved without the patch (one state per (PP, TP) rank, written by DP rank 0)."""

from pathlib import Path

import pytest
import torch

from _launch import TINY_MODEL, launch

REPO = Path(__file__).resolve().parents[3]
OBSERVED = REPO / "tests" / "_observed_launch.py"
PATCH = "expert-rng-per-ep-rank"
NPROC = 2
ARGS = [*TINY_MODEL, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
        "alltoall", "--ckpt-format", "torch_dist", "--train-iters", "3"]
EXPERT_RNG = "expert-parallel-rng"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The checkpoint at iteration 2 and each rank's expert RNG state when it was saved."""
    directory = tmp_path_factory.mktemp("expert_rng")
    snapshots, checkpoint = directory / "saved", str(directory / "ckpt")
    snapshots.mkdir()
    launch(NPROC, [*ARGS, "--save", checkpoint, "--save-interval", "2", "--exit-interval", "2"],
           env={"SNAPSHOT_DIR": str(snapshots)}, script=OBSERVED).check()
    at_save = [torch.load(snapshots / f"rng_save_rank{r}.pt")[EXPERT_RNG] for r in range(NPROC)]
    assert not torch.equal(at_save[0], at_save[1])  # EP ranks draw from different streams
    return checkpoint, at_save


@pytest.mark.slow
@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
def test_every_ep_rank_resumes_with_its_own_expert_rng(saved, patched, tmp_path):
    checkpoint, at_save = saved
    loaded = tmp_path / "loaded"
    loaded.mkdir()
    log = launch(NPROC, [*ARGS, "--load", checkpoint], script=OBSERVED,
                 env={"SNAPSHOT_DIR": str(loaded),
                      "MEGATRON_PATCHES_DISABLE": "" if patched else PATCH}).check().log
    status = "applied" if patched else "skipped (disabled by MEGATRON_PATCHES_DISABLE)"
    assert f"[megatron_patches] {PATCH}: {status}" in log, log[-3000:]

    after_load = [torch.load(loaded / f"rng_load_rank{r}.pt")[EXPERT_RNG] for r in range(NPROC)]
    if patched:
        for rank in range(NPROC):
            assert torch.equal(after_load[rank], at_save[rank]), (
                f"rank {rank} (EP rank {rank}) resumed with another expert RNG state"
                + (" (EP rank 0's)" if torch.equal(after_load[rank], at_save[0]) else ""))
    else:  # megatron's own: every EP rank continues EP rank 0's expert stream
        assert all(torch.equal(state, at_save[0]) for state in after_load)
        assert not torch.equal(after_load[1], at_save[1])
