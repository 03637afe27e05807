"""One writer per --save directory, for the life of the process (rank 0).

* every rank writes into a staging directory `<save>/_partial_<claim>_iter_XXXXXXX`, named
  with the writer's claim id (megatron's `get_checkpoint_name` is redirected for that one
  iteration during the call);
* megatron's own tracker write goes to a scratch file; after megatron's final barrier every rank
  fsyncs the files it wrote (in parallel: a commit costs one rank's files), then rank 0 fsyncs
  the rest (.metadata, common state, directories), renames the staging directory to
  `iter_XXXXXXX` (an existing one is first renamed to `_replaced_<claim>_iter_XXXXXXX`) and then
  writes the tracker last, as write-temp + fsync + `os.replace` + fsync of the directory;
* a failing save (disk full, a dead rank) raises `CheckpointSaveError` naming the directory;
  the previous checkpoint and the tracker are untouched and the staging directory is removed.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import threading
import time
from typing import Callable

from moe_launcher.checkpoint_files.commit_protocol import new_claim_id, recover
from moe_launcher.runtime.refusals import CheckpointSaveError

WRITER_LOCK = "_checkpoint_writer.lock"
# While it holds a directory, rank 0 touches the lock file this often (a thread, off the step
# path); a record untouched for STALE_S is a dead writer's. Where the lock cannot prove a writer on
# another host dead (no locks, or locks each node grants on its own: Lustre localflock, NFS
# local_lock/nolock), only that age can, and a younger one is refused, never taken over.
HEARTBEAT_S = 15.0
STALE_S = 120.0
TAKE_OVER_ENV = "MEGATRON_PATCHES_SAVE_TAKE_OVER"
# A requeued Slurm job (same SLURM_JOB_ID, higher SLURM_RESTART_COUNT) finds its earlier
# attempt's claim: after a node failure its lock can stay held for minutes (an NFSv4 lease) or
# until the node reboots. It waits this long (the other ranks wait in a collective meanwhile:
# keep it below --distributed-timeout-minutes), then takes over: Slurm requeues a job only once
# its earlier attempt was ended.
REQUEUE_WAIT_ENV = "MEGATRON_PATCHES_REQUEUE_WAIT_S"
REQUEUE_WAIT_S = 300.0
PROGRESS_S = 30.0


_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (tells a reused pid apart); None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _this_writer(claim_id: str) -> dict:
    return {"claim": claim_id, "host": socket.gethostname(), "pid": os.getpid(),
            "start": _process_start(os.getpid()),
            "job": os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID"),
            "restart": _restart_count(os.environ.get("SLURM_RESTART_COUNT")),
            "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def _restart_count(value) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _earlier_attempt_of_this_job(writer: dict) -> bool:
    job = os.environ.get("SLURM_JOB_ID")
    return bool(job) and writer.get("job") == job and _restart_count(
        writer.get("restart")) < _restart_count(os.environ.get("SLURM_RESTART_COUNT"))


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


def _holder(previous: dict, lock: str, heartbeat_age: float) -> tuple[str, str]:
    """Whether the writer `previous` records is "gone", "live" or "unknown", and why, given what
    this process's lock attempt answered ("held" by another process, "granted", "unsupported")
    and how long ago the lock file was last touched."""
    if not previous or previous.get("released"):
        return "gone", "it released the directory"
    if lock == "held":
        return "live", f"it holds {WRITER_LOCK}"
    if previous.get("host") == socket.gethostname():
        if lock == "granted":  # this host's kernel keeps its processes' locks, whatever the mount
            return "gone", "its lock on this host was released"
        if previous.get("pid") == os.getpid():
            return "gone", "it is this process"
        return ("live", "its process still runs") if _running_here(previous) else (
            "gone", "its process is gone")
    if heartbeat_age >= STALE_S:
        return "gone", f"its heartbeat stopped {heartbeat_age:.0f} s ago"
    locks = ("a lock granted here does not prove" if lock == "granted" else
             "file locks are not supported there, which cannot tell")
    return "unknown", (f"it runs on another host, its heartbeat is {heartbeat_age:.0f} s old, "
                       f"and {locks} whether it still runs (they may be node-local)")


class WriterClaims:
    """The --save directories this process holds the writer lock of (realpath -> the locked
    file, held open: closing it would release the lock). One per process, owned by
    atomic-checkpoint-commit and handed to its save and load wrappers. At exit each record is
    marked released, so that a job on another host may take the directory over at once."""

    def __init__(self):
        self.held: dict[str, tuple[int, str]] = {}  # realpath -> (locked file, claim id)

    def claim(self, save_dir: str, progress: Callable[[str], None] = lambda line: None
              ) -> list[str]:
        """See `claim`; a directory this process already holds is not claimed again."""
        key = os.path.realpath(save_dir)
        if key in self.held:
            return []
        claim_id = new_claim_id()
        fd, done = claim(save_dir, progress, claim_id)
        if not self.held:
            atexit.register(self.release_all)
        self.held[key] = fd, claim_id
        return done

    def claim_id(self, save_dir: str) -> str | None:
        """The id this process's claim of `save_dir` names its staged files with; None unclaimed."""
        held = self.held.get(os.path.realpath(save_dir))
        return held[1] if held else None

    def release_all(self) -> None:
        for fd, claim_id in self.held.values():
            try:
                record = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except ValueError:
                record = _this_writer(claim_id)
            _write_record(fd, {**record, "released": True})
        self.held.clear()


