"""The commit protocol of atomic-checkpoint-commit, state by state, without training.

Each test builds the directory a crash at one point of a save leaves behind and checks what
`recover` / `load_problems` make of it. The multi-process versions (real SIGKILLs) are in
test_failure_safety_cpu.py.
"""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_patches.checkpointing import atomic_checkpoint_commit
from moe_launcher.checkpoint_files import commit_protocol, file_checks, writer_claim
from moe_launcher.runtime.refusals import CheckpointSaveError

REPO_ROOT = Path(__file__).resolve().parents[3]


def fake_checkpoint(directory, files=("__0_0.distcp",)):
    directory.mkdir(parents=True)
    for name in files:
        (directory / name).write_bytes(b"x" * 10)


def test_commit_publishes_directory_then_tracker(tmp_path):
    fake_checkpoint(tmp_path / "iter_0000001")
    commit_protocol.write_tracker(str(tmp_path), "1")
    fake_checkpoint(tmp_path / "_partial_iter_0000002")
    commit_protocol.commit(str(tmp_path), "iter_0000002", "2")
    assert (tmp_path / commit_protocol.TRACKER).read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000001", "iter_0000002", commit_protocol.TRACKER]


def test_crash_before_rename_leaves_tracker_on_previous_and_is_cleaned(tmp_path):
    fake_checkpoint(tmp_path / "iter_0000001")
    commit_protocol.write_tracker(str(tmp_path), "1")
    fake_checkpoint(tmp_path / "_partial_iter_0000002")  # killed while ranks were writing
    (tmp_path / f"{commit_protocol.TRACKER}.tmp.123").write_text("")  # killed inside write_tracker
    fake_checkpoint(tmp_path / "_retired_iter_0000000")  # killed removing a dropped iteration
    assert commit_protocol.recover(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", commit_protocol.TRACKER]
    assert commit_protocol.read_tracker(str(tmp_path)) == "iter_0000001"


def test_crash_between_the_two_renames_of_a_resave_is_undone(tmp_path):
    # Re-saving the tracked iteration: the old directory was moved aside, then the kill came.
    fake_checkpoint(tmp_path / "_replaced_iter_0000002")
    fake_checkpoint(tmp_path / "_partial_iter_0000002")
    commit_protocol.write_tracker(str(tmp_path), "2")
    commit_protocol.recover(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", commit_protocol.TRACKER]


def test_empty_tracker_is_refused_not_exit_0(tmp_path):
    (tmp_path / commit_protocol.TRACKER).write_text("")
    problems = file_checks.load_problems(str(tmp_path), None, "torch_dist")
    assert problems and "not an iteration number" in problems[0] and str(tmp_path) in problems[0]


def test_megatron_exits_0_on_an_empty_tracker(tmp_path):
    """Why the tracker must never be empty: megatron's read_metadata calls sys.exit() (status
    0, so a job scheduler sees success) instead of raising."""
    from megatron.training import checkpointing

    (tmp_path / commit_protocol.TRACKER).write_text("")
    with pytest.raises(SystemExit) as exited:
        checkpointing.read_metadata(str(tmp_path / commit_protocol.TRACKER))
    assert exited.value.code in (None, 0)


def test_missing_files_and_short_files_are_named(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    directory = tmp_path / "iter_0000001"
    dcp.save({"expert.weight": torch.ones(64, 64), "dense.weight": torch.ones(8)},
             storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    assert file_checks.file_problems(str(directory)) == []
    payload = sorted(directory.glob("*.distcp"))[0]
    os.truncate(payload, payload.stat().st_size // 2)
    problems = file_checks.file_problems(str(directory))
    assert problems and "truncated" in problems[0] and payload.name in problems[0]
    payload.unlink()
    assert "missing" in file_checks.file_problems(str(directory))[0]
    (directory / ".metadata").unlink()
    assert ".metadata is missing" in file_checks.file_problems(str(directory))[0]


def test_a_live_writer_keeps_its_directory_and_a_dead_ones_leftovers_are_cleaned(tmp_path):
    """Another process claims the directory and stages a save: this one is refused and leaves
    the staged files; once that process is killed (a requeued job) the claim cleans them up."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from moe_launcher.checkpoint_files "
         "import writer_claim; fd, _ = writer_claim.claim(sys.argv[1]); print('claimed', flush=True); time.sleep(120)",
         str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        fake_checkpoint(tmp_path / "_partial_iter_0000002")
        with pytest.raises(CheckpointSaveError) as refused:
            writer_claim.WriterClaims().claim(str(tmp_path))
        assert "another live job" in str(refused.value) and f"pid {holder.pid} " in str(
            refused.value), refused.value
        assert (tmp_path / "_partial_iter_0000002").is_dir()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert any("_partial_iter_0000002" in line for line in writer_claim.WriterClaims().claim(str(tmp_path)))
    assert not (tmp_path / "_partial_iter_0000002").exists()
    assert json.loads((tmp_path / writer_claim.WRITER_LOCK).read_text())["pid"] == os.getpid()


def test_without_file_locks_the_writer_record_decides(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = socket.gethostname()
    assert writer_claim._running_here({"host": here, "pid": os.getpid(),
                             "start": writer_claim._process_start(os.getpid())}) is True
    assert writer_claim._running_here({"host": here, "pid": dead.pid}) is False
    assert writer_claim._running_here({"host": here, "pid": os.getpid(), "start": "1"}) is False  # reused
    assert writer_claim._running_here({"host": here + "-elsewhere", "pid": os.getpid()}) is None


def test_failed_save_advice_follows_the_cause():
    """A guard's refusal keeps its own fix; anything else is judged by test_room_is_judged_...
    below (free-space advice only when room is short)."""
    from megatron_patches.checkpointing.checkpoint_completeness_guard import IncompleteCheckpointError

    try:
        try:
            raise OSError(27, "File too large")
        except OSError as write_error:
            raise RuntimeError("CheckpointException ranks:{0: OSError(27)}") from write_error
    except RuntimeError as wrapped:
        assert not atomic_checkpoint_commit._is_deliberate_refusal(wrapped)
    try:
        raise IncompleteCheckpointError("[megatron_patches] refusing to save the checkpoint")
    except IncompleteCheckpointError as refusal:
        try:
            raise RuntimeError("save failed") from refusal
        except RuntimeError as wrapped:
            assert atomic_checkpoint_commit._is_deliberate_refusal(wrapped)


def test_room_is_judged_by_errno_or_by_measure(tmp_path):
    """The free-space advice only when room is short: an errno of ENOSPC/EDQUOT/EFBIG anywhere
    in the chain (here inside torch's CheckpointException, as a rank's write failure), a
    checkpoint file at the file-size limit, or less free space than the last checkpoint takes;
    any other failure gets no room advice."""
    import errno
    import resource

    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    short = atomic_checkpoint_commit._short_of_room
    save = tmp_path / "ckpt"
    fake_checkpoint(save / "iter_0000001", files=("__0_0.distcp", "__1_0.distcp"))
    staging = str(save / "_partial_iter_0000002")
    for code, words in ((errno.ENOSPC, "no space left"), (errno.EDQUOT, "quota"),
                        (errno.EFBIG, "file too large")):
        try:
            raise OSError(code, os.strerror(code))
        except OSError as write_error:
            failed = CheckpointException("write", {1: _wrap_exception(write_error)})
        found = short(failed, str(save), "iter_0000001", staging)
        assert found and words in found[0], (code, found)
    # Another rank's error that arrived as text only
    assert short(RuntimeError(f"rank 1: [Errno {errno.ENOSPC}] No space left on device"),
                 str(save), "iter_0000001", staging)
    # Not a matter of room: a stale handle, torch's zip writer error, on a roomy filesystem
    stale = OSError(errno.ESTALE, os.strerror(errno.ESTALE))
    assert short(stale, str(save), "iter_0000001", staging) is None
    unexplained = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert short(unexplained, str(save), "iter_0000001", staging) is None
    # The same error where the last checkpoint's files (10 bytes) reach the file-size limit
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (10, hard))
    try:
        found = short(unexplained, str(save), "iter_0000001", staging)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert found and "file-size limit" in found[0] and "ulimit -f" in found[1], found
