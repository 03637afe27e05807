"""Each expert-parallel rank resumes with its own expert RNG state (patch expert-rng-per-ep-rank):
after an EP2 torch_dist save and a resume in new processes, every rank's 'expert-parallel-rng'
tracker state equals the one it had when the checkpoint was saved. Unpatched, megatron saves the
RNG state per (PP, TP) rank only, and EP rank 1 resumes with EP rank 0's expert RNG."""

from pathlib import Path

import pytest
import torch

from _launch import TINY_MODEL, launch

REPO = Path(__file__).resolve().parents[3]
OBSERVED = REPO / "tests" / "_observed_launch.py"
NPROC = 2
ARGS = [*TINY_MODEL, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
        "alltoall", "--ckpt-format", "torch_dist", "--train-iters", "3"]
EXPERT_RNG = "expert-parallel-rng"


@pytest.mark.slow
def test_every_ep_rank_resumes_with_its_own_expert_rng(tmp_path):
    saved, loaded = tmp_path / "saved", tmp_path / "loaded"
    saved.mkdir()
    loaded.mkdir()
    checkpoint = str(tmp_path / "ckpt")
    launch(NPROC, [*ARGS, "--save", checkpoint, "--save-interval", "2", "--exit-interval", "2"],
           env={"SNAPSHOT_DIR": str(saved)}, script=OBSERVED).check()
    launch(NPROC, [*ARGS, "--load", checkpoint], env={"SNAPSHOT_DIR": str(loaded)},
           script=OBSERVED).check()

    at_save = [torch.load(saved / f"rng_save_rank{r}.pt")[EXPERT_RNG] for r in range(NPROC)]
    after_load = [torch.load(loaded / f"rng_load_rank{r}.pt")[EXPERT_RNG] for r in range(NPROC)]
    assert not torch.equal(at_save[0], at_save[1])  # EP ranks draw from different streams
    for rank in range(NPROC):
        assert torch.equal(after_load[rank], at_save[rank]), (
            f"rank {rank} (EP rank {rank}) resumed with another expert RNG state"
            + (" (EP rank 0's)" if torch.equal(after_load[rank], at_save[0]) else ""))