def _write_record(fd: int, record: dict) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)


def _heartbeat(lock_path: str) -> None:
    while True:
        time.sleep(HEARTBEAT_S)
        try:
            os.utime(lock_path)
        except OSError:  # a filesystem hiccup: the next beat tries again
            pass


def _look(fd: int) -> tuple[str, str, dict]:
    """The recorded writer's state and why (`_holder`), and its record."""
    heartbeat_age = time.time() - os.fstat(fd).st_mtime
    try:
        previous = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        previous = {}
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock = "granted"
    except OSError as exc:
        lock = "unsupported" if exc.errno in _NO_LOCKS else "held"  # EACCES/EAGAIN: held
    return *_holder(previous, lock, heartbeat_age), previous


def _await_earlier_attempt(fd: int, why: str, previous: dict,
                           progress: Callable[[str], None]) -> tuple[str, str]:
    """Waits up to the requeue bound for this job's earlier attempt to let go; ("gone", why) once
    it has, else ("expired", why)."""
    limit = float(os.environ.get(REQUEUE_WAIT_ENV) or REQUEUE_WAIT_S)
    start = said = time.monotonic()
    progress(f"this job's earlier attempt ({_describe(previous)}) still holds it ({why}); "
             f"waiting up to {limit:.0f} s ({REQUEUE_WAIT_ENV}) for it to let go")
    while (waited := time.monotonic() - start) < limit:
        time.sleep(min(2.0, limit - waited))
        state, why, previous = _look(fd)
        if state == "gone":
            return state, why
        if time.monotonic() - said >= PROGRESS_S:
            said = time.monotonic()
            progress(f"still waiting for this job's earlier attempt ({said - start:.0f} s of "
                     f"{limit:.0f} s): {why}")
    return "expired", why


def claim(save_dir: str, progress: Callable[[str], None] = lambda line: None,
          claim_id: str | None = None) -> tuple[int, list[str]]:
    """Makes this process the one writer of `save_dir` for its lifetime (rank 0), recorded with
    `claim_id` (its staged files' names carry it; a new one by default), then cleans up
    what earlier writers, proven gone by then, left there. Returns the locked file (keep it open:
    the lock lives as long as it) and what was cleaned up. Raises CheckpointSaveError while
    another job may still write there: never removes files in doubt. A requeued job waits for
    its own earlier attempt, saying so through `progress`."""
    os.makedirs(save_dir, exist_ok=True)
    lock_path = os.path.join(save_dir, WRITER_LOCK)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    state, why, previous = _look(fd)
    done = []
    if state != "gone" and _earlier_attempt_of_this_job(previous):
        state, why = _await_earlier_attempt(fd, why, previous, progress)
        if state == "expired":
            done.append(f"taken over from this job's earlier attempt ({_describe(previous)}) "
                        f"after waiting {os.environ.get(REQUEUE_WAIT_ENV) or REQUEUE_WAIT_S} s "
                        f"({why}): Slurm requeued this job, so that attempt was ended")
    elif state == "unknown" and os.environ.get(TAKE_OVER_ENV) == "1":
        done.append(f"taken over from its last writer ({_describe(previous)}) as "
                    f"{TAKE_OVER_ENV}=1 asks, although {why}")
    elif state != "gone":
        os.close(fd)
        if state == "live":
            raise CheckpointSaveError(
                f"refusing to write {save_dir}: another live job writes there "
                f"({_describe(previous)}; {why}). Two jobs saving into one directory overwrite "
                f"and clean up each other's checkpoints. Fix: give this job its own --save; it "
                f"may still --load {save_dir}, which only reads the iteration the tracker names")
        raise CheckpointSaveError(
            f"refusing to write {save_dir}: its last writer ({_describe(previous)}) may still "
            f"write there: {why}. Fix: give this job its own --save (it may still --load "
            f"{save_dir}); or, once that job has ended, wait until its heartbeat is {STALE_S:.0f} "
            f"s old or set {TAKE_OVER_ENV}=1")
    _write_record(fd, _this_writer(claim_id or new_claim_id()))
    # Only a job that cannot trust the lock reads the record to judge this one alive; the fsync
    # that puts it on a shared filesystem's server for that job runs beside the load (up to tens
    # of ms on a busy server, while every rank waits for rank 0).
    threading.Thread(target=os.fsync, args=(fd,), name="writer-record-fsync",
                     daemon=True).start()
    threading.Thread(target=_heartbeat, args=(lock_path,), name="writer-heartbeat",
                     daemon=True).start()
    return fd, done + recover(save_dir)
