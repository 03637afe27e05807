"""#1836 on megatron-core 0.15.x: Megatron-FSDP + expert tensor parallelism checkpoints.

Real 2-process gloo runs (tests/_fsdp_etp_worker.py): a tiny MoE GPT with TP=1, ETP=2, EP=1
wrapped in megatron-core's Megatron-FSDP, saved as an fsdp_dtensor checkpoint (torch DCP files),
loaded into a model built from another seed. Run with the legacy environment:

    .venv-legacy/bin/python -m pytest -m legacy tests/megatron_patches/fsdp/test_legacy_fsdp_etp.py
"""

from __future__ import annotations

import json

import pytest

from _launch import launch, REPO
from _required import require_legacy_megatron

pytestmark = pytest.mark.legacy


@pytest.fixture(autouse=True)
def legacy_megatron():
    require_legacy_megatron()


ETP = 2
PATCH = "fsdp-expert-etp-sharding"
# The tiny model's expert weights, as megatron builds them whole: fc1 [ffn, h], fc2 [h, ffn].
TRUE_SHAPES = {"linear_fc1": [32, 16], "linear_fc2": [16, 32]}
TRUE_BYTES = 32 * 16 * 4


def run(tmp_path, strategy: str, patched: bool) -> dict:
    out = tmp_path / f"{strategy}-{'patched' if patched else 'unpatched'}.json"
    ckpt = tmp_path / f"ckpt-{strategy}-{patched}"
    env = {"FSDP_STRATEGY": strategy, "MEGATRON_PATCHES_DISABLE": "" if patched else PATCH}
    launch(2, [str(ckpt), str(out)], env=env, timeout=300,
           script=REPO / "tests" / "_fsdp_etp_worker.py").check()
    result = json.loads(out.read_text())
    result["ckpt"] = ckpt
    assert len(result["saved"]) == 8  # 4 experts x (fc1, fc2)
    return result


def kind(key: str) -> str:
    return "linear_fc1" if "linear_fc1" in key else "linear_fc2"


def rows(result):
    for rank in result["ranks"]:
        for key, row in rank["rows"].items():
            yield rank["etp_rank"], key, row


def test_unpatched_saves_one_etp_slice_and_reload_is_wrong(tmp_path):
    result = run(tmp_path, "no_shard", patched=False)
    assert "skipped (disabled" in result["patch"]
    for key, saved in result["saved"].items():
        # The checkpoint believes one ETP slice is the whole weight: 1/ETP shape and bytes.
        assert saved["global_shape"][0] * saved["global_shape"][1] * ETP == \
            TRUE_SHAPES[kind(key)][0] * TRUE_SHAPES[kind(key)][1]
        assert saved["bytes"] * ETP == TRUE_BYTES
    wrong = 0
    for etp_rank, key, row in rows(result):
        assert row["dtensor_global_shape"] == row["etp_slice_shape"]
        assert row["placements"] == ["R"]  # replicated across the ETP ranks
        assert row["changed_by_load"]
        assert len(row["reloaded_from_etp_ranks"]) == 1
        if row["reloaded_from_etp_ranks"] != [etp_rank]:
            wrong += 1  # this rank now holds another ETP rank's slice
            assert not row["reload_bit_exact"]
    # Exactly one ETP rank's slice was written per weight: the other rank reloads it.
    assert wrong == len(result["saved"]) * (ETP - 1)
    _audit(result["ckpt"], expect_damage=True)


def test_completeness_guard_refuses_the_unpatched_save_on_every_rank(tmp_path):
    out, ckpt = tmp_path / "guarded.json", tmp_path / "ckpt"
    env = {"FSDP_STRATEGY": "no_shard", "MEGATRON_PATCHES_DISABLE": PATCH, "SAVE_GUARD": "1"}
    launch(2, [str(ckpt), str(out)], env=env, timeout=300,
           script=REPO / "tests" / "_fsdp_etp_worker.py").check()
    for rank in range(2):
        result = json.loads((tmp_path / f"guarded.json.rank{rank}").read_text())
        assert "skipped (disabled" in result["patch"]
        assert "mlp.experts" in result["refused"] and "#1836" in result["refused"]
    assert not ckpt.exists() or not any(ckpt.iterdir()), "a refused save wrote files"


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_patched_saves_whole_expert_weights_and_reloads_bit_exactly(tmp_path, strategy):
    result = run(tmp_path, strategy, patched=True)
    assert ": applied (" in result["patch"]
    for key, saved in result["saved"].items():
        assert saved["global_shape"] == TRUE_SHAPES[kind(key)]
        assert saved["bytes"] == TRUE_BYTES
    for etp_rank, key, row in rows(result):
        assert row["dtensor_global_shape"] == TRUE_SHAPES[kind(key)]
        assert row["mesh"] == [[0, 1]]  # (expt_dp=1, etp=2)
        assert row["reload_bit_exact"], (etp_rank, key, row)
        assert row["reloaded_from_etp_ranks"] == [etp_rank]
        assert row["changed_by_load"]
    _audit(result["ckpt"], expect_damage=False)


def _audit(ckpt, expect_damage: bool) -> None:
    """megatron_patches.checkpoint_audit (branch audit) flags #1836 damage, once it is merged."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("megatron_patches.checkpoint_audit") is None:
        return
    done = subprocess.run([sys.executable, "-m", "megatron_patches.checkpoint_audit", str(ckpt)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == (1 if expect_damage else 0), done.stdout + done.stderr
