"""fsdp_dtensor: a `release` checkpoint (converted weights) loads like a torch_dist one, without
the optimizer, scheduler and RNG state it does not hold.

Upstream: megatron-core 0.19.2 `megatron.training.checkpointing.load_checkpoint`. Its torch_dist
path reads a release's model only (iteration 0, no optimizer or RNG state: megatron's convention
for converted checkpoints), but its fsdp_dtensor branch builds the state dict to read from
`--finetune`, `--no-load-optim` and `--no-load-rng` alone: for a release it still asks DCP for
every optimizer slot and RNG state, and with the strict load (`strict_fsdp_dtensor_load`, True
by default) every rank dies with "Missing key in checkpoint state_dict: optimizer.state...".
So `python -m moe_launcher.convert to-fsdp-dtensor`'s output (an import, or another layout's
weights) could not start a Megatron-FSDP run without extra flags. Targets 0.19.x (read and
tested on 0.19.2).

The fix: for the duration of a load that reads `release` (the tracker names it; --ckpt-step
names an iteration instead), megatron's load sees `--no-load-optim --no-load-rng`, which is what
megatron's release handling amounts to on the torch_dist path; the weights then refresh the
main weights (fsdp-model-to-main-weights).

Needed where the fsdp_dtensor branch of load_checkpoint does not look at `release` before it
asks for the optimizer state.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re

from megatron_patches.registry import Patch, PatchContext, register

NAME = "fsdp-dtensor-release-load"
# The branch that builds the state dict an fsdp_dtensor load reads (up to where it is handed on).
_FSDP_BRANCH = re.compile(r"elif args\.ckpt_format == 'fsdp_dtensor':(.*?)"
                          r"load_kwargs\['sharded_state_dict'\] = state_dict", re.S)


def _fsdp_branch_source() -> str | None:
    from megatron.training import checkpointing

    found = _FSDP_BRANCH.search(inspect.getsource(checkpointing.load_checkpoint))
    return found.group(1) if found else None


def _not_needed_because(context: PatchContext) -> str | None:
    branch = _fsdp_branch_source()
    if branch is None:
        return "megatron's load_checkpoint has no fsdp_dtensor branch of this shape"
    if "release" in branch:
        return "megatron's fsdp_dtensor load already leaves a release's optimizer state alone"
    return None


def _loads_a_release(margs) -> bool:
    from moe_launcher.checkpoint_files.commit_protocol import loaded_dirname
    from moe_launcher.runtime.refusals import CheckpointLoadError

    if getattr(margs, "ckpt_format", None) != "fsdp_dtensor":
        return False
    if not margs.load or not os.path.isdir(margs.load):
        return False
    try:
        return loaded_dirname(margs.load, getattr(margs, "ckpt_step", None)) == "release"
    except CheckpointLoadError:
        return False  # the load checks refuse it


@contextlib.contextmanager
def _weights_only(margs):
    saved = margs.no_load_optim, margs.no_load_rng
    margs.no_load_optim = margs.no_load_rng = True
    try:
        yield
    finally:
        margs.no_load_optim, margs.no_load_rng = saved


def _wrap(load_checkpoint):
    @functools.wraps(load_checkpoint)
    def load_checkpoint_of_a_release(*args, **kwargs):
        from megatron.training.global_vars import get_args

        margs = get_args()
        if not _loads_a_release(margs):
            return load_checkpoint(*args, **kwargs)
        with _weights_only(margs):
            return load_checkpoint(*args, **kwargs)

    load_checkpoint_of_a_release.__wrapped_by__ = NAME
    return load_checkpoint_of_a_release


def _apply() -> None:
    from megatron_patches.checkpointing.atomic_checkpoint_commit import install

    install("load_checkpoint", _wrap, NAME)


register(Patch(
    name=NAME,
    upstream="megatron-core 0.19.2 load_checkpoint (fsdp_dtensor branch asks a release "
             "checkpoint for optimizer and RNG state)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="an fsdp_dtensor release (converted weights) loads without optimizer, scheduler and "
            "RNG state, as megatron's torch_dist path loads one, instead of failing on every rank",
    not_needed_because=_not_needed_because,
    apply=_apply,
    requires=("fsdp-model-to-main-weights",),
))
