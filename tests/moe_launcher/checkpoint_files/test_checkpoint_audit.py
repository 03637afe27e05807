"""The checkpoint audit on real checkpoints written by megatron-core (Megatron-LM #1836).

torch_dist checkpoints come from tests/_ckpt_worker.py (2 gloo ranks, tiny MoE GPT; its module
doc says how the damaged one reproduces #1836). fsdp_dtensor checkpoints need Megatron-FSDP,
which does not run on CPU; here they are written with torch.distributed.checkpoint in the same
on-disk layout megatron.training's fsdp_dtensor save produces (`model.`-prefixed per-layer keys,
`local_experts.N` / grouped `weightN` expert names, SwiGLU fc1 split into `_w`/`_v`, the args
object under `args`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from moe_launcher.checkpoint_files import audit as checkpoint_audit
from moe_launcher.checkpoint_files import metadata as checkpoint_metadata
from moe_launcher.checkpoint_files import shape_rules as config_shape_rules
from moe_launcher.checkpoint_files.geometry import coverage

from _checkpoints import ROOT, checkpoints
from _ckpt_worker import model_args


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_patches.checkpoint_audit", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["etp1", "etp2"])  # etp1 is EP=2, etp2 is TP=2 ETP=2
def test_good_checkpoints_are_complete(layout, capsys):
    status = checkpoint_audit.main([os.path.join(checkpoints(), layout)])
    out = capsys.readouterr().out
    assert status == checkpoint_audit.EXIT_COMPLETE, out
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight [2, 8, 96, 32] shape ok" in out
    assert "complete: every tensor tiles its global shape once" in out


@pytest.mark.slow
def test_damaged_checkpoint_is_flagged_with_json_output():
    proc = run_cli(os.path.join(checkpoints(), "damaged"), "--json")
    assert proc.returncode == checkpoint_audit.EXIT_DAMAGED, proc.stderr
    report = json.loads(proc.stdout)
    assert "#1836" in report["verdict"]
    assert report["expert_saved_bytes"] * 2 == report["expert_expected_bytes"]
    bad = {t["key"]: t for t in report["tensors"] if not t["ok"]}
    assert set(bad) == {"decoder.layers.mlp.experts.experts.linear_fc1.weight",
                        "decoder.layers.mlp.experts.experts.linear_fc2.weight"}
    assert bad["decoder.layers.mlp.experts.experts.linear_fc1.weight"]["global_shape"] == [2, 8, 48, 32]


@pytest.mark.slow
def test_etp2_checkpoint_holds_as_many_model_bytes_as_etp1():
    etp1 = checkpoint_audit.audit(os.path.join(checkpoints(), "etp1")).to_json()
    etp2 = checkpoint_audit.audit(os.path.join(checkpoints(), "etp2")).to_json()
    assert etp2["saved_bytes"] == etp1["saved_bytes"]
    assert etp2["expert_saved_bytes"] == etp2["expert_expected_bytes"] == etp1["expert_saved_bytes"]
    # Per-chunk serialization overhead differs, the payload does not shrink by 1/ETP.
    assert etp2["payload_bytes_on_disk"] >= etp2["saved_bytes"]


@pytest.mark.slow
def test_save_root_and_iteration_dir_give_the_same_report():
    root = os.path.join(checkpoints(), "etp2")
    assert (checkpoint_audit.audit(root).to_json()
            == checkpoint_audit.audit(os.path.join(root, "iter_0000001")).to_json())


def test_unreadable_directories_exit_2(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / ".metadata").write_bytes(b"\x80\x04 not a pickle")
    dangling = tmp_path / "dangling"
    dangling.mkdir()
    (dangling / checkpoint_metadata.TRACKER_FILE).write_text("7")
    for path in (empty, garbled, dangling, tmp_path / "missing"):
        assert checkpoint_audit.main([str(path)]) == checkpoint_audit.EXIT_UNREADABLE, path
    proc = run_cli(str(garbled), "--json")
    assert proc.returncode == checkpoint_audit.EXIT_UNREADABLE
    assert json.loads(proc.stdout)["verdict"].startswith("UNREADABLE")


def write_fsdp_dtensor_checkpoint(path, etp_damage: int = 1, grouped: bool = False) -> None:
    """A one-process DCP checkpoint in fsdp_dtensor's layout; etp_damage=2 mimics #1836 under
    Megatron-FSDP (expert tensors Replicate on a mesh without the ETP dim: 1/ETP of the rows)."""
    a = model_args(tp=1, ep=1, etp=etp_damage)
    h, f = a.hidden_size, a.moe_ffn_hidden_size // etp_damage
    model = {}
    for layer in range(a.num_layers):
        prefix = f"decoder.layers.{layer}."
        model[prefix + "self_attention.linear_qkv.weight"] = torch.zeros(3 * h, h)
        model[prefix + "self_attention.linear_proj.weight"] = torch.zeros(h, h)
        model[prefix + "mlp.router.weight"] = torch.zeros(a.num_experts, h)
        for e in range(a.num_experts):
            name = (prefix + "mlp.experts.linear_fc{}.weight" + str(e) if grouped
                    else prefix + f"mlp.experts.local_experts.{e}.linear_fc{{}}.weight")
            model[name.format(1) + "_w"] = torch.zeros(f, h)
            model[name.format(1) + "_v"] = torch.zeros(f, h)
            model[name.format(2)] = torch.zeros(h, f)
    dcp.save({"model": model, "args": a}, storage_writer=dcp.FileSystemWriter(str(path)),
             no_dist=True)


@pytest.mark.parametrize("grouped", [False, True])
def test_fsdp_dtensor_layout(tmp_path, grouped):
    write_fsdp_dtensor_checkpoint(tmp_path / "good", grouped=grouped)
    write_fsdp_dtensor_checkpoint(tmp_path / "damaged", etp_damage=2, grouped=grouped)
    good = checkpoint_audit.audit(str(tmp_path / "good"))
    assert good.format == "fsdp_dtensor" and good.have_config
    assert good.exit_status == checkpoint_audit.EXIT_COMPLETE, good.verdict
    assert sum(t.shape_ok is True and t.expert for t in good.tensors) == 2 * 8 * 3
    damaged = checkpoint_audit.audit(str(tmp_path / "damaged"))
    assert damaged.exit_status == checkpoint_audit.EXIT_DAMAGED
    assert len(damaged.damaged) == 2 * 8 * 3 and all(t.expert for t in damaged.damaged)
    assert "#1836" in damaged.verdict


def test_coverage_finds_gaps_overlaps_and_strays():
    halves = [((0, 0), (2, 4)), ((2, 0), (2, 4))]
    assert coverage((4, 4), halves).exact
    assert coverage((4, 4), halves[:1]).missing_fraction == 0.5
    assert coverage((4, 4), halves + [((1, 1), (1, 1))]).overlapping
    assert coverage((4, 4), [((0, 0), (4, 4)), ((3, 0), (2, 4))]).out_of_bounds
    # A ragged but exact tiling: megatron defers uneven grids to DCP, the audit does not.
    assert coverage((5, 3), [((0, 0), (3, 3)), ((3, 0), (2, 1)), ((3, 1), (2, 2))]).exact


def test_coverage_agrees_with_counting_every_element():
    """Both paths of the grid arithmetic (equal boxes on a grid, anything else) against a dense
    per-element count, on grids with holes, duplicates, strays and uneven boxes."""
    rng = np.random.default_rng(1836)
    for trial in range(300):
        shape = tuple(int(n) for n in rng.integers(1, 7, size=int(rng.integers(1, 4))))
        if trial % 2:  # a regular grid of one box size, some cells dropped or doubled
            size = tuple(int(rng.choice([d for d in range(1, n + 1) if n % d == 0]))
                         for n in shape)
            cells = [tuple(c * s for c, s in zip(cell, size))
                     for cell in np.ndindex(*(n // s for n, s in zip(shape, size)))]
            picked = [cells[i] for i in rng.integers(0, len(cells), size=len(cells))]
            boxes = [(o, size) for o in picked]
        else:
            boxes = []
            for _ in range(int(rng.integers(0, 6))):
                offset = tuple(int(rng.integers(-1, n)) for n in shape)
                boxes.append((offset, tuple(int(rng.integers(0, 4)) for _ in shape)))
        counts = np.zeros(shape, dtype=int)
        stray = False
        for offset, size in boxes:
            stray |= any(o < 0 or o + s > n for o, s, n in zip(offset, size, shape))
            counts[tuple(slice(max(o, 0), max(min(o + s, n), 0))
                         for o, s, n in zip(offset, size, shape))] += 1
        found = coverage(shape, boxes)
        assert found.out_of_bounds == stray, (shape, boxes)
        assert found.overlapping == bool((counts > 1).any()), (shape, boxes)
        assert abs(found.missing_fraction - (counts == 0).mean()) < 1e-12, (shape, boxes)


def test_expected_shapes_follow_the_config_not_the_parallelism():
    dims = config_shape_rules.ModelDims.from_args(argparse.Namespace(**vars(model_args(2, 1, 2))))
    shape = config_shape_rules.expected_shape
    assert shape("decoder.layers.mlp.experts.experts.linear_fc1.weight", (2, 8, 96, 32), dims) \
        == (None, 8, 96, 32)
    assert shape("model.decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight",
                 (32, 48), dims) == (32, 48)
    assert shape("model.decoder.layers.0.mlp.experts.linear_fc1.weight5_v", (48, 32), dims) \
        == (48, 32)
    assert shape("decoder.layers.self_attention.linear_qkv.weight", (2, 96, 32), dims) \
        == (None, 96, 32)
    assert shape("embedding.word_embeddings.weight", (128, 32), dims) == (128, 32)
    assert shape("embedding.position_embeddings.weight", (16, 32), dims) is None
    assert shape("decoder.layers.mlp.shared_experts.linear_fc1.weight", (2, 64, 32), dims) is None


UNMODELLED = {  # saved-args flag -> tensors it leaves unchecked, and one it does not
    "quick_geglu": (["decoder.layers.1.mlp.experts.experts.linear_fc1.weight",
                     "decoder.layers.0.mlp.linear_fc1.weight"],
                    "decoder.layers.1.mlp.experts.experts.linear_fc2.weight"),
    "attention_output_gate": (["decoder.layers.0.self_attention.linear_qkv.weight"],
                              "decoder.layers.0.mlp.router.weight"),
    "moe_latent_size": (["decoder.layers.1.mlp.experts.experts.linear_fc2.weight"],
                        "decoder.layers.0.self_attention.linear_qkv.weight"),
    "heterogeneous_layers_config_encoded_json": (
        ["decoder.layers.0.self_attention.linear_qkv.weight",
         "decoder.layers.0.input_layernorm.weight"], "embedding.word_embeddings.weight"),
}


@pytest.mark.parametrize("flag", UNMODELLED)
def test_unmodelled_flags_leave_their_tensors_unchecked_not_damaged(flag):
    """A shape no rule models (here deliberately wrong) is "unchecked", never a #1836 verdict."""
    args = model_args(tp=1, ep=1, etp=1)
    setattr(args, flag, 16 if flag == "moe_latent_size" else "{}" if "json" in flag else True)
    dims = config_shape_rules.ModelDims.from_args(args)
    unchecked, still_checked = UNMODELLED[flag]
    for key in unchecked:
        finding = checkpoint_audit.judge_tensor(key, (8, 7, 5)[:2 + ("experts.experts" in key)],
                                                 2, [], dims)
        assert finding.expected_shape is None and finding.shape_ok is None, (flag, key)
    assert config_shape_rules.expected_shape(still_checked, (8, 32, 32), dims) is not None


@pytest.mark.slow
def test_args_in_legacy_common_pt_take_precedence(tmp_path):
    """megatron-core <=0.16 keeps the args in common.pt; the audit judges against those."""
    iteration = tmp_path / "iter_0000001"
    shutil.copytree(os.path.join(checkpoints(), "etp2", "iter_0000001"), iteration)
    args = model_args(tp=2, ep=1, etp=2)
    args.moe_ffn_hidden_size *= 2  # a config the saved experts do not fit
    torch.save({"args": args}, iteration / "common.pt")
    report = checkpoint_audit.audit(str(iteration))
    assert report.exit_status == checkpoint_audit.EXIT_DAMAGED
    assert {t.key for t in report.damaged} == {
        "decoder.layers.mlp.experts.experts.linear_fc1.weight",
        "decoder.layers.mlp.experts.experts.linear_fc2.weight"}
