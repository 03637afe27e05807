"""Which torch-format layouts lose expert pieces (NVIDIA/Megatron-LM#1719), judged from saved
arguments with megatron's own RankGenerator: a file is named by the TP, PP and EP ranks only, so
ranks that share those but hold different expert tensor-parallel pieces write one file. The
launched reference is tests/megatron_patches/checkpointing/test_torch_format_shards_cpu.py (ETP 2
on 2 ranks: one file, resumed losses off); the layouts judged intact resume bit-exactly in
tests/test_train_resume_cpu.py (torch-tp2-etp1-ep2, torch-ep2)."""

from types import SimpleNamespace

import pytest

from moe_launcher.checkpoint_files.torch_format import shared_files


def saved(world, tp=1, etp=None, ep=1, pp=1, experts=4):
    return SimpleNamespace(num_experts=experts, world_size=world, tensor_model_parallel_size=tp,
                           pipeline_model_parallel_size=pp, context_parallel_size=1,
                           expert_tensor_parallel_size=etp, expert_model_parallel_size=ep)


@pytest.mark.parametrize("args, shared", [
    (saved(2, etp=2), [("mp_rank_00", [0, 1])]),
    (saved(4, etp=2, ep=2), [("mp_rank_00_000", [0, 1]), ("mp_rank_00_001", [2, 3])]),
    (saved(4, tp=2, etp=4), [("mp_rank_00", [0, 2]), ("mp_rank_01", [1, 3])]),
    (saved(4, tp=2, etp=1, ep=2), []),
    (saved(2, ep=2), []),
    (saved(4, tp=2, etp=2), []),
    (saved(4, tp=4, etp=2), []),
    (saved(8, tp=2, etp=1, ep=2, pp=2), []),
    (saved(2, etp=2, experts=None), []),
], ids=["tp1-etp2", "tp1-etp2-ep2", "tp2-etp4", "tp2-etp1-ep2", "ep2", "tp2-etp2", "tp4-etp2",
        "tp2-etp1-ep2-pp2", "dense"])
def test_files_shared_by_ranks_holding_different_expert_pieces(args, shared):
    assert shared_files(args) == shared
