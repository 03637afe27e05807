"""The two patches of megatron-core 0.19.2's synchronous torch_dist save, from one pair of real
2-rank runs of pretrain_moe.py that save twice (tests/_save_children_entry.py names each rank's
child processes after training): both patches left out (MEGATRON_PATCHES_DISABLE; they touch
different things, a queue and a log flag), and both applied.

- sync-save-thread-results-queue: unpatched, each rank's first save starts a multiprocessing
  Manager (with 'spawn': an interpreter that imports pretrain_moe.py) that runs for the whole job;
  patched, a save starts no process and writes the same checkpoint, read back by torch's own DCP
  reader (`dcp_to_torch_save`).
- sync-save-no-async-deprecation: unpatched, every rank warns at its first save that "MCore's
  async save is deprecated" in a run that makes no asynchronous save; patched, no rank does."""

import argparse

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from _launch import REPO, TINY_MODEL, launch
from _save_children_entry import saved_children

QUEUE = "sync-save-thread-results-queue"
WARNING = "sync-save-no-async-deprecation"
ASYNC_DEPRECATED = "MCore's async save is deprecated and will be removed"  # megatron's warning


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


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """mode -> (log, each rank's child processes, every item of the iteration-2 checkpoint)."""
    tmp_path = tmp_path_factory.mktemp("sync_save")
    runs = {}
    for mode, disable in (("unpatched", f"{QUEUE},{WARNING}"), ("patched", "")):
        ckpt = tmp_path / "ckpt"  # one --save for both: the saved arguments name it
        run = launch(2, [*TINY_MODEL, "--use-distributed-optimizer", "--train-iters", "2",
                         "--save-interval", "1", "--save", str(ckpt)],
                     env={"MEGATRON_PATCHES_DISABLE": disable}, timeout=300,
                     script=REPO / "tests" / "_save_children_entry.py")
        assert run.returncode == 0, run.log[-4000:]
        assert run.log.count("successfully saved checkpoint from iteration") == 2, run.log[-4000:]
        status = "skipped (disabled" if disable else "applied ("
        for name in (QUEUE, WARNING):
            assert f"[megatron_patches] {name}: {status}" in run.log
        children = {line["rank"]: " ".join(line["children"])
                    for line in saved_children(run.log)}
        assert sorted(children) == [0, 1], run.log[-4000:]
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
        dcp_to_torch_save(ckpt / "iter_0000002", tmp_path / f"{mode}.pt")
        saved = torch.load(tmp_path / f"{mode}.pt", weights_only=False)
        ckpt.rename(tmp_path / mode)
        runs[mode] = run.log, children, saved
    return runs


@pytest.mark.slow
def test_a_save_starts_no_process_and_writes_the_same_checkpoint(runs):
    (_, unpatched_children, unpatched), (_, patched_children, patched) = \
        runs["unpatched"], runs["patched"]
    # megatron-core 0.19.2: each rank's first save started a Manager that is still running.
    children = unpatched_children, patched_children
    assert all("SyncManager" in names for names in unpatched_children.values()), children
    assert not any("SyncManager" in names for names in patched_children.values()), children
    # The same checkpoint: every key, every tensor bit for bit, every other item (saved
    # arguments, RNG and rerun state, the optimizer's layout) equal.
    assert sorted(patched) == sorted(unpatched) and len(patched) > 20
    tensors = [key for key, value in patched.items() if torch.is_tensor(value)]
    assert any("experts" in key for key in tensors) and any("optimizer" in key for key in tensors)
    for key, value in patched.items():
        assert _same(value, unpatched[key]), key


@pytest.mark.slow
def test_a_synchronous_save_warns_of_no_async_save(runs):
    unpatched_log, patched_log = runs["unpatched"][0], runs["patched"][0]
    assert unpatched_log.count(ASYNC_DEPRECATED) == 2, unpatched_log[-4000:]  # once per rank
    assert ASYNC_DEPRECATED not in patched_log
