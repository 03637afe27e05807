"""fsdp-tp-rng-streams: Megatron-FSDP at TP2 (+ SP, dropout on) keeps each TP rank's own RNG
tracker streams, which megatron-core 0.19.2's adapter replaces with TP rank 0's when it wraps the
model.

The reference is megatron without Megatron-FSDP: the same model, flags and seed under megatron's
DDP, where `model_parallel_cuda_manual_seed` gives each TP rank its own 'model-parallel-rng'
stream and nothing overwrites it. Each run saves after its first iteration (its dropout draws
made) and tests/_observed_launch.py records every rank's tracker states at that save, and at a
load.

With each TP rank's streams its own, the silent half of fsdp-dtensor-rng-per-tp-rank shows: an
fsdp_dtensor resume without it (and without expert-rng-per-ep-rank, whose per-rank keys would
make it fail loudly, test_fsdp_etp_cpu.py) restores TP rank 0's streams on TP rank 1.
"""

import pytest
import torch

from _launch import REPO, TINY_MODEL, launch

pytestmark = pytest.mark.slow

OBSERVED = REPO / "tests" / "_observed_launch.py"
FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor",
        "--data-parallel-sharding-strategy", "optim_grads_params"]


def _with_dropout(args: list[str]) -> list[str]:
    args = list(args)
    for flag in ("--hidden-dropout", "--attention-dropout"):
        args[args.index(flag) + 1] = "0.1"
    return args


def _tracker_states(tmp_path, name: str, extra: list[str], env: dict | None = None,
                    event: str = "save") -> list[dict]:
    """Each rank's RNG tracker states at the save after iteration 1 (or at a load)."""
    directory = tmp_path / name
    directory.mkdir()
    checkpoint = ["--save", str(directory / "ckpt")] if event == "save" else []
    args = _with_dropout([*TINY_MODEL, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                          "--train-iters", "1", "--save-interval", "1", *checkpoint, *extra])
    launch(2, args, script=OBSERVED, env={"SNAPSHOT_DIR": str(directory), **(env or {})},
           timeout=300).check()
    return [torch.load(directory / f"rng_{event}_rank{rank}.pt") for rank in (0, 1)]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_each_tp_rank_keeps_its_own_streams_as_without_megatron_fsdp(tmp_path):
    ddp = _tracker_states(tmp_path, "ddp", [])
    fsdp = _tracker_states(tmp_path, "fsdp", FSDP)
    unpatched = _tracker_states(tmp_path, "unpatched", FSDP,
                                env={"MEGATRON_PATCHES_DISABLE": "fsdp-tp-rng-streams"})
    stream = "model-parallel-rng"
    # megatron's own design, without Megatron-FSDP: one stream per TP rank
    assert not torch.equal(ddp[0][stream], ddp[1][stream])
    # patched: every tracker state of every rank is the one megatron's DDP run has
    for rank in (0, 1):
        assert _equal(fsdp[rank], ddp[rank]), rank
    # unpatched: TP rank 1 continues TP rank 0's streams (the same dropout masks on both shards)
    assert _equal(unpatched[1], unpatched[0])
    assert _equal(unpatched[0], ddp[0]) and not torch.equal(unpatched[1][stream], ddp[1][stream])

    # fsdp_dtensor resumes of the patched run's checkpoint (saved at iteration 1)
    load = [*FSDP, "--load", str(tmp_path / "fsdp" / "ckpt")]
    resumed = _tracker_states(tmp_path, "resumed", load, event="load")
    assert all(_equal(resumed[rank], fsdp[rank]) for rank in (0, 1))
    rank0_everywhere = _tracker_states(
        tmp_path, "resumed-unpatched", load, event="load",
        env={"MEGATRON_PATCHES_DISABLE": "fsdp-dtensor-rng-per-tp-rank,expert-rng-per-ep-rank"})
    assert _equal(rank0_everywhere[0], fsdp[0]) and _equal(rank0_everywhere[1], fsdp[0])
