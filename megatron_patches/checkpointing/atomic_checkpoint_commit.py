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

Only the one job that writes a directory ever cleans it up, and only once the earlier writer is
proven gone. Rank 0 claims its --save for the life of the process with an exclusive lock on
`<save>/_checkpoint_writer.lock` and a record there (host, pid, job; a heartbeat: the file's mtime,
touched while it holds the claim; "released" at exit). The claim then recovers what earlier
writers' crashes left (`recover`): a `_replaced_*` directory the tracker still names is moved
back, other leftovers are removed. A second job that would write the same --save while the holder
lives is refused, naming the holder; so is one that cannot tell (a writer on another host whose
heartbeat is fresh, where locks may be node-local or absent). A job whose --load is another
directory (an evaluation, a fine-tune) only reads there: the iteration the tracker names, never a
staged one, and it writes nothing (the directory may be read-only). The claim happens at load time
when --save already exists, else at the first save.

A multi-node run that saves has its --save judged one folder shared by every node before the
load and iteration 1 (where get_megatron_optimizer gets the built model): on node-local storage
each node would keep only its own ranks' files (moe_launcher/checkpoint_files/node_view.py).

The claim and its liveness rules: moe_launcher/checkpoint_files/writer_claim.py.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import os
import shutil
from typing import Callable

from megatron_patches.registry import Patch, PatchContext, register, wrapped_by
from moe_launcher.checkpoint_files import commit_protocol, node_view, save_continuity
from moe_launcher.checkpoint_files.commit_protocol import (
    STAGING_PREFIX,
    TRACKER,
    iteration_dirname,
    private_name,
    read_tracker,
)
from moe_launcher.checkpoint_files.retention import DeferredRetention
from moe_launcher.checkpoint_files.writer_claim import WriterClaims
from moe_launcher.runtime import collectives
from moe_launcher.runtime.refusals import (
    CheckpointLoadError,
    CheckpointSaveError,
    exceptions_in,
    find_refusal,
)

PATCH_NAME = "atomic-checkpoint-commit"
# Where a save that fails for a reason other than room leaves its traceback, one file per rank.
SAVE_FAILURES = "_save_failures"


def own(claims: WriterClaims, save_dir: str, create: bool, margs) -> str:
    """On every rank: rank 0 claims `save_dir` (`claims.claim`; only when it exists unless `create`),
    at its first claim moves aside what this run would write over (save_continuity.set_aside) and
    reports what it did; a refusal is raised on every rank alike. Returns, on every rank, the id
    this job's staged names carry (the claim's; a new one where rank 0 could not claim)."""
    outcome: tuple[str, list[str]] = ("claimed", [])
    claim_id = None
    if collectives.rank() == 0 and (create or os.path.isdir(save_dir)):
        first = os.path.realpath(save_dir) not in claims.held
        try:
            lines = claims.claim(save_dir, progress=lambda line: print(
                f"[megatron_patches] atomic-checkpoint-commit: {save_dir}: {line}", flush=True))
            if first and (line := save_continuity.set_aside(save_continuity.save_use(margs))):
                lines.append(line)
            outcome = ("claimed", lines)
        except CheckpointSaveError as exc:
            outcome = ("refused", [str(exc)])
        except OSError as exc:  # e.g. not writable: megatron's own save reports that
            outcome = ("claimed", [f"could not claim it for this job ({exc}); nothing there "
                                   f"is cleaned up"])
        claim_id = claims.claim_id(save_dir) or commit_protocol.new_claim_id()
    (kind, lines), claim_id = collectives.gather_objects((outcome, claim_id))[0]
    if kind == "refused":
        raise CheckpointSaveError(lines[0], every_rank=True)
    if collectives.rank() == 0:
        for line in lines:
            print(f"[megatron_patches] atomic-checkpoint-commit: {save_dir}: {line}", flush=True)
    return claim_id


