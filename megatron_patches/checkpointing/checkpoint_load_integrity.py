"""Before megatron's load_checkpoint reads anything, rank 0 judges the checkpoint it would read and
every rank gets the verdict: its files (tracker, `.metadata`, `.distcp` sizes:
`file_checks`) and whether this run can load its optimizer state (`optimizer_state`: saved
without one, by the other kind of optimizer, in another precision, or a torch-format one by
another --optimizer). A refusal is one line, on every rank.

megatron's --save-retain-interval deletes the previous iteration inside save_checkpoint (a thread
started just after its tracker write), that is before this patch's commit; a crash then left the
tracker naming a deleted directory. During a wrapped save megatron's deletion
(`checkpointing._async_delete_checkpoint_impl`, which its retention code starts) only records the
request; once the tracker names the new iteration the older directory is renamed to
`_retired_<claim>_iter_*` (atomic) and removed in the background. A crash at any step leaves the tracker
naming a complete directory; a crash between the tracker write and the rename keeps the older
iteration (complete, untracked) instead of deleting it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
from typing import Callable

from megatron_patches.checkpointing.atomic_checkpoint_commit import (
    bound_load_call, install, own, writer_claims_of)
from megatron_patches.registry import Patch, PatchContext, register
from moe_launcher.checkpoint_files import file_checks, optimizer_state, save_continuity
from moe_launcher.checkpoint_files import reads as checkpoint_reads
from moe_launcher.runtime import collectives
from moe_launcher.runtime.refusals import CheckpointLoadError

NAME = "checkpoint-load-integrity"


def _wrap_load(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_checkpoint(*args, **kwargs):
        from megatron.training import checkpointing

        call, margs, load_dir = bound_load_call(signature, args, kwargs)
        # This job's own --save is claimed (and recovered) before anything is read from it;
        # only atomic-checkpoint-commit's saves need the claim, and only a run that saves (an
        # evaluation may read a directory another job is writing).
        claims = writer_claims_of(checkpointing.save_checkpoint)
        if save_continuity.writes_checkpoints(margs) and claims is not None:
            own(claims, margs.save, create=False, margs=margs)
        # One read of `.metadata` per rank for this check, the #1836 guard and megatron's load.
        with checkpoint_reads.reading_once():
            if load_dir and os.path.isdir(load_dir):  # read only: it may be another job's
                # One rank reads the files (on a shared filesystem every rank sees the same
                # ones: 1,024 ranks stat-ing every .distcp file is millions of metadata
                # operations), all ranks get its verdict.
                problems = collectives.union(
                    _load_problems(load_dir, margs) if collectives.rank() == 0 else [])
                if problems:
                    raise CheckpointLoadError(" | ".join(problems), every_rank=True)
            with _schedule_mismatch_refused(call.arguments.get("opt_param_scheduler"), load_dir):
                return original(*args, **kwargs)

    load_checkpoint.__wrapped_by__ = NAME
    return load_checkpoint


def _load_problems(load_dir: str, margs) -> list[str]:
    """Rank 0's verdict on the checkpoint in `load_dir`: its files, then whether this run can
    load its optimizer state (both from the `.metadata` and common state megatron then reuses)."""
    ckpt_step = getattr(margs, "ckpt_step", None)
    return (file_checks.load_problems(load_dir, ckpt_step, getattr(margs, "ckpt_format", None))
            or optimizer_state.load_problems(load_dir, ckpt_step, margs))


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
                f"the checkpoint's", every_rank=True) from None

    scheduler.load_state_dict = checked_load_state_dict  # this load only: megatron's call site
    try:
        yield
    finally:
        del scheduler.load_state_dict


def _load_check_not_needed(context: PatchContext) -> str | None:
    return None  # megatron checks no file against .metadata before its collective reads


def _apply_load_check() -> None:
    checkpoint_reads.install()  # its `.metadata` read is the one megatron's load then reuses
    install("load_checkpoint", _wrap_load, NAME)


register(Patch(
    name=NAME,
    upstream="local (megatron reads damaged files rank by rank; no pre-load check)",
    versions=">=0.15,<0.20",
    packages=("megatron.training",),
    summary="megatron.training.checkpointing.load_checkpoint first checks tracker, .metadata "
            "and .distcp sizes (on rank 0) and refuses a damaged checkpoint on every rank, and "
            "one whose optimizer state this run cannot load (saved without one, by the other "
            "kind of optimizer, in another precision, or in the torch format by another "
            "--optimizer)",
    not_needed_because=_load_check_not_needed,
    apply=_apply_load_check,
))
