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
import time
from pathlib import Path

import pytest

from megatron_patches.checkpointing import atomic_checkpoint_commit
from moe_launcher.checkpoint_files import commit_protocol, file_checks, retention, writer_claim
from moe_launcher.runtime.refusals import CheckpointSaveError, find_refusal

REPO_ROOT = Path(__file__).resolve().parents[3]


def fake_checkpoint(directory, files=("__0_0.distcp",)):
    directory.mkdir(parents=True)
    for name in files:
        (directory / name).write_bytes(b"x" * 10)


def private(claim_id: str, prefix: str, name: str) -> str:
    return commit_protocol.private_name(prefix, claim_id, name)


def test_commit_publishes_directory_then_tracker(tmp_path):
    fake_checkpoint(tmp_path / "iter_0000001")
    commit_protocol.write_tracker(str(tmp_path), "1")
    claim_id = commit_protocol.new_claim_id()
    fake_checkpoint(tmp_path / private(claim_id, "_partial_", "iter_0000002"))
    commit_protocol.commit(str(tmp_path), "iter_0000002", "2", claim_id, [1])
    assert (tmp_path / commit_protocol.TRACKER).read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000001", "iter_0000002", commit_protocol.TRACKER]


def test_two_writers_of_one_directory_never_touch_each_others_files(tmp_path):
    """Were two jobs ever to write one --save (a take-over of a job that still ran), each stages,
    replaces and retires under names of its own: one's commit of iteration 2 and its retention
    leave the other's staged iteration 2 and its scratch tracker as they were, and the tracker's
    temporary file is a new one (before: one `_partial_iter_0000002` for both, one scratch
    tracker, and `<tracker>.tmp.<pid>`, which a process of the same pid on another host shares)."""
    save = str(tmp_path)
    fake_checkpoint(tmp_path / "iter_0000001")
    commit_protocol.write_tracker(save, "1")
    mine, theirs = commit_protocol.new_claim_id(), commit_protocol.new_claim_id()
    assert mine != theirs
    fake_checkpoint(tmp_path / private(theirs, "_partial_", "iter_0000002"),
                    files=("__0_0.distcp", "__1_0.distcp"))
    (tmp_path / private(theirs, "_partial_", commit_protocol.TRACKER)).write_text("1")
    (tmp_path / f"{commit_protocol.TRACKER}.tmp.{os.getpid()}").write_text("7")
    theirs_before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*")
                     if p.is_file() and "iter_0000001" not in p.parts
                     and p.name != commit_protocol.TRACKER}

    fake_checkpoint(tmp_path / private(mine, "_partial_", "iter_0000002"))
    commit_protocol.commit(save, "iter_0000002", "2", mine, [1])
    retention.drop_iteration(save, 1, mine)

    assert commit_protocol.read_tracker(save) == "iter_0000002"
    assert sorted(p.name for p in (tmp_path / "iter_0000002").iterdir()) == ["__0_0.distcp"]
    assert not (tmp_path / "iter_0000001").exists()
    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*")
            if p.relative_to(tmp_path) in theirs_before} == theirs_before


