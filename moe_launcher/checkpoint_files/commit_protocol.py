"""The commit protocol of a checkpoint directory: files staged under `_partial_<iteration>`,
synced by the ranks that wrote them, renamed into place, then the tracker replaced atomically
(write-temp + fsync + os.replace + fsync of the directory). `recover` undoes what a crash at any
step leaves; only the directory's one writer (writer_claim) may run it.

Plain file operations, no megatron: the atomic-checkpoint-commit patch drives them around
megatron's save_checkpoint, the load-integrity patch reads the tracker with them.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil

from moe_launcher.runtime import collectives
from moe_launcher.runtime.durable_files import fsync_path
from moe_launcher.runtime.refusals import CheckpointLoadError

TRACKER = "latest_checkpointed_iteration.txt"
STAGING_PREFIX = "_partial_"
REPLACED_PREFIX = "_replaced_"
RETIRED_PREFIX = "_retired_"


def _fsync_file(path: str) -> None:
    # The same call as for a directory; a name of its own, so that the file fsyncs each rank
    # does (its own files only) are what tests/_io_count_launch.py counts.
    fsync_path(path)


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
        fsync_path(root)


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
    fsync_path(save_dir)


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
        fsync_path(save_dir)
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
    fsync_path(save_dir)
    write_tracker(save_dir, tracker_value)
    if os.path.lexists(replaced):
        shutil.rmtree(replaced, ignore_errors=True)
