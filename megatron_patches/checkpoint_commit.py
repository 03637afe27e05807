"""Crash-safe checkpoint saves and loads that refuse damaged files before reading them.

megatron-core 0.19.2 `megatron.training.checkpointing.save_checkpoint` writes every rank's files
straight into `<save>/iter_XXXXXXX` (its own TODO: "Handle non-empty directories (e.g., after a
crash during saving)") and then rank 0 rewrites `latest_checkpointed_iteration.txt` in place
with `open(..., 'w')`: a crash between the truncate and the write leaves an empty tracker, which
`read_metadata` answers with `sys.exit()` -- exit status 0, no training, no error. A re-save into
an iteration directory that already holds files (a crash after the files but before the tracker,
or a resumed run that saves the iteration it loaded) rewrites those files in place.

"atomic-checkpoint-commit" wraps `save_checkpoint` (module attribute, and the reference
`megatron.training.training` imported) so that, for synchronous global saves:

* every rank writes into a staging directory `<save>/_partial_iter_XXXXXXX` (megatron's
  `get_checkpoint_name` is redirected for that one iteration during the call);
* megatron's own tracker write goes to a scratch file; after megatron's final barrier every rank
  fsyncs the files it wrote (in parallel: a commit costs one rank's files), then rank 0 fsyncs
  the rest (.metadata, common state, directories), renames the staging directory to
  `iter_XXXXXXX` (an existing one is first renamed to `_replaced_iter_XXXXXXX`) and then writes
  the tracker last, as write-temp + fsync + `os.replace` + fsync of the directory;
* a failing save (disk full, a dead rank) raises `CheckpointSaveError` naming the directory;
  the previous checkpoint and the tracker are untouched and the staging directory is removed.

Only the one job that writes a directory ever cleans it up. Rank 0 claims its --save for the
life of the process with an exclusive lock on `<save>/_checkpoint_writer.lock` (a POSIX record
lock: the kernel, or the NFS/Lustre/GPFS lock manager, drops it when the process dies, however
it dies) and writes its host, pid and job there. Holding the lock proves every earlier writer
dead, so the claim then recovers what their crashes left (`recover`): a `_replaced_*` directory
the tracker still names is moved back, other leftovers are removed. A second job that would write
the same --save while the holder lives is refused, naming the holder. A job whose --load is
another directory (an evaluation, a fine-tune) only reads there: the iteration the tracker names,
never a staged one, and it writes nothing (the directory may be read-only). The claim happens at
load time when --save already exists, else at the first save. Where the filesystem has no locks
the lock file's record decides: a writer on this host whose process is gone is dead, one still
running is refused, one on another host cannot be judged, and the claim says so and goes on.

megatron's --save-retain-interval deletes the previous iteration inside save_checkpoint (a thread
started just after its tracker write), that is before this patch's commit; a crash then left the
tracker naming a deleted directory. During a wrapped save megatron's deletion
(`checkpointing._async_delete_checkpoint_impl`, which its retention code starts) only records the
request; once the tracker names the new iteration the older directory is renamed to
`_retired_iter_*` (atomic) and removed in the background. A crash at any step leaves the tracker
naming a complete directory; a crash between the tracker write and the rename keeps the older
iteration (complete, untracked) instead of deleting it.

"checkpoint-load-integrity" wraps `load_checkpoint` the same way: rank 0 resolves the
checkpoint the tracker (or --ckpt-step) names and checks it before megatron reads it -- the
tracker parses, the iteration directory exists, `.metadata` exists and unpickles, and every
`.distcp` file it references exists and is long enough for the byte ranges it lists. The
findings are shared with all ranks, so every rank refuses with the same message
(`CheckpointLoadError`, naming the directory, the tensor and the problem) instead of one rank
failing while the others wait in a collective. This complements the #1836 layout guard
(checkpoint_guard), which judges tensor shapes, not files. The same wrapper turns megatron's
assert on a resume whose learning-rate schedule differs from the checkpoint's (a raised
--train-iters without --override-opt_param-scheduler) into that refusal, naming both fixes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import functools
import inspect
import json
import os
import re
import shutil
import socket
import sys
import threading
import time
from typing import Callable

from megatron_patches import checkpoint_reads, collectives
from megatron_patches.registry import Patch, PatchContext, register

TRACKER = "latest_checkpointed_iteration.txt"
STAGING_PREFIX = "_partial_"
REPLACED_PREFIX = "_replaced_"
RETIRED_PREFIX = "_retired_"
WRITER_LOCK = "_checkpoint_writer.lock"
_MARK = "_megatron_patches_checkpoint_commit"


class CheckpointRefusal(RuntimeError):
    """A save or load this project stopped on purpose; the message says what and where."""


class CheckpointSaveError(CheckpointRefusal):
    pass


class CheckpointLoadError(CheckpointRefusal):
    pass


# --------------------------------------------------------------------------------------------
# Filesystem primitives
# --------------------------------------------------------------------------------------------
def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    # The same call as for a directory; a name of its own, so that the file fsyncs each rank
    # does (its own files only) are what tests/_io_count_launch.py counts.
    _fsync_dir(path)


# torch_dist and fsdp_dtensor name each rank's files `[<group>]__<rank>_<n>.distcp`.
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp$")


def _writer_rank(name: str) -> int | None:
    match = _RANK_FILE.search(name)
    return int(match.group(1)) if match else None


def fsync_own_files(staging: str, rank: int) -> int:
    """Fsyncs the files rank `rank` wrote into `staging` (on NFS/Lustre only the writing client
    can flush its data), several at a time; returns how many. Every rank runs it at once, so a
    commit costs one rank's files, not the whole job's one after another on rank 0."""
    own = [os.path.join(staging, name) for name in os.listdir(staging)
           if _writer_rank(name) == rank]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(own) or 1)) as pool:
        list(pool.map(_fsync_file, own))
    return len(own)


def _fsync_unowned(staging: str, world_size: int) -> None:
    """Fsyncs what no rank of `world_size` claims by name (.metadata, common state, files of
    other naming schemes), and every directory (rank 0, after all ranks synced their own)."""
    for root, _, files in os.walk(staging):
        for name in files:
            writer = _writer_rank(name) if root == staging else None
            if writer is None or not 0 <= writer < world_size:
                _fsync_file(os.path.join(root, name))
        _fsync_dir(root)


def write_tracker(save_dir: str, value: str) -> None:
    """Replaces the tracker atomically: a reader sees the old or the new value, never a
    partial one, also after a crash or power loss."""
    tracker = os.path.join(save_dir, TRACKER)
    temporary = f"{tracker}.tmp.{os.getpid()}"
    with open(temporary, "w") as f:
        f.write(value)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, tracker)
    _fsync_dir(save_dir)


def iteration_dirname(iteration: int, release: bool = False) -> str:
    return "release" if release else f"iter_{iteration:07d}"


def read_tracker(save_dir: str) -> str | None:
    """The tracker's iteration directory name; None without a tracker; CheckpointLoadError
    when it does not parse."""
    tracker = os.path.join(save_dir, TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    if text == "release":
        return "release"
    try:
        return iteration_dirname(int(text))
    except ValueError:
        raise CheckpointLoadError(
            f"refusing to load {save_dir}: {tracker} holds {text!r}, not an iteration number "
            f"(a save interrupted while megatron rewrote it in place); fix: write the iteration "
            f"of a complete iter_* directory into it") from None


def recover(save_dir: str) -> list[str]:
    """Undoes what a crash during a save or commit can leave; returns what it did. Only for the
    directory's one writer (`claim`): every other job's files there may be in use."""
    if not save_dir or not os.path.isdir(save_dir):
        return []
    done = []
    try:
        target = read_tracker(save_dir)
    except CheckpointLoadError:
        target = None
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        if name.startswith(REPLACED_PREFIX):
            original = name[len(REPLACED_PREFIX):]
            if original == target and not os.path.exists(os.path.join(save_dir, original)):
                os.rename(path, os.path.join(save_dir, original))
                done.append(f"restored {original} (a commit was interrupted)")
            else:
                shutil.rmtree(path, ignore_errors=True)
                done.append(f"removed {name}")
        elif name.startswith(RETIRED_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {name} (dropped by --save-retain-interval)")
        elif name.startswith(STAGING_PREFIX) or name.startswith(TRACKER + ".tmp."):
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
            done.append(f"removed {name} (an interrupted save)")
    if done:
        _fsync_dir(save_dir)
    return done


def commit(save_dir: str, dirname: str, tracker_value: str) -> None:
    """Publishes the staged iteration directory, then the tracker (rank 0), once every rank has
    synced its own files (`fsync_own_files`)."""
    staging = os.path.join(save_dir, STAGING_PREFIX + dirname)
    final = os.path.join(save_dir, dirname)
    replaced = os.path.join(save_dir, REPLACED_PREFIX + dirname)
    _fsync_unowned(staging, collectives.world_size())
    if os.path.lexists(final):
        os.rename(final, replaced)
    os.rename(staging, final)
    _fsync_dir(save_dir)
    write_tracker(save_dir, tracker_value)
    if os.path.lexists(replaced):
        shutil.rmtree(replaced, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# One writer per directory
# --------------------------------------------------------------------------------------------
_claimed: dict[str, int] = {}  # realpath of a --save this process writes -> its locked file
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


def claim(save_dir: str) -> list[str]:
    """Makes this process the one writer of `save_dir` for its lifetime (rank 0), then cleans up
    what earlier writers, dead by then, left there; returns what it did. Raises
    CheckpointSaveError while another live job writes there."""
    key = os.path.realpath(save_dir)
    if key in _claimed:
        return []
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
    _claimed[key] = fd  # held open: closing it would release the lock
    return done + recover(save_dir)


# --------------------------------------------------------------------------------------------
# --save-retain-interval deletions, after the commit
# --------------------------------------------------------------------------------------------
def remove_retired(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    print(f"[megatron_patches] atomic-checkpoint-commit: removed "
          f"{os.path.basename(path).removeprefix(RETIRED_PREFIX)} from {os.path.dirname(path)} "
          f"(--save-retain-interval), after the tracker moved past it", flush=True)


def drop_iteration(save_dir: str, iteration: int) -> None:
    """Deletes an iteration the tracker no longer names: renamed aside first (atomic), so a crash
    during the removal leaves a `_retired_*` leftover, never a half-deleted `iter_*`."""
    dirname = iteration_dirname(iteration)
    source = os.path.join(save_dir, dirname)
    retired = os.path.join(save_dir, RETIRED_PREFIX + dirname)
    try:
        os.rename(source, retired)
        _fsync_dir(save_dir)
        remove_retired(retired)
    except OSError as exc:  # as megatron's own deletion: not fatal to training
        print(f"[megatron_patches] atomic-checkpoint-commit: could not delete {source}: {exc}",
              flush=True)


class DeferredRetention:
    """The deletions megatron's retention asks for during one save, carried out once that save is
    committed (or never, when it fails). It stands in for megatron's
    `_async_delete_checkpoint_impl`, which megatron runs in a thread that may start late."""

    def __init__(self):
        self._lock = threading.Lock()
        self._requested: list[tuple[str, int]] = []
        self._state = "saving"

    def request(self, save_path: str, iteration_to_delete: int, *_, **__) -> None:
        with self._lock:
            state = self._state
            if state == "saving":
                self._requested.append((save_path, iteration_to_delete))
        if state == "committed":  # megatron's thread ran after the commit: delete now
            drop_iteration(save_path, iteration_to_delete)

    def committed(self) -> None:
        with self._lock:
            self._state, requested, self._requested = "committed", self._requested, []
        for save_path, iteration in requested:  # in the background, as megatron does
            threading.Thread(target=drop_iteration, args=(save_path, iteration)).start()

    def abandoned(self) -> None:
        with self._lock:
            self._state, self._requested = "abandoned", []


# --------------------------------------------------------------------------------------------
# Checkpoint file integrity (metadata only)
# --------------------------------------------------------------------------------------------
def file_problems(iteration_dir: str) -> list[str]:
    """What is missing or short in a torch_dist/fsdp_dtensor directory, judged from `.metadata`:
    each problem names the tensor (or file) and what is wrong. Reads no tensor data."""
    metadata_path = os.path.join(iteration_dir, ".metadata")
    if not os.path.isdir(iteration_dir):
        return [f"{iteration_dir} does not exist"]
    if not os.path.isfile(metadata_path):
        return [f".metadata is missing (the file that lists every tensor), so no tensor can "
                f"be located"]
    try:
        metadata = checkpoint_reads.read_metadata(iteration_dir)
    except Exception as exc:  # a truncated or garbled pickle raises anything
        return [f".metadata is unreadable ({type(exc).__name__}: {exc})"]
    storage = getattr(metadata, "storage_data", None) or {}
    needed: dict[str, tuple[int, str]] = {}  # file -> (bytes needed, a tensor stored there)
    for index, info in storage.items():
        end = info.offset + info.length
        if end > needed.get(info.relative_path, (-1, ""))[0]:
            needed[info.relative_path] = (end, index.fqn)
    problems = []
    for relative, (end, fqn) in sorted(needed.items()):
        path = os.path.join(iteration_dir, relative)
        if not os.path.isfile(path):
            problems.append(f"{fqn}: its file {relative} is missing")
            continue
        size = os.stat(path).st_size
        if size < end:
            problems.append(f"{fqn}: its file {relative} is truncated ({size} bytes, the "
                            f"metadata needs {end})")
    return problems


def _is_dist_checkpoint(iteration_dir: str, ckpt_format: str | None) -> bool:
    if ckpt_format in ("torch_dist", "fsdp_dtensor", "torch_dcp"):
        return True
    return os.path.isfile(os.path.join(iteration_dir, ".metadata")) or any(
        n.endswith(".distcp") for n in os.listdir(iteration_dir))


def load_problems(load_dir: str, ckpt_step: int | None, ckpt_format: str | None) -> list[str]:
    """This rank's view of what is wrong with the checkpoint a load would read; [] when fine or
    when there is nothing to load (megatron then starts from scratch, as it always did)."""
    try:
        dirname = iteration_dirname(ckpt_step) if ckpt_step else read_tracker(load_dir)
    except CheckpointLoadError as exc:
        return [str(exc)]
    if dirname is None:
        return []
    iteration_dir = os.path.join(load_dir, dirname)
    if not os.path.isdir(iteration_dir):
        return [f"refusing to load {iteration_dir}: the directory does not exist "
                f"({'--ckpt-step' if ckpt_step else TRACKER} names it)"]
    if not _is_dist_checkpoint(iteration_dir, ckpt_format):
        return []
    problems = file_problems(iteration_dir)
    if not problems:
        return []
    shown = "; ".join(problems[:6]) + (f"; ... and {len(problems) - 6} more"
                                       if len(problems) > 6 else "")
    return [f"refusing to load {iteration_dir}: {shown}. The checkpoint is damaged; audit it "
            f"with `python -m megatron_patches.checkpoint_audit {iteration_dir}` and load an "
            f"earlier iteration with --ckpt-step"]


# --------------------------------------------------------------------------------------------
# Wrappers
# --------------------------------------------------------------------------------------------
def _own(save_dir: str, create: bool) -> None:
    """On every rank: rank 0 claims `save_dir` (`claim`; only when it exists unless `create`)
    and reports what it cleaned up; a refusal is raised on every rank alike."""
    outcome: tuple[str, list[str]] = ("claimed", [])
    if collectives.rank() == 0 and (create or os.path.isdir(save_dir)):
        try:
            outcome = ("claimed", claim(save_dir))
        except CheckpointSaveError as exc:
            outcome = ("refused", [str(exc)])
        except OSError as exc:  # e.g. not writable: megatron's own save reports that
            outcome = ("claimed", [f"could not claim it for this job ({exc}); nothing there "
                                   f"is cleaned up"])
    kind, lines = collectives.gather_objects(outcome)[0]
    if kind == "refused":
        raise CheckpointSaveError(lines[0])
    if collectives.rank() == 0:
        for line in lines:
            print(f"[megatron_patches] atomic-checkpoint-commit: {save_dir}: {line}", flush=True)


@contextlib.contextmanager
def _redirected(checkpointing, save_dir: str, dirname: str, scratch_tracker: str,
                retention: DeferredRetention):
    """During megatron's save, files of `dirname` go to the staging directory, the tracker to a
    scratch file (carrying the current value, which megatron reads for retention) and retention
    deletions to `retention`. Yields the list of calls to run once the checkpoint is committed."""
    final = os.path.join(save_dir, dirname)
    staging = os.path.join(save_dir, STAGING_PREFIX + dirname)
    get_name = checkpointing.get_checkpoint_name
    get_tracker = checkpointing.get_checkpoint_tracker_filename

    def get_checkpoint_name(*args, **kwargs):
        name = get_name(*args, **kwargs)
        if name == final or name.startswith(final + os.sep):
            name = staging + name[len(final):]
        return name

    def get_checkpoint_tracker_filename(path):
        if os.path.normpath(path) == os.path.normpath(save_dir):
            return scratch_tracker
        return get_tracker(path)

    # wandb logs the checkpoint as an artifact; hold that back until the commit (the caller
    # runs the deferred calls with the final paths).
    wandb_utils = getattr(checkpointing, "wandb_utils", None)
    on_saved = getattr(wandb_utils, "on_save_checkpoint_success", None)
    deferred: list[Callable[[], None]] = []

    def on_save_checkpoint_success(checkpoint_path, tracker_filename, directory, iteration):
        deferred.append(lambda: on_saved(
            final + checkpoint_path[len(staging):] if checkpoint_path.startswith(staging)
            else checkpoint_path, get_tracker(directory), directory, iteration))

    delete = getattr(checkpointing, "_async_delete_checkpoint_impl", None)
    checkpointing.get_checkpoint_name = get_checkpoint_name
    checkpointing.get_checkpoint_tracker_filename = get_checkpoint_tracker_filename
    if on_saved is not None:
        wandb_utils.on_save_checkpoint_success = on_save_checkpoint_success
    if delete is not None:
        checkpointing._async_delete_checkpoint_impl = retention.request
    try:
        yield deferred
    finally:
        checkpointing.get_checkpoint_name = get_name
        checkpointing.get_checkpoint_tracker_filename = get_tracker
        if on_saved is not None:
            wandb_utils.on_save_checkpoint_success = on_saved
        if delete is not None:
            checkpointing._async_delete_checkpoint_impl = delete


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    causes = [line.strip() for line in text[1:] if "Error" in line and ":" in line]
    return f"{type(exc).__name__}: {text[0] if text else ''}" + (
        f" / {causes[-1]}" if causes else "")


def _is_deliberate_refusal(exc: BaseException) -> bool:
    """Whether a patch refused the save on purpose (its message names what is wrong and the
    fix), anywhere in the exception chain. Such errors set `refusal_names_its_fix = True`."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if getattr(exc, "refusal_names_its_fix", False):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _room(save_dir: str) -> str:
    """Free space and the file-size limit where the save failed (what 'disk full' looks like)."""
    import resource

    parts = []
    with contextlib.suppress(OSError):
        parts.append(f"{shutil.disk_usage(save_dir).free // 2**20} MiB free there")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        parts.append(f"file-size limit {limit} bytes")
    return ", ".join(parts) or "free space unknown"


