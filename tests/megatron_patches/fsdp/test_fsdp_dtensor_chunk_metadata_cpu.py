"""fsdp-dtensor-batched-chunk-metadata: Megatron-FSDP's model wrap and an fsdp_dtensor save find
every shard's chunk with a few collectives, and what DCP writes is what megatron-core 0.19.2's
own per-tensor code gives.

Real pretrain_moe.py runs on 4 gloo ranks (Megatron-FSDP, optim_grads_params, SwiGLU, the
distributed optimizer; EP1 x ETP2, TP2 x SP x EP2, HSDP x TP2) save once;
tests/_observed_launch.py ($CHUNK_DIR) counts the collectives megatron's
`preprocess_fsdp_dtensor_state_dict` runs and compares, for every DTensor of the state dict it
returns (model and optimizer states, the SwiGLU halves, empty shards), the chunk and DCP
write items it carries with the ones megatron's `update_uneven_dtensor_chunk_metadata` gives
(the reference); the same for Megatron-FSDP's wrap of the model (`ParamAndGradBuffer`, the main
weights' DTensors). The patched and the unpatched run of one layout write the same checkpoint
metadata. A 2-rank worker checks that the batched validation refuses what megatron's
`validate_uneven_dtensor` refuses.
"""

import json
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from _launch import REPO, launch, tiny_model

pytestmark = pytest.mark.slow

PATCH = "fsdp-dtensor-batched-chunk-metadata"
OBSERVED = REPO / "tests" / "_observed_launch.py"
FSDP = [*tiny_model(4), "--use-megatron-fsdp", "--use-distributed-optimizer", "--ckpt-format",
        "fsdp_dtensor", "--moe-token-dispatcher-type", "alltoall",
        "--data-parallel-sharding-strategy", "optim_grads_params", "--train-iters", "1",
        "--save-interval", "1"]
