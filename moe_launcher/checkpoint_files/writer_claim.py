"""One writer per --save directory, for the life of the process (rank 0).

* every rank writes into a staging directory `<save>/_partial_iter_XXXXXXX` (megatron's
  `get_checkpoint_name` is redirected for that one iteration during the call);
* megatron's own tracker write goes to a scratch file; after megatron's final barrier every rank
  fsyncs the files it wrote (in parallel: a commit costs one rank's files), then rank 0 fsyncs
  the rest (.metadata, common state, directories), renames the staging directory to
  `iter_XXXXXXX` (an existing one is first renamed to `_replaced_iter_XXXXXXX`) and then writes
  the tracker last, as write-temp + fsync + `os.replace` + fsync of the directory;
* a failing save (disk full, a dead rank) raises `CheckpointSaveError` naming the directory;
  the previous checkpoint and the tracker are untouched and the staging directory is removed.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time

from moe_launcher.checkpoint_files.commit_protocol import recover
from moe_launcher.runtime.refusals import CheckpointSaveError

WRITER_LOCK = "_checkpoint_writer.lock"


_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (tells a reused pid apart); None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _this_writer() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid()),
            "job": os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID"),
            "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def _describe(writer: dict) -> str:
    if not writer:
        return "writer unknown"
    job = f", job {writer['job']}" if writer.get("job") else ""
    return f"pid {writer.get('pid')} on {writer.get('host')}{job}, since {writer.get('since')}"


def _running_here(writer: dict) -> bool | None:
    """Whether the recorded writer's process still runs: True/False on its own host, None
    (cannot tell) on another."""
    if writer.get("host") != socket.gethostname() or not isinstance(writer.get("pid"), int):
        return None
    try:
        os.kill(writer["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it runs, as another user
    start = _process_start(writer["pid"])
    return start is None or writer.get("start") in (None, start)


class WriterClaims:
    """The --save directories this process holds the writer lock of (realpath -> the locked
    file, held open: closing it would release the lock). One per process, owned by
    atomic-checkpoint-commit and handed to its save and load wrappers."""

    def __init__(self):
        self.held: dict[str, int] = {}

    def claim(self, save_dir: str) -> list[str]:
        """See `claim`; a directory this process already holds is not claimed again."""
        key = os.path.realpath(save_dir)
        if key in self.held:
            return []
        fd, done = claim(save_dir)
        self.held[key] = fd
        return done


def claim(save_dir: str) -> tuple[int, list[str]]:
    """Makes this process the one writer of `save_dir` for its lifetime (rank 0), then cleans up
    what earlier writers, dead by then, left there. Returns the locked file (keep it open: the
    lock lives as long as it) and what was cleaned up. Raises CheckpointSaveError while another
    live job writes there."""
    os.makedirs(save_dir, exist_ok=True)
    lock = os.path.join(save_dir, WRITER_LOCK)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        previous = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        previous = {}
    done = []
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        live = False
    except OSError as exc:
        if exc.errno not in _NO_LOCKS:  # EACCES/EAGAIN: the holder lives
            live = True
        else:  # a filesystem without locks: judge by the record
            running = _running_here(previous) if previous else False
            live = bool(running) and previous.get("pid") != os.getpid()
            if running is None:
                done.append(f"file locks are not supported there, so whether its last writer "
                            f"({_describe(previous)}) still runs cannot be told; this job "
                            f"takes the directory over")
    if live:
        os.close(fd)
        raise CheckpointSaveError(
            f"refusing to write {save_dir}: another live job writes there ({_describe(previous)}"
            f"; it holds {lock}). Two jobs saving into one directory overwrite and clean up each "
            f"other's checkpoints. Fix: give this job its own --save; it may still --load "
            f"{save_dir}, which only reads the iteration the tracker names")
    record = json.dumps(_this_writer()).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    # Only a job on a filesystem without locks reads the record to judge this one alive; the
    # fsync that puts it on a shared filesystem's server for that job runs beside the load
    # (up to tens of ms on a busy server, while every rank waits for rank 0).
    threading.Thread(target=os.fsync, args=(fd,), name="writer-record-fsync",
                     daemon=True).start()
    return fd, done + recover(save_dir)