def test_crash_before_rename_leaves_tracker_on_previous_and_is_cleaned(tmp_path):
    fake_checkpoint(tmp_path / "iter_0000001")
    commit_protocol.write_tracker(str(tmp_path), "1")
    fake_checkpoint(tmp_path / "_partial_iter_0000002")  # killed while ranks were writing
    (tmp_path / f"{commit_protocol.TRACKER}.tmp.123").write_text("")  # killed inside write_tracker
    fake_checkpoint(tmp_path / "_retired_iter_0000000")  # killed removing a dropped iteration
    assert commit_protocol.recover(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", commit_protocol.TRACKER]
    assert commit_protocol.read_tracker(str(tmp_path)) == "iter_0000001"


def test_each_rank_syncs_its_own_files_by_name_and_rank_0_every_other_once(tmp_path,
                                                                          monkeypatch):
    """No rank lists the staging directory to find its files (at 8,192 ranks, 8,192 listings of
    8,192 names); rank 0's one walk syncs every file no rank synced as its own, each file once."""
    staging = tmp_path / "_partial_0a1b2c3d_iter_0000002"
    names = ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_2.distcp",  # __1_1 missing
             "group__1_0.distcp", "__7_0.distcp", ".metadata", "common.pt"]
    fake_checkpoint(staging, files=names)
    synced, listed = [], []
    monkeypatch.setattr(commit_protocol, "_fsync_file",
                        lambda path: synced.append(os.path.basename(path)))
    for name in ("listdir", "scandir"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda path=".", real=real: listed.append(path) or real(path))
    counts = [commit_protocol.fsync_own_files(str(staging), rank) for rank in (0, 1)]
    assert counts == [2, 1] and synced == ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp"]
    assert listed == []
    commit_protocol._fsync_unowned(str(staging), counts)
    assert sorted(synced) == sorted(names) and len(listed) == 1


@pytest.mark.parametrize("claim", ["3f00a1b2_", ""], ids=["named", "older-unnamed"])
def test_crash_between_the_two_renames_of_a_resave_is_undone(tmp_path, claim):
    # Re-saving the tracked iteration: the old directory was moved aside, then the kill came.
    # (Leftovers of this project's older versions carry no claim id.)
    fake_checkpoint(tmp_path / f"_replaced_{claim}iter_0000002")
    fake_checkpoint(tmp_path / f"_partial_{claim}iter_0000002")
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
    record = json.loads((tmp_path / writer_claim.WRITER_LOCK).read_text())
    assert record["pid"] == os.getpid() and len(record["claim"]) == 8


