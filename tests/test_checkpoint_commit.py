"""The commit protocol of atomic-checkpoint-commit, state by state, without training.

Each test builds the directory a crash at one point of a save leaves behind and checks what
`recover` / `load_problems` make of it. The multi-process versions (real SIGKILLs) are in
test_failure_safety_cpu.py.
"""

import os

import pytest

from megatron_patches import checkpoint_commit as cc


def fake_checkpoint(directory, files=("__0_0.distcp",)):
    directory.mkdir(parents=True)
    for name in files:
        (directory / name).write_bytes(b"x" * 10)


def test_commit_publishes_directory_then_tracker(tmp_path):
    fake_checkpoint(tmp_path / "iter_0000001")
    cc.write_tracker(str(tmp_path), "1")
    fake_checkpoint(tmp_path / "_partial_iter_0000002")
    cc.commit(str(tmp_path), "iter_0000002", "2")
    assert (tmp_path / cc.TRACKER).read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000001", "iter_0000002", cc.TRACKER]


def test_crash_before_rename_leaves_tracker_on_previous_and_is_cleaned(tmp_path):
    fake_checkpoint(tmp_path / "iter_0000001")
    cc.write_tracker(str(tmp_path), "1")
    fake_checkpoint(tmp_path / "_partial_iter_0000002")  # killed while ranks were writing
    (tmp_path / f"{cc.TRACKER}.tmp.123").write_text("")  # killed inside write_tracker
    assert cc.recover(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", cc.TRACKER]
    assert cc.read_tracker(str(tmp_path)) == "iter_0000001"


def test_crash_between_the_two_renames_of_a_resave_is_undone(tmp_path):
    # Re-saving the tracked iteration: the old directory was moved aside, then the kill came.
    fake_checkpoint(tmp_path / "_replaced_iter_0000002")
    fake_checkpoint(tmp_path / "_partial_iter_0000002")
    cc.write_tracker(str(tmp_path), "2")
    cc.recover(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", cc.TRACKER]


def test_empty_tracker_is_refused_not_exit_0(tmp_path):
    (tmp_path / cc.TRACKER).write_text("")
    problems = cc.load_problems(str(tmp_path), None, "torch_dist")
    assert problems and "not an iteration number" in problems[0] and str(tmp_path) in problems[0]


def test_megatron_exits_0_on_an_empty_tracker(tmp_path):
    """Why the tracker must never be empty: megatron's read_metadata calls sys.exit() (status
    0, so a job scheduler sees success) instead of raising."""
    from megatron.training import checkpointing

    (tmp_path / cc.TRACKER).write_text("")
    with pytest.raises(SystemExit) as exited:
        checkpointing.read_metadata(str(tmp_path / cc.TRACKER))
    assert exited.value.code in (None, 0)


def test_missing_files_and_short_files_are_named(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    directory = tmp_path / "iter_0000001"
    dcp.save({"expert.weight": torch.ones(64, 64), "dense.weight": torch.ones(8)},
             storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    assert cc.file_problems(str(directory)) == []
    payload = sorted(directory.glob("*.distcp"))[0]
    os.truncate(payload, payload.stat().st_size // 2)
    problems = cc.file_problems(str(directory))
    assert problems and "truncated" in problems[0] and payload.name in problems[0]
    payload.unlink()
    assert "missing" in cc.file_problems(str(directory))[0]
    (directory / ".metadata").unlink()
    assert ".metadata is missing" in cc.file_problems(str(directory))[0]