@contextlib.contextmanager
def _redirected(checkpointing, save_dir: str, dirname: str, staging: str, scratch_tracker: str,
                retention: DeferredRetention):
    """During megatron's save, files of `dirname` go to `staging`, the tracker to a scratch file
    (carrying the current value, which megatron reads for retention) and retention deletions to
    `retention`. Yields the list of calls to run once the checkpoint is committed."""
    final = os.path.join(save_dir, dirname)
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


# A save that failed for want of room, by errno: what ran out, and what to do about it.
_OUT_OF_ROOM = {
    errno.ENOSPC: ("no space left on the device", "free space in (or point --save away from)"),
    errno.EDQUOT: ("disk quota exceeded", "free space in your quota for (or point --save away "
                                          "from)"),
    errno.EFBIG: ("file too large", "raise the file-size limit (ulimit -f) or point --save at "
                                    "a filesystem that takes larger files than"),
}
# Without a previous checkpoint to measure the save by, a filesystem with less than this free
# is taken as full.
_FULL_WITHOUT_MEASURE = 64 * 2**20


def _file_sizes(directory: str) -> list[int]:
    sizes = []
    for root, _, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(OSError):
                sizes.append(os.path.getsize(os.path.join(root, name)))
    return sizes


def _short_of_room(exc: BaseException, save_dir: str, kept: str | None,
                   staging: str) -> tuple[str, str] | None:
    """(what ran out, the fix) when the save failed for want of room, else None.

    An errno (ENOSPC, EDQUOT, EFBIG) anywhere in the exception chain, or as text in another
    rank's error, decides. megatron-core 0.19.2 loses it for tensor files: torch's zip writer
    reports a failed write as a RuntimeError ("unexpected pos ..."), and megatron's writer
    replaces a worker's error by the name of its type. So the room is also measured, against
    what the save needs: the checkpoint the tracker names (same model, same layout). Called
    before the partial directory is removed (its files show a file-size limit reached)."""
    for current in exceptions_in(exc):
        if isinstance(current, OSError) and current.errno in _OUT_OF_ROOM:
            return _OUT_OF_ROOM[current.errno]
    text = str(exc)
    for code, verdict in _OUT_OF_ROOM.items():
        if f"[Errno {code}]" in text:
            return verdict
    import resource

    previous = _file_sizes(os.path.join(save_dir, kept)) if kept else []
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and max(previous + _file_sizes(staging), default=0) >= limit:
        what, fix = _OUT_OF_ROOM[errno.EFBIG]
        return f"{what}: a checkpoint file reaches the file-size limit", fix
    try:
        free = shutil.disk_usage(save_dir).free
    except OSError:
        return None
    need = sum(previous)
    if free < (need or _FULL_WITHOUT_MEASURE):
        what, fix = _OUT_OF_ROOM[errno.ENOSPC]
        measure = (f"{kept} takes {need // 2**20} MiB" if need else
                   f"under {_FULL_WITHOUT_MEASURE // 2**20} MiB free")
        return f"{what}: {measure}", fix
    return None


