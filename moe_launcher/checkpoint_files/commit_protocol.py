"""The commit protocol of a checkpoint directory: files staged under `_partial_<claim>_<iteration>`,
synced by the ranks that wrote them, renamed into place, then the tracker replaced atomically
(write-temp + fsync + os.replace + fsync of the directory). `recover` undoes what a crash at any
step leaves; only the directory's one writer (writer_claim) may run it.

Every name a writer stages, replaces or retires under carries its claim id (`private_name`), and
the tracker's temporary file is made with O_EXCL: were two jobs ever to write one directory, no
save, commit or failure of one renames or removes a file of the other's by name.

Plain file operations, no megatron: the atomic-checkpoint-commit patch drives them around
megatron's save_checkpoint, the load-integrity patch reads the tracker with them.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import secrets
import shutil
import tempfile

from moe_launcher.runtime.durable_files import fsync_path
from moe_launcher.runtime.refusals import CheckpointLoadError

TRACKER = "latest_checkpointed_iteration.txt"
STAGING_PREFIX = "_partial_"
REPLACED_PREFIX = "_replaced_"
RETIRED_PREFIX = "_retired_"
# A writer's claim id: 8 hex digits; older versions of this project named leftovers without one.
_CLAIM_ID = re.compile(r"[0-9a-f]{8}_")


def new_claim_id() -> str:
    return secrets.token_hex(4)


def private_name(prefix: str, claim_id: str, name: str) -> str:
    """What writer `claim_id` calls `name` (an iteration directory, the tracker) while it stages,
    replaces or retires it."""
    return f"{prefix}{claim_id}_{name}"


def public_name(leftover: str, prefix: str) -> str:
    """The name a `private_name` (or an older, id-less leftover) stands for."""
    rest = leftover[len(prefix):]
    return rest[claim.end():] if (claim := _CLAIM_ID.match(rest)) else rest


def _fsync_file(path: str) -> None:
    # The same call as for a directory; a name of its own, so that the file fsyncs each rank
    # does (its own files only) are what tests/_io_count_launch.py counts.
    fsync_path(path)


# torch_dist and fsdp_dtensor name each rank's files `__<rank>_<n>.distcp`, n counting from 0
# (megatron's FileSystemWriterAsync and torch's FileSystemWriter alike).
_RANK_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")


def _own_files(staging: str, rank: int):
    """The files rank `rank` wrote into `staging`, found by name (`__<rank>_0.distcp`, `_1`, ...
    until one is missing): no listing of a directory that holds every rank's files."""
    n = 0
    while os.path.exists(path := os.path.join(staging, f"__{rank}_{n}.distcp")):
        yield path
        n += 1


def fsync_own_files(staging: str, rank: int) -> int:
    """Fsyncs the files rank `rank` wrote into `staging` (on NFS/Lustre only the writing client
    can flush its data), several at a time; returns how many. Every rank runs it at once, so a
    commit costs one rank's files, not the whole job's one after another on rank 0, and no rank
    lists the directory (at 8,192 ranks, 8,192 listings of 8,192 names)."""
    own = list(_own_files(staging, rank))
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(own) or 1)) as pool:
        list(pool.map(_fsync_file, own))
    return len(own)


def _fsync_unowned(staging: str, synced: list[int]) -> None:
    """Fsyncs what no rank synced as its own (`synced[r]`: how many `fsync_own_files` found for
    rank r) -- .metadata, common state, names of other shapes -- and every directory (rank 0,
    after all ranks synced their own)."""
    for root, _, files in os.walk(staging):
        for name in files:
            own = _RANK_FILE.fullmatch(name) if root == staging else None
            if not own or not (int(own.group(1)) < len(synced)
                               and int(own.group(2)) < synced[int(own.group(1))]):
                _fsync_file(os.path.join(root, name))
        fsync_path(root)


def write_tracker(save_dir: str, value: str) -> None:
    """Replaces the tracker atomically: a reader sees the old or the new value, never a
    partial one, also after a crash or power loss."""
    tracker = os.path.join(save_dir, TRACKER)
    descriptor, temporary = tempfile.mkstemp(prefix=TRACKER + ".tmp.", dir=save_dir)
    with os.fdopen(descriptor, "w") as f:
        f.write(value)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, tracker)
    fsync_path(save_dir)


def iteration_dirname(iteration: int, release: bool = False) -> str:
    return "release" if release else f"iter_{iteration:07d}"


def loaded_dirname(load_dir: str, ckpt_step: int | None) -> str | None:
    """The iteration folder's name a load of `load_dir` reads: --ckpt-step's, else the
    tracker's (None without a tracker); CheckpointLoadError when the tracker does not parse."""
    return iteration_dirname(ckpt_step) if ckpt_step else read_tracker(load_dir)


def loaded_iteration_dir(load_dir: str | None, ckpt_step: int | None) -> str | None:
    """The iteration folder a load of `load_dir` reads, where it exists; None where there is
    none to judge (the load checks refuse a tracker that does not parse)."""
    if not load_dir or not os.path.isdir(load_dir):
        return None
    try:
        name = loaded_dirname(load_dir, ckpt_step)
    except CheckpointLoadError:
        return None
    path = os.path.join(load_dir, name) if name else None
    return path if path and os.path.isdir(path) else None


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
            original = public_name(name, REPLACED_PREFIX)
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


def commit(save_dir: str, dirname: str, tracker_value: str, claim_id: str,
           synced: list[int]) -> None:
    """Publishes writer `claim_id`'s staged iteration directory, then the tracker (rank 0), once
    every rank r has synced its own `synced[r]` files (`fsync_own_files`)."""
    staging = os.path.join(save_dir, private_name(STAGING_PREFIX, claim_id, dirname))
    final = os.path.join(save_dir, dirname)
    replaced = os.path.join(save_dir, private_name(REPLACED_PREFIX, claim_id, dirname))
    _fsync_unowned(staging, synced)
    if os.path.lexists(final):
        os.rename(final, replaced)
    os.rename(staging, final)
    fsync_path(save_dir)
    write_tracker(save_dir, tracker_value)
    if os.path.lexists(replaced):
        shutil.rmtree(replaced, ignore_errors=True)