_retention_note_said = False


def _say_once_if_retention_not_deferred(checkpointing, margs) -> None:
    global _retention_note_said
    if (getattr(margs, "save_retain_interval", None) and collectives.rank() == 0
            and not hasattr(checkpointing, "_async_delete_checkpoint_impl")
            and not _retention_note_said):
        _retention_note_said = True
        print("[megatron_patches] atomic-checkpoint-commit: this megatron-core deletes "
              "--save-retain-interval checkpoints without _async_delete_checkpoint_impl, so "
              "their deletion is not deferred past the commit", flush=True)


def _fsync_own_files_everywhere(staging: str) -> None:
    """Every rank syncs its own files; a rank that cannot makes every rank raise, instead of
    leaving the others in the commit barrier."""
    try:
        failure = None
        fsync_own_files(staging, collectives.rank())
    except OSError as exc:
        failure = f"rank {collectives.rank()} could not fsync its files: {exc}"
    failures = [f for f in collectives.gather_objects(failure) if f]
    if failures:
        raise OSError(errno.EIO, "; ".join(failures))


def _wrap_save(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_checkpoint(*args, **kwargs):
        from megatron.training import checkpointing
        from megatron.training.global_vars import get_args

        margs = get_args()
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        if margs.async_save or call.arguments.get("non_persistent_ckpt") or not margs.save:
            return original(*args, **kwargs)  # async/local saves commit elsewhere
        save_dir = margs.save
        release = bool(call.arguments.get("release"))
        iteration = call.arguments["iteration"]
        dirname = iteration_dirname(iteration, release)
        scratch = os.path.join(save_dir, STAGING_PREFIX + TRACKER)
        rank0 = collectives.rank() == 0
        _own(save_dir, create=True)
        _say_once_if_retention_not_deferred(checkpointing, margs)
        if rank0 and os.path.isfile(os.path.join(save_dir, TRACKER)):
            shutil.copyfile(os.path.join(save_dir, TRACKER), scratch)
        staging = os.path.join(save_dir, STAGING_PREFIX + dirname)
        retention = DeferredRetention()
        try:
            with _redirected(checkpointing, save_dir, dirname, scratch, retention) as after_commit:
                result = original(*args, **kwargs)
            _fsync_own_files_everywhere(staging)
            if rank0:
                commit(save_dir, dirname, "release" if release else str(iteration))
                if os.path.exists(scratch):
                    os.unlink(scratch)
                retention.committed()
            collectives.barrier()  # the save returns on every rank only once it is committed
            for deferred in after_commit:
                deferred()
        except (KeyboardInterrupt, SystemExit):
            retention.abandoned()
            raise
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            retention.abandoned()
            if rank0:
                shutil.rmtree(staging, ignore_errors=True)
                with contextlib.suppress(OSError):
                    os.unlink(scratch)
            try:
                kept = read_tracker(save_dir)
            except CheckpointLoadError:
                kept = None
            state = (f"{dirname} was committed before the failure ({TRACKER} names it)"
                     if kept == dirname else
                     f"nothing was committed: {TRACKER} still names {kept or 'no checkpoint'}, "
                     f"which is unchanged; the partial {STAGING_PREFIX + dirname} was removed")
            if _is_deliberate_refusal(exc):  # e.g. a checkpoint guard: its message has the fix
                fix = (f"; {state}. Fix: as the refusal says; the run can resume with --load "
                       f"{save_dir}")
            else:
                fix = (f"({_room(save_dir)}); {state}. Fix: free space in (or point --save away "
                       f"from) {save_dir}, then resume with --load {save_dir}")
            raise CheckpointSaveError(
                f"saving iteration {iteration} to {save_dir} failed on rank {collectives.rank()}: "
                f"{_first_line(exc)} {fix}") from exc
        return result

    setattr(save_checkpoint, _MARK, True)
    return save_checkpoint


def _wrap_load(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_checkpoint(*args, **kwargs):
        from megatron.training import checkpointing
        from megatron.training.global_vars import get_args

        margs = get_args()
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        load_dir = getattr(margs, call.arguments.get("load_arg") or "load", None)
        # This job's own --save is claimed (and recovered) before anything is read from it;
        # only atomic-checkpoint-commit's saves need the claim.
        if margs.save and hasattr(checkpointing.save_checkpoint, _MARK):
            _own(margs.save, create=False)
        # One read of `.metadata` per rank for this check, the #1836 guard and megatron's load.
        with checkpoint_reads.reading_once():
            if load_dir and os.path.isdir(load_dir):  # read only: it may be another job's
                # One rank reads the files (on a shared filesystem every rank sees the same
                # ones: 1,024 ranks stat-ing every .distcp file is millions of metadata
                # operations), all ranks get its verdict.
                problems = collectives.union(
                    load_problems(load_dir, getattr(margs, "ckpt_step", None),
                                  getattr(margs, "ckpt_format", None))
                    if collectives.rank() == 0 else [])
                if problems:
                    raise CheckpointLoadError(" | ".join(problems))
            with _schedule_mismatch_refused(call.arguments.get("opt_param_scheduler"), load_dir):
                return original(*args, **kwargs)

    setattr(load_checkpoint, _MARK, True)
    return load_checkpoint


# What megatron's scheduler check calls each value, and the flags that set it.
_SCHEDULE_FLAGS = {
    "learning rate": "--lr",
    "minimum learning rate": "--min-lr",
    "warmup iterations": "--lr-warmup-iters/--lr-warmup-fraction/--lr-warmup-samples",
    "total number of iterations": "--train-iters/--lr-decay-iters/--train-samples/"
                                  "--lr-decay-samples",
    "learning rate decay style": "--lr-decay-style",
}
_SCHEDULE_MISMATCH = re.compile(r"OptimizerParamScheduler: class input value (?P<ours>.*?) and "
                                r"checkpoint ?value (?P<saved>.*?) for (?P<name>.+?) do not match")


@contextlib.contextmanager
def _schedule_mismatch_refused(scheduler, load_dir: str | None):
    """A resume whose learning-rate schedule differs from the checkpoint's (most often a raised
    --train-iters, which moves the decay end) fails megatron's assert in the scheduler's
    load_state_dict: a traceback on every rank. The same check, megatron's own, becomes a
    refusal that names the flags and both fixes; any other assertion passes through."""
    if scheduler is None:
        yield
        return
    load_state_dict = scheduler.load_state_dict

    def checked_load_state_dict(state_dict):
        try:
            return load_state_dict(state_dict)
        except AssertionError as error:
            found = _SCHEDULE_MISMATCH.search(str(error))
            if found is None:
                raise
            name = found["name"]
            raise CheckpointLoadError(
                f"refusing to resume from {load_dir}: {_SCHEDULE_FLAGS.get(name, name)}: this "
                f"command line's {name} is {found['ours']}, the checkpoint's is "
                f"{found['saved']}; fix: add --override-opt_param-scheduler to train on with "
                f"this command line's schedule, or --use-checkpoint-opt_param-scheduler to keep "
                f"the checkpoint's") from None

    scheduler.load_state_dict = checked_load_state_dict  # this load only: megatron's call site
    try:
        yield
    finally:
        del scheduler.load_state_dict


def _install(name: str, wrapper: Callable[[Callable], Callable]) -> None:
    from megatron.training import checkpointing, training

    for module in (checkpointing, training):
        current = getattr(module, name, None)
        if current is not None and not hasattr(current, _MARK):
            setattr(module, name, wrapper(current))


# --------------------------------------------------------------------------------------------
# Patches
# --------------------------------------------------------------------------------------------
def _commit_not_needed(context: PatchContext) -> str | None:
    from megatron.training import checkpointing

    source = inspect.getsource(checkpointing.save_checkpoint)
    if "os.replace(" in source or "os.rename(" in source:
        return "megatron-core already commits checkpoints by rename"
    return None


def _load_check_not_needed(context: PatchContext) -> str | None:
    return None  # megatron checks no file against .metadata before its collective reads


def _apply_load_check() -> None:
    checkpoint_reads.install()  # its `.metadata` read is the one megatron's load then reuses
    _install("load_checkpoint", _wrap_load)


register(Patch(
    name="atomic-checkpoint-commit",
    upstream="Megatron-LM save_checkpoint TODO 'Handle non-empty directories (e.g., after a "
             "crash during saving)'; in-place tracker write",
    versions=">=0.15,<0.20",
    summary="megatron.training.checkpointing.save_checkpoint writes to _partial_iter_*, rank 0 "
            "renames it into place, then replaces the tracker (temp + fsync + os.replace); one "
            "locked writer per --save cleans up; --save-retain-interval deletes after the commit",
    not_needed_because=_commit_not_needed,
    apply=lambda: _install("save_checkpoint", _wrap_save),
))

register(Patch(
    name="checkpoint-load-integrity",
    upstream="local (megatron reads damaged files rank by rank; no pre-load check)",
    versions=">=0.15,<0.20",
    summary="megatron.training.checkpointing.load_checkpoint first checks tracker, .metadata "
            "and .distcp sizes (on rank 0) and refuses a damaged checkpoint on every rank",
    not_needed_because=_load_check_not_needed,
    apply=_apply_load_check,
))


def refusal_types() -> tuple[type, ...]:
    """Exceptions the launcher prints as one line per rank, without a traceback. The #1836
    guard's IncompleteCheckpointError keeps megatron's per-rank error report (its tests read
    it); it names the directory and the tensors either way."""
    return (CheckpointRefusal,)


def refusal_line(exc: BaseException) -> str:
    rank = os.environ.get("RANK", "0")
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"pretrain_moe: error: [rank {rank}] {text}"


if __name__ == "__main__":  # python -m megatron_patches.checkpoint_commit DIR: file check
    problems = load_problems(sys.argv[1], None, None)
    print("\n".join(problems) or "ok")
    sys.exit(1 if problems else 0)