def _write_traceback(exc: BaseException, save_dir: str, dirname: str) -> str:
    """Writes the full traceback of a failed save to a file and returns its path: under --save
    (a cluster's shared filesystem, readable from the login node), else the working directory
    (Slurm's submit directory), else the temporary directory of this host. Returns '' when no
    file could be written (the traceback then goes to stderr)."""
    import datetime
    import socket
    import tempfile
    import traceback

    rank = collectives.rank()
    header = (f"saving {dirname} to {save_dir} failed on rank {rank}, host "
              f"{socket.gethostname()}, pid {os.getpid()}, job "
              f"{os.environ.get('SLURM_JOB_ID', '-')}, at "
              f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}\n\n")
    text = header + "".join(traceback.format_exception(exc))
    name = f"{dirname}.rank{rank}.txt"
    for folder in (os.path.join(save_dir, SAVE_FAILURES), os.path.join(os.getcwd(), SAVE_FAILURES),
                   tempfile.gettempdir()):
        path = os.path.join(folder, name if folder.endswith(SAVE_FAILURES)
                            else f"pretrain_moe_save_failure_{name}")
        try:
            os.makedirs(folder, exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
            return path
        except OSError:
            continue
    import sys
    print(text, file=sys.stderr, flush=True)
    return ""


def _say_if_retention_not_deferred(checkpointing, margs, said: set[str]) -> None:
    if (getattr(margs, "save_retain_interval", None) and collectives.rank() == 0
            and not hasattr(checkpointing, "_async_delete_checkpoint_impl")
            and "retention" not in said):
        said.add("retention")
        print("[megatron_patches] atomic-checkpoint-commit: this megatron-core deletes "
              "--save-retain-interval checkpoints without _async_delete_checkpoint_impl, so "
              "their deletion is not deferred past the commit", flush=True)


def _fsync_own_files_everywhere(staging: str) -> list[int]:
    """Every rank syncs its own files; returns how many each did. A rank that cannot makes every
    rank raise, instead of leaving the others in the commit barrier."""
    try:
        outcome = commit_protocol.fsync_own_files(staging, collectives.rank())
    except OSError as exc:
        outcome = f"rank {collectives.rank()} could not fsync its files: {exc}"
    outcomes = collectives.gather_objects(outcome)
    failures = [f for f in outcomes if isinstance(f, str)]
    if failures:
        raise OSError(errno.EIO, "; ".join(failures))
    return outcomes


def _wrap_save(original: Callable, claims: WriterClaims) -> Callable:
    signature = inspect.signature(original)
    said: set[str] = set()  # notes this wrapper printed once

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
        rank0 = collectives.rank() == 0
        claim_id = own(claims, save_dir, create=True, margs=margs)
        _say_if_retention_not_deferred(checkpointing, margs, said)
        scratch = os.path.join(save_dir, private_name(STAGING_PREFIX, claim_id, TRACKER))
        if rank0 and os.path.isfile(os.path.join(save_dir, TRACKER)):
            shutil.copyfile(os.path.join(save_dir, TRACKER), scratch)
        staged = private_name(STAGING_PREFIX, claim_id, dirname)
        staging = os.path.join(save_dir, staged)
        retention = DeferredRetention(claim_id)
        try:
            with _redirected(checkpointing, save_dir, dirname, staging, scratch,
                             retention) as after_commit:
                result = original(*args, **kwargs)
            synced = _fsync_own_files_everywhere(staging)
            if rank0:
                commit_protocol.commit(save_dir, dirname, "release" if release else str(iteration),
                                       claim_id, synced)
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
            try:
                kept = read_tracker(save_dir)
            except CheckpointLoadError:
                kept = None
            refusal = find_refusal(exc)
            room = None if refusal is not None else _short_of_room(exc, save_dir, kept, staging)
            if rank0:
                shutil.rmtree(staging, ignore_errors=True)
                with contextlib.suppress(OSError):
                    os.unlink(scratch)
            state = (f"{dirname} was committed before the failure ({TRACKER} names it)"
                     if kept == dirname else
                     f"nothing was committed: {TRACKER} still names {kept or 'no checkpoint'}, "
                     f"which is unchanged; the partial {staged} was removed")
            if refusal is not None:  # e.g. a checkpoint guard: its message has the fix
                fix = (f"; {state}. Fix: as the refusal says; the run can resume with --load "
                       f"{save_dir}")
            elif room is not None:
                what, remedy = room
                fix = (f"({what}; {_room(save_dir)}); {state}. Fix: {remedy} {save_dir}, then "
                       f"resume with --load {save_dir}")
            else:  # not a matter of room: the full traceback says what failed
                written = _write_traceback(exc, save_dir, dirname)
                where = (f"full traceback in {written}" if written else
                         "full traceback above: no file could be written for it")
                fix = (f"({where}); {state}. Fix: what the traceback shows; then resume with "
                       f"--load {save_dir}")
            every_rank = getattr(refusal, "every_rank", False)  # then rank 0 alone says it
            where = "" if every_rank else f" on rank {collectives.rank()}"
            raise CheckpointSaveError(
                f"saving iteration {iteration} to {save_dir} failed{where}: {_first_line(exc)} "
                f"{fix}", every_rank=every_rank) from exc
        return result

    save_checkpoint.__wrapped_by__ = PATCH_NAME
    save_checkpoint.writer_claims = claims  # the load wrapper claims --save with the same record
    return save_checkpoint


def _wrap_optimizer_builder(get_megatron_optimizer: Callable) -> Callable:
    """setup_model_and_optimizer calls get_megatron_optimizer on every rank before the load and
    iteration 1: there a multi-node run that saves has its --save judged one folder shared by
    every node (node_view), before anything is written there."""

    @functools.wraps(get_megatron_optimizer)
    def get_megatron_optimizer_after_node_check(*args, **kwargs):
        from megatron.training.global_vars import get_args

        margs = get_args()
        if save_continuity.writes_checkpoints(margs):
            if line := node_view.check_save_shared(margs.save):
                print(f"[megatron_patches] atomic-checkpoint-commit: {margs.save}: {line}",
                      flush=True)
        return get_megatron_optimizer(*args, **kwargs)

    get_megatron_optimizer_after_node_check.__wrapped_by__ = PATCH_NAME
    return get_megatron_optimizer_after_node_check


def _apply(claims: WriterClaims) -> None:
    from megatron.training import training

    install("save_checkpoint", functools.partial(_wrap_save, claims=claims), PATCH_NAME)
    if not wrapped_by(training.get_megatron_optimizer, PATCH_NAME):
        training.get_megatron_optimizer = _wrap_optimizer_builder(training.get_megatron_optimizer)


def install(name: str, wrapper: Callable[[Callable], Callable], patch: str) -> None:
    """Wraps megatron.training's `name` where save/load call it (checkpointing) and where
    training imported it, once: `wrapper` marks what it returns as patch `patch`'s
    (`__wrapped_by__`)."""
    from megatron.training import checkpointing, training

    for module in (checkpointing, training):
        current = getattr(module, name, None)
        if current is not None and not wrapped_by(current, patch):
            setattr(module, name, wrapper(current))


def bound_load_call(signature: inspect.Signature, args: tuple, kwargs: dict):
    """A call of megatron's load_checkpoint (`signature`, its own): (its arguments bound, defaults
    applied; megatron's args; the folder it loads: the args attribute its `load_arg` names,
    --load by default)."""
    from megatron.training.global_vars import get_args

    margs = get_args()
    call = signature.bind(*args, **kwargs)
    call.apply_defaults()
    return call, margs, getattr(margs, call.arguments.get("load_arg") or "load", None)


def _commit_not_needed(context: PatchContext) -> str | None:
    from megatron.training import checkpointing

    source = inspect.getsource(checkpointing.save_checkpoint)
    if "os.replace(" in source or "os.rename(" in source:
        return "megatron-core already commits checkpoints by rename"
    return None


register(Patch(
    name=PATCH_NAME,
    upstream="Megatron-LM save_checkpoint TODO 'Handle non-empty directories (e.g., after a "
             "crash during saving)'; in-place tracker write",
    versions=">=0.15,<0.20",
    packages=("megatron.training",),
    summary="megatron.training.checkpointing.save_checkpoint writes to _partial_<claim>_iter_*, rank 0 "
            "renames it into place, then replaces the tracker (temp + fsync + os.replace); one "
            "locked writer per --save cleans up; --save-retain-interval deletes after the commit; "
            "a multi-node --save must be one folder every node sees",
    not_needed_because=_commit_not_needed,
    apply=lambda: _apply(WriterClaims()),
))


def writer_claims_of(save_checkpoint) -> WriterClaims | None:
    """The claims record of atomic-checkpoint-commit's save wrapper, under any other patch's
    wrapper of megatron's save_checkpoint; None where the commit patch is not applied."""
    while save_checkpoint is not None:
        if getattr(save_checkpoint, "__wrapped_by__", None) == PATCH_NAME:
            return save_checkpoint.writer_claims
        save_checkpoint = getattr(save_checkpoint, "__wrapped__", None)
    return None