def test_without_file_locks_the_writer_record_decides(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = socket.gethostname()
    assert writer_claim._running_here({"host": here, "pid": os.getpid(),
                             "start": writer_claim._process_start(os.getpid())}) is True
    assert writer_claim._running_here({"host": here, "pid": dead.pid}) is False
    assert writer_claim._running_here({"host": here, "pid": os.getpid(), "start": "1"}) is False  # reused
    assert writer_claim._running_here({"host": here + "-elsewhere", "pid": os.getpid()}) is None


def test_a_writer_on_another_host_is_gone_only_when_released_or_its_heartbeat_stopped():
    elsewhere = {"host": socket.gethostname() + "-elsewhere", "pid": 1}
    fresh, stale = 10.0, writer_claim.STALE_S + 1
    assert writer_claim._holder(elsewhere, "granted", fresh)[0] == "unknown"  # node-local locks?
    assert writer_claim._holder(elsewhere, "unsupported", fresh)[0] == "unknown"
    assert writer_claim._holder(elsewhere, "granted", stale)[0] == "gone"
    assert writer_claim._holder(elsewhere, "held", stale)[0] == "live"  # a lock held wins
    assert writer_claim._holder({**elsewhere, "released": True}, "unsupported", fresh)[0] == "gone"
    here = {"host": socket.gethostname(), "pid": os.getpid(),
            "start": writer_claim._process_start(os.getpid())}
    assert writer_claim._holder(here, "granted", fresh)[0] == "gone"  # this host's lock says so
    assert writer_claim._holder({}, "granted", fresh)[0] == "gone"


def test_an_undecidable_holder_is_refused_and_keeps_its_files_until_taken_over(tmp_path,
                                                                                monkeypatch):
    """A record of a writer on another host, touched a moment ago, in a directory whose lock
    this process is granted (as node-local locks grant it): refused, nothing removed; with the
    override, or once the record is older than STALE_S, claimed and cleaned up."""
    lock = tmp_path / writer_claim.WRITER_LOCK
    lock.write_text(json.dumps({"host": "node-b", "pid": 4242, "job": "777", "since": "then"}))
    fake_checkpoint(tmp_path / "_partial_iter_0000004")
    with pytest.raises(CheckpointSaveError) as refused:
        writer_claim.WriterClaims().claim(str(tmp_path))
    message = str(refused.value)
    assert "pid 4242 on node-b, job 777" in message and "heartbeat is 0 s old" in message, message
    assert writer_claim.TAKE_OVER_ENV in message and "\n" not in message
    assert (tmp_path / "_partial_iter_0000004").is_dir() and "node-b" in lock.read_text()

    old = lock.stat().st_mtime - writer_claim.STALE_S - 1
    os.utime(lock, (old, old))
    claims = writer_claim.WriterClaims()
    done = claims.claim(str(tmp_path))
    assert any("_partial_iter_0000004" in line for line in done), done
    assert not (tmp_path / "_partial_iter_0000004").exists()

    claims.release_all()  # what atexit does: the next job needs no heartbeat's age to go on
    assert json.loads(lock.read_text())["released"] is True
    lock.write_text(json.dumps({"host": "node-b", "pid": 4242}))
    fake_checkpoint(tmp_path / "_partial_iter_0000006")
    monkeypatch.setenv(writer_claim.TAKE_OVER_ENV, "1")
    done = writer_claim.WriterClaims().claim(str(tmp_path))
    assert "taken over" in done[0] and not (tmp_path / "_partial_iter_0000006").exists(), done


def test_a_requeued_job_waits_for_its_earlier_attempt_and_another_job_is_refused_at_once(
        tmp_path, monkeypatch):
    """Slurm job 77's first attempt holds the directory (its lock still held, as a dead node's
    NFSv4 lease keeps it): attempt 1 of job 77 waits the requeue bound, saying so, then takes
    over; job 78 is refused without waiting."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from moe_launcher.checkpoint_files "
         "import writer_claim; writer_claim.claim(sys.argv[1]); print('claimed', flush=True); "
         "time.sleep(120)", str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
        env={**os.environ, "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"})
    try:
        assert holder.stdout.readline().strip() == "claimed"
        fake_checkpoint(tmp_path / "_partial_iter_0000004")
        monkeypatch.setenv(writer_claim.REQUEUE_WAIT_ENV, "1")
        monkeypatch.setenv("SLURM_JOB_ID", "78")
        start = time.monotonic()
        with pytest.raises(CheckpointSaveError, match="another live job.*job 77"):
            writer_claim.WriterClaims().claim(str(tmp_path))
        assert time.monotonic() - start < 1 and (tmp_path / "_partial_iter_0000004").is_dir()

        monkeypatch.setenv("SLURM_JOB_ID", "77")
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        said = []
        start = time.monotonic()
        done = writer_claim.WriterClaims().claim(str(tmp_path), progress=said.append)
        assert time.monotonic() - start >= 1
        assert len(said) == 1 and "earlier attempt" in said[0] and "up to 1 s" in said[0], said
        assert "taken over from this job's earlier attempt" in done[0], done
        assert not (tmp_path / "_partial_iter_0000004").exists()
        record = json.loads((tmp_path / writer_claim.WRITER_LOCK).read_text())
        assert (record["job"], record["restart"], record["pid"]) == ("77", 1, os.getpid())
    finally:
        holder.kill()
        holder.wait()


def test_the_holder_touches_its_record_while_it_holds_the_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_claim, "HEARTBEAT_S", 0.05)
    writer_claim.WriterClaims().claim(str(tmp_path))
    lock = tmp_path / writer_claim.WRITER_LOCK
    old = lock.stat().st_mtime - 100
    os.utime(lock, (old, old))
    deadline = time.monotonic() + 10
    while lock.stat().st_mtime <= old + 50:
        assert time.monotonic() < deadline, "no heartbeat"
        time.sleep(0.05)


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
        assert find_refusal(wrapped) is None
    try:
        raise IncompleteCheckpointError("[megatron_patches] refusing to save the checkpoint")
    except IncompleteCheckpointError as refusal:
        try:
            raise RuntimeError("save failed") from refusal
        except RuntimeError as wrapped:
            assert find_refusal(wrapped) is refusal


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