# layout -> (flags, a mesh its DTensors lie on besides the data-parallel one)
LAYOUTS = {
    # experts sharded over ETP 2 and expert data parallelism 2, dense weights over DP 4
    "etp2-ep1": (["--expert-tensor-parallel-size", "2"], "(2, 2)"),
    # dense weights split by TP 2 (+ SP): the SwiGLU halves are TP-sharded DTensors too
    "tp2-sp-ep2-etp1": (["--tensor-model-parallel-size", "2", "--sequence-parallel",
                         "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size",
                         "1"], "(2, 2)"),
    # hybrid FSDP (HSDP: 2 optimizer instances, optimizer states sharded over both) with TP 2:
    # 3-D meshes with megatron's explicit shard order
    "hsdp-tp2": (["--num-distributed-optimizer-instances", "2", "--outer-dp-sharding-strategy",
                  "optim", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
                 "(2, 1, 2)"),
}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """(layout, patched) -> the directory of its run (ckpt/, chunks/): one iteration, one save.
    Each run once per module."""
    runs = {}

    def run(layout: str, patched: bool = True) -> Path:
        if (layout, patched) not in runs:
            directory = tmp_path_factory.mktemp(f"{layout}-{'patched' if patched else 'unpatched'}")
            (directory / "chunks").mkdir()
            env = {"CHUNK_DIR": str(directory / "chunks")}
            if not patched:
                env["MEGATRON_PATCHES_DISABLE"] = PATCH
            log = launch(4, [*FSDP, *LAYOUTS[layout][0], "--save", str(directory / "ckpt")],
                         env=env, script=OBSERVED, timeout=400).check().log
            verdict = "applied" if patched else "skipped"
            assert f"[megatron_patches] {PATCH}: {verdict}" in log
            runs[layout, patched] = directory
        return runs[layout, patched]

    return run


def observed(directory: Path, call: str = "chunks_call0") -> list[dict]:
    """Every rank's report of the save (chunks_call0) or of the model wrap (buffer0)."""
    calls = sorted((directory / "chunks").glob(f"{call}_rank*.json"))
    assert len(calls) == 4, calls  # one save, one buffer, every rank
    return [json.loads(path.read_text()) for path in calls]


def collectives(rank: dict) -> int:
    return sum(rank["collectives"].values())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_chunk_is_megatrons_with_a_few_collectives(layout, saved_run):
    directory = saved_run(layout)
    ranks = observed(directory)
    for rank in ranks:
        assert rank["differ"] == [], rank["differ"][:5]
        assert rank["dtensors"] > 50  # model, optimizer states, SwiGLU halves
        # Rounds (sharded mesh dims) x process groups, plus the halves' validation: not per
        # tensor.
        assert collectives(rank) <= 40, rank["collectives"]
    assert any(rank["empty"] for rank in ranks)  # small parameters live on one rank only
    placements = {p for rank in ranks for p in rank["placements"]}
    assert any(p.startswith(LAYOUTS[layout][1]) for p in placements), placements
    # Wrapping the model: the main weights' DTensors, each with megatron's chunk.
    for rank in observed(directory, "buffer0"):
        assert rank["differ"] == [] and rank["dtensors"] > 15, rank
        assert collectives(rank) - rank["collectives"].get("broadcast", 0) <= 15, rank


def test_unpatched_save_runs_collectives_per_tensor_and_writes_the_same_metadata(saved_run):
    patched, unpatched = saved_run("etp2-ep1"), saved_run("etp2-ep1", patched=False)
    for with_patch, without in zip(observed(patched), observed(unpatched)):
        assert with_patch["dtensors"] == without["dtensors"]
        assert without["differ"] == []
        # megatron: several object gathers per DTensor
        assert without["collectives"]["all_gather_object"] >= 2 * without["dtensors"], without
        assert collectives(with_patch) * 10 < collectives(without)
    for with_patch, without in zip(observed(patched, "buffer0"), observed(unpatched, "buffer0")):
        assert with_patch["dtensors"] == without["dtensors"] and without["differ"] == []
        assert without["collectives"]["all_gather_object"] >= 2 * without["dtensors"], without
        assert collectives(with_patch) * 10 < collectives(without)
    metadata = [dcp.FileSystemReader(str(run / "ckpt" / "iter_0000001")).read_metadata()
                for run in (patched, unpatched)]
    chunks = [{key: sorted((tuple(c.offsets), tuple(c.sizes)) for c in value.chunks)
               for key, value in m.state_dict_metadata.items() if hasattr(value, "chunks")}
              for m in metadata]
    assert len(chunks[0]) > 50 and chunks[0] == chunks[1]
    sizes = [{key: tuple(value.size) for key, value in m.state_dict_metadata.items()
              if hasattr(value, "size")} for m in metadata]
    assert sizes[0] == sizes[1]


def test_validation_refuses_what_megatrons_refuses():
    """Reference: megatron-core's validate_uneven_dtensor, per DTensor, on the same shards."""
    log = launch(2, [], script=REPO / "tests" / "_chunk_validation_worker.py",
                 timeout=120).check().log
    ranks = json.loads(next(line for line in log.splitlines() if line.startswith("[{")))
    for results in ranks:
        assert results.pop("all_at_once") == "refused: bounds"  # bounds come first, as megatron's
        assert results.pop("valid_ones_at_once") == "valid"
        for case, result in results.items():
            assert result["chunk_equal"], case
            assert result["batched"] == result["megatron"], (case, result)
        assert results["uneven"]["megatron"] == "valid"
        assert results["gap_at_the_end"]["megatron"] == "refused: boundary"
        assert results["past_the_end"]["megatron"] == "refused: bounds"


def test_ranks_offering_different_tensors_stop_with_an_error_not_a_hang(tmp_path):
    """fsdp-dtensor-optimizer-keys left out (Megatron-LM #4910): after the first step the ranks
    offer different optimizer keys, and megatron's per-tensor gathers hang the save
    (test_fsdp_etp_cpu.py). The batched gathers count each group's shards first: every rank
    stops with an error saying so, and nothing is committed."""
    run = launch(2, [*FSDP, *LAYOUTS["etp2-ep1"][0], "--save", str(tmp_path / "ckpt")],
                 env={"MEGATRON_PATCHES_DISABLE": "fsdp-dtensor-optimizer-keys"}, timeout=300)
    assert run.returncode != 0, run.log[-3000:]
    for rank in (0, 1):
        assert (f"failed on rank {rank}: RuntimeError: the ranks of one group offer different "
                "numbers of DTensor shards") in run.log, run.log[-3000:]
    assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()
