"""`--ckpt-step N` with `--ckpt-format torch` and the distributed optimizer resumes iteration N,
not N's weights with the newest checkpoint's optimizer state and iteration count.

Local fix (megatron-core 0.19.2 `load_checkpoint`, read and tested there). megatron loads the
model, scheduler and RNG state of the iteration `--ckpt-step` names, then, for the torch
format's distributed optimizer, reads the tracker file again by hand and loads
`distrib_optim.pt` (the fp32 main weights and Adam moments) of the iteration the tracker names,
and returns that iteration as the one resumed. Rolling back to an earlier checkpoint (after a
loss spike, say) then silently trains on from the newest one's main weights (the optimizer
writes them over the model's at its first step) at the newest one's iteration count, with the
older one's learning-rate schedule and data position; where N is the newest there is no
difference. While megatron's load_checkpoint runs with `--ckpt-step`, a read of the tracker of
the folder it loads from answers that iteration, as megatron's first read of it
(`_load_base_checkpoint`) already does; other trackers (a non-persistent checkpoint's) read as
they are.

Needed while load_checkpoint reads the tracker a second time itself (judged from its source).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
from typing import Callable

from megatron_patches.checkpointing.atomic_checkpoint_commit import bound_load_call, install
from megatron_patches.registry import Patch, PatchContext, register, unwrapped, wrapped_by

NAME = "torch-format-ckpt-step"

# (the tracker file of the folder megatron's load_checkpoint reads, the iteration it loads)
_LOADED_AT: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "torch_format_ckpt_step", default=None)


def _key(path: str) -> str:
    return os.path.normpath(os.path.abspath(path))


def _wrap_load(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_checkpoint(*args, **kwargs):
        from megatron.training import checkpointing

        _, margs, load_dir = bound_load_call(signature, args, kwargs)
        step = getattr(margs, "ckpt_step", None)
        if not step or load_dir is None:
            return original(*args, **kwargs)
        tracker = _key(checkpointing.get_checkpoint_tracker_filename(load_dir))
        token = _LOADED_AT.set((tracker, step))
        try:
            return original(*args, **kwargs)
        finally:
            _LOADED_AT.reset(token)

    load_checkpoint.__wrapped_by__ = NAME
    return load_checkpoint


def _wrap_read_metadata(original: Callable) -> Callable:
    @functools.wraps(original)
    def read_metadata(tracker_filename):
        iteration, release = original(tracker_filename)
        loaded_at = _LOADED_AT.get()
        if loaded_at is not None and _key(tracker_filename) == loaded_at[0]:
            return loaded_at[1], release
        return iteration, release

    read_metadata.__wrapped_by__ = NAME
    return read_metadata


def _not_needed_because(context: PatchContext) -> str | None:
    from megatron.training import checkpointing

    source = inspect.getsource(unwrapped(checkpointing.load_checkpoint))
    if "read_metadata(" not in source:
        return "megatron's load_checkpoint reads the tracker once, honouring --ckpt-step"
    return None


def _apply() -> None:
    from megatron.training import checkpointing

    install("load_checkpoint", _wrap_load, NAME)
    if not wrapped_by(checkpointing.read_metadata, NAME):
        checkpointing.read_metadata = _wrap_read_metadata(checkpointing.read_metadata)


register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 load_checkpoint: the torch format's distrib_optim.pt "
             "from the tracker's iteration, not --ckpt-step's)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="--ckpt-step with --ckpt-format torch and the distributed optimizer loads that "
            "iteration's optimizer state and resumes at that iteration, not the newest "
            "checkpoint's (load_checkpoint's second, hand-made read of the tracker answers the "
            "iteration loaded)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
