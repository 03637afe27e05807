"""sync-save-thread-results-queue: megatron-core 0.19.2's synchronous torch_dist save starts a
multiprocessing Manager (with 'spawn': an interpreter that imports pretrain_moe.py) at each
rank's first save and leaves it running for the whole job; patched, a save starts no process and
writes the same checkpoint. Real 2-rank runs of pretrain_moe.py saving twice
(tests/_save_children_entry.py names each rank's child processes after training), with the patch
left out (MEGATRON_PATCHES_DISABLE) and with it; the checkpoints are read back by torch's own
DCP reader (`dcp_to_torch_save`)."""

import argparse
import re

import numpy as np

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from _launch import REPO, TINY_MODEL, launch

PATCH = "sync-save-thread-results-queue"


def _saved(ckpt, out) -> dict:
    """Every item of the checkpoint's iteration 2 (model, optimizer state, bytes), by its key."""
    dcp_to_torch_save(ckpt / "iter_0000002", out)
    return torch.load(out, weights_only=False)


def _same(a, b) -> bool:
    """Equal values: tensors and arrays element for element, containers item by item."""
    if torch.is_tensor(a) or isinstance(a, np.ndarray):
        return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
                and bool((a == b).all()))
    if isinstance(a, argparse.Namespace):
        return isinstance(b, argparse.Namespace) and _same(vars(a), vars(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.mark.slow
def test_a_save_starts_no_process_and_writes_the_same_checkpoint(tmp_path):
    children, saved = {}, {}
    for mode, disable in (("unpatched", PATCH), ("patched", "")):
        ckpt = tmp_path / "ckpt"  # one --save for both: the saved arguments name it
        run = launch(2, [*TINY_MODEL, "--use-distributed-optimizer", "--train-iters", "2",
                         "--save-interval", "1", "--save", str(ckpt)],
                     env={"MEGATRON_PATCHES_DISABLE": disable}, timeout=300,
                     script=REPO / "tests" / "_save_children_entry.py")
        assert run.returncode == 0, run.log[-4000:]
        assert run.log.count("successfully saved checkpoint from iteration") == 2, run.log[-4000:]
        status = "skipped (disabled" if disable else "applied ("
        assert f"[megatron_patches] {PATCH}: {status}" in run.log
        children[mode] = dict(re.findall(r"^rank (\d): child processes after training: (.*)$",
                                         run.log, re.M))
        assert sorted(children[mode]) == ["0", "1"], run.log[-4000:]
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
        saved[mode] = _saved(ckpt, tmp_path / f"{mode}.pt")
        ckpt.rename(tmp_path / mode)
    # megatron-core 0.19.2: each rank's first save started a Manager that is still running.
    assert all("SyncManager" in names for names in children["unpatched"].values()), children
    assert not any("SyncManager" in names for names in children["patched"].values()), children
    # The same checkpoint: every key, every tensor bit for bit, every other item (saved
    # arguments, RNG and rerun state, the optimizer's layout) equal.
    unpatched, patched = saved["unpatched"], saved["patched"]
    assert sorted(patched) == sorted(unpatched) and len(patched) > 20
    tensors = [key for key, value in patched.items() if torch.is_tensor(value)]
    assert any("experts" in key for key in tensors) and any("optimizer" in key for key in tensors)
    for key, value in patched.items():
        assert _same(value, unpatched[key]), key
