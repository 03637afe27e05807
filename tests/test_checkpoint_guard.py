"""The save and load guards against Megatron-LM #1836, in real 2-rank gloo runs.

tests/_ckpt_worker.py `guards` applies both patches through the registry, saves a good ETP=2
checkpoint, tries to save a #1836-shaped layout on top of it, then loads the damaged and a good
checkpoint; each rank reports what happened (see _ckpt_worker's module doc for the damage).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_patches import checkpoint_audit, checkpoint_guard, registry

from _checkpoints import guard_results, run_scenario
from _damage_metadata import damage_like_1836
from _launch import TINY_MODEL
from _launch import launch as launch_2_ranks
from _ckpt_worker import model_args

FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
FC2 = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
# Expert tensor parallelism 2 on two ranks (EP=1, DP=2), the layout #1836 broke.
ETP2 = ["--expert-tensor-parallel-size", "2", "--ckpt-format", "torch_dist"]


@pytest.mark.slow
def test_save_guard_refuses_damaged_layout_on_every_rank_and_touches_nothing():
    out, results = guard_results()
    root = os.path.join(out, "guarded")
    for rank, result in enumerate(results):
        refusal = result["damaged_save"]
        assert refusal and refusal.startswith("IncompleteCheckpointError"), (rank, refusal)
        assert f"{FC1}: global shape [2, 8, 48, 32] but the config implies ['*', 8, 96, 32]" in refusal
        assert "main replicas: 32 chunks of [1, 1, 24, 32]; missing fraction 50.0%" in refusal
        assert FC2 in refusal
    # The previous checkpoint and the tracker are byte-for-byte where they were.
    assert results[0]["files_after_damaged_save"] == results[0]["files_before_damaged_save"]
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "1"
    assert os.listdir(os.path.join(root, "iter_0000002")) == []
    assert checkpoint_audit.audit(root).exit_status == checkpoint_audit.EXIT_COMPLETE


@pytest.mark.slow
def test_load_guard_refuses_damaged_checkpoint_on_every_rank():
    _, results = guard_results()
    for rank, result in enumerate(results):
        refusal = result["damaged_load"]
        assert refusal and refusal.startswith("IncompleteCheckpointError"), (rank, refusal)
        assert f"{FC1}: checkpoint global shape [2, 8, 48, 32], model expects [2, 8, 96, 32]" in refusal
        assert "checkpoint_audit" in refusal  # tells the user what to run next
        assert result["good_load"] is None, (rank, result["good_load"])


@pytest.mark.slow
def test_patches_report_status_and_apply_once():
    _, results = guard_results()
    for result in results:
        assert result["idempotent"]
        assert any(line.startswith("[megatron_patches] checkpoint-completeness-guard: applied")
                   and "#1836" in line for line in result["statuses"])
        assert any(line.startswith("[megatron_patches] checkpoint-load-guard: applied")
                   for line in result["statuses"])


@pytest.mark.slow
def test_save_guard_refuses_fsdp_dtensor_experts_at_one_etp_shard(tmp_path):
    """Real DTensors on a 2-rank gloo mesh through the guarded torch.distributed.checkpoint.save,
    the call megatron.training makes for --ckpt-format fsdp_dtensor."""
    results = run_scenario("fsdp_guard", str(tmp_path))
    for rank, result in enumerate(results):
        assert result["good"] is None, (rank, result["good"])
        assert result["damaged"].startswith("IncompleteCheckpointError"), (rank, result["damaged"])
        assert ("model.decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight: global shape "
                "[32, 24] but the config implies [32, 48]; main replicas: 1 chunk of [32, 24]; "
                "missing fraction 50.0%") in result["damaged"]
    assert not (tmp_path / "fsdp_damaged" / ".metadata").exists()
    report = checkpoint_audit.audit(str(tmp_path / "fsdp_good"))
    assert report.format == "fsdp_dtensor" and report.exit_status == checkpoint_audit.EXIT_COMPLETE
    assert sum(t.expert and t.shape_ok for t in report.tensors) == 8 * 3


def test_patches_are_registered_for_the_affected_versions():
    patches = {p.name: p for p in registry.registered()}
    for name in ("checkpoint-completeness-guard", "checkpoint-load-guard"):
        assert patches[name].versions == ">=0.15,<0.20"
        assert "Megatron-LM#1836" in patches[name].upstream


def _etp2_fc2_shards(damaged: bool) -> list[list[ShardedTensor]]:
    """Two ETP ranks' metadata for one expert's fc2 weight (hidden x ffn, ffn split in two)."""
    ranks = []
    for etp_rank in range(2):
        data = torch.zeros(32, 24)
        if damaged:  # #1836: global shape one shard wide, ETP rank 1 declared a replica
            sh = ShardedTensor.from_rank_offsets(FC2, data, replica_id=etp_rank)
        else:
            sh = ShardedTensor.from_rank_offsets(FC2, data, (1, etp_rank, 2))
        ranks.append([sh.without_data()])
    return ranks


def test_layout_findings_on_real_sharded_tensors():
    dims = checkpoint_audit.ModelDims.from_args(model_args(tp=2, ep=1, etp=2))
    good = checkpoint_guard.layout_findings(_etp2_fc2_shards(damaged=False), None)
    assert [t.ok for t in good] == [True]
    shards = _etp2_fc2_shards(damaged=True)
    # Per-expert (unstacked) naming, so 2-D shards carry the whole config-implied shape.
    key = "model.decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"
    renamed = [[ShardedTensor.from_rank_offsets(key, torch.zeros(32, 24), replica_id=r).without_data()]
               for r in range(2)]
    # Megatron's own tiling check is satisfied by the damaged layout; the config check is not.
    assert [t.missing_fraction for t in checkpoint_guard.layout_findings(shards, None)] == [0.0]
    [finding] = checkpoint_guard.layout_findings(renamed, dims)
    assert finding.shape_ok is False and finding.expected_shape == (32, 48)
    assert "missing fraction 50.0%" in checkpoint_guard.describe_refusal([finding], "save")
    # A correct global shape with ETP rank 1 dropped leaves half uncovered.
    half = [[ShardedTensor.from_rank_offsets(key, torch.zeros(32, 24), (1, r, 2),
                                             replica_id=r).without_data()] for r in range(2)]
    [gap] = checkpoint_guard.layout_findings(half, dims)
    assert gap.shape_ok and gap.missing_fraction == 0.5 and not gap.ok


@pytest.mark.slow
def test_launcher_saves_complete_etp2_checkpoint_and_refuses_a_damaged_resume(tmp_path):
    """pretrain_moe.py trains ETP=2, saves, and stops on both ranks when asked to resume from
    the same checkpoint rewritten into the #1836 layout."""
    def launch(args):
        return launch_2_ranks(2, [*TINY_MODEL, *ETP2, *args], timeout=300)

    good, damaged, holes = tmp_path / "good", tmp_path / "damaged", tmp_path / "holes"
    # All runs plan 4 iterations (the LR schedule must match to resume); the first stops at 2.
    first = launch(["--train-iters", "4", "--exit-interval", "2", "--save-interval", "2",
                    "--save", str(good)])
    assert first.returncode == 0, first.log[-4000:]
    assert "[megatron_patches] checkpoint-completeness-guard: applied" in first.log
    assert checkpoint_audit.audit(str(good)).exit_status == checkpoint_audit.EXIT_COMPLETE

    shutil.copytree(good, damaged)
    assert len(damage_like_1836(str(damaged), etp=2)) == 8  # fc1, fc2 and their 3 optimizer states
    # Same chunks dropped, true global shape kept: megatron-core 0.19.2 alone loads this one
    # without a word, leaving half of every expert matrix at its initial values.
    shutil.copytree(good, holes)
    damage_like_1836(str(holes), etp=2, shrink=False)
    for bad, problem in ((damaged, "checkpoint global shape [2, 8, 64, 64], model expects "
                                   "[2, 8, 128, 64]"),
                         (holes, "50.0% of the global tensor has no chunk")):
        refused = launch(["--train-iters", "4", "--load", str(bad)])
        assert refused.returncode != 0
        for rank in range(2):
            assert f"[rank{rank}]: megatron_patches.checkpoint_guard.IncompleteCheckpointError: " \
                   "[megatron_patches] refusing to load" in refused.log, refused.log[-4000:]
        assert f"{FC1}: {problem}" in refused.log
        assert "iteration        3/" not in refused.log

    resumed = launch(["--train-iters", "4", "--load", str(good)])
    assert resumed.returncode == 0, resumed.log[-4000:]
    assert "iteration        3/" in resumed.log and "iteration        4/" in resumed.log
