"""The two patches of megatron-core 0.19.2's synchronous torch_dist save, from one pair of real
2-rank runs of pretrain_moe.py that save twice (tests/_save_children_entry.py names each rank's
child processes after training): both patches left out (MEGATRON_PATCHES_DISABLE; they touch
different things, a queue and a log flag), and both applied.

- sync-save-thread-results-queue: unpatched, each rank's first save starts a multiprocessing
  Manager (with 'spawn': an interpreter that imports pretrain_moe.py) that runs for the whole job;
  patched, a save starts no process and writes the same checkpoint, read back by torch's own DCP
  reader (`dcp_to_torch_save`).
- sync-save-no-async-deprecation: unpatched, every rank warns at its first save that "MCore's
  async save is deprecated" in a run that makes no asynchronous save; patched, no rank does.

The queue patch on megatron-core 0.15.x (the legacy track, whose writer forks its writers) is the
last test, run by the legacy suite:

    .venv-legacy/bin/python -m pytest -m legacy tests/megatron_patches/checkpointing/test_sync_save_cpu.py
"""

import argparse

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from _launch import REPO, TINY_MODEL, launch
from _required import require_legacy_megatron
from _save_children_entry import saved_children
from megatron_patches import registry

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


def launched(script: str, args: list[str], disable: str, patches: tuple[str, ...]) -> tuple:
    """A 2-rank run of tests/`script` with `disable` left out that exits 0, prints `patches`'
    status lines as left out or applied, and reports both ranks' child processes: its log and
    rank -> the children's names, space-joined."""
    run = launch(2, args, env={"MEGATRON_PATCHES_DISABLE": disable}, timeout=300,
                 script=REPO / "tests" / script)
    assert run.returncode == 0, run.log[-4000:]
    status = "skipped (disabled" if disable else "applied ("
    for name in patches:
        assert f"[megatron_patches] {name}: {status}" in run.log, run.log[-4000:]
    children = {line["rank"]: " ".join(line["children"]) for line in saved_children(run.log)}
    assert sorted(children) == [0, 1], run.log[-4000:]
    return run.log, children


def read_dcp(folder, into) -> dict:
    """Every item of a torch DCP checkpoint, as torch's own reader (`dcp_to_torch_save`)
    gives it."""
    dcp_to_torch_save(folder, into)
    return torch.load(into, weights_only=False)


def save_twice(tmp_path, mode: str, disable: str, patches: tuple[str, ...]) -> tuple:
    """One 2-rank run of pretrain_moe.py saving at iterations 1 and 2 with `disable` left out:
    its log, each rank's child processes and every item of the iteration-2 checkpoint."""
    ckpt = tmp_path / "ckpt"  # one --save for every mode: the saved arguments name it
    log, children = launched(
        "_save_children_entry.py", [*TINY_MODEL, "--use-distributed-optimizer", "--train-iters",
                                    "2", "--save-interval", "1", "--save", str(ckpt)],
        disable, patches)
    assert log.count("successfully saved checkpoint from iteration") == 2, log[-4000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    saved = read_dcp(ckpt / "iter_0000002", tmp_path / f"{mode}.pt")
    ckpt.rename(tmp_path / mode)
    return log, children, saved


def assert_same_checkpoint(patched: dict, unpatched: dict) -> None:
    """Every key, every tensor bit for bit, every other item (saved arguments, RNG and rerun
    state, the optimizer's layout) equal."""
    assert sorted(patched) == sorted(unpatched) and len(patched) > 20
    tensors = [key for key, value in patched.items() if torch.is_tensor(value)]
    assert any("experts" in key for key in tensors) and any("optimizer" in key for key in tensors)
    for key, value in patched.items():
        assert _same(value, unpatched[key]), key


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """mode -> (log, each rank's child processes, every item of the iteration-2 checkpoint)."""
    tmp_path = tmp_path_factory.mktemp("sync_save")
    return {mode: save_twice(tmp_path, mode, disable, (QUEUE, WARNING))
            for mode, disable in (("unpatched", f"{QUEUE},{WARNING}"), ("patched", ""))}


def assert_no_manager_left(unpatched_children: dict, patched_children: dict) -> None:
    """Unpatched, each rank's first save started a Manager that is still running; patched, none."""
    children = unpatched_children, patched_children
    assert all("SyncManager" in names for names in unpatched_children.values()), children
    assert not any("SyncManager" in names for names in patched_children.values()), children


@pytest.mark.slow
def test_a_save_starts_no_process_and_writes_the_same_checkpoint(runs):
    (_, unpatched_children, unpatched), (_, patched_children, patched) = \
        runs["unpatched"], runs["patched"]
    assert_no_manager_left(unpatched_children, patched_children)
    assert_same_checkpoint(patched, unpatched)


@pytest.mark.slow
def test_a_synchronous_save_warns_of_no_async_save(runs):
    unpatched_log, patched_log = runs["unpatched"][0], runs["patched"][0]
    assert unpatched_log.count(ASYNC_DEPRECATED) == 2, unpatched_log[-4000:]  # once per rank
    assert ASYNC_DEPRECATED not in patched_log


@pytest.mark.legacy
@pytest.mark.slow
def test_a_save_on_megatron_0_15_starts_no_process_and_writes_the_same_checkpoint(tmp_path):
    # 0.15.3 takes the same spawned Manager's queue (`_get_write_results_queue`) and has no
    # megatron.training: a loop of the user's own saves twice with dist_checkpointing
    # (tests/_sync_save_worker.py). It has no deprecation warning to silence.
    require_legacy_megatron()
    runs = {}
    for mode, disable in (("unpatched", QUEUE), ("patched", "")):
        ckpt = tmp_path / mode
        log, children = launched("_sync_save_worker.py", [str(ckpt)], disable, (QUEUE,))
        # The whole registry applies on 0.15.3, which has no megatron.training: every patch
        # prints its line (probes that imported it had stopped the worker).
        assert log.count("[megatron_patches] ") == len(registry.load_patches())
        runs[mode] = children, [read_dcp(ckpt / f"iter_{i}", tmp_path / f"{mode}{i}.pt")
                                for i in (1, 2)]
    (unpatched_children, unpatched), (patched_children, patched) = \
        runs["unpatched"], runs["patched"]
    assert_no_manager_left(unpatched_children, patched_children)
    # Each save holds both ranks' rows of the weight, drawn from each rank's own seed.
    for iteration, (unpatched_save, patched_save) in enumerate(zip(unpatched, patched), 1):
        assert patched_save["weight"].shape == (8, 8)
        assert _same(patched_save, unpatched_save), iteration
    assert not torch.equal(patched[0]["weight"], patched[1]["weight"])
