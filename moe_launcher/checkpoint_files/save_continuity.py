"""Whether a run continues what its --save already holds (issue 47).

megatron-core 0.19.2 writes a run's iterations into --save whatever it holds: a second run that
forgot `--load` replaces the first run's `iter_0000020`, `iter_0000040`, moves the tracker back to
its own iteration, and leaves the first run's later iterations as orphans; the next `--load`
continues the second run's weights as if they were the first's. Not a line is printed.

Here a --save that holds a committed checkpoint is for the run that continues it: `--load` of the
same directory without `--finetune` (a resume, a requeue through train.sh). Any other run is
refused before work (the preflight check `save-holds-another-run`, moe_launcher/checkpoint_paths.py)
unless it opts in to start over there (START_OVER_ENV). What a run would write over is moved aside
once it holds the directory (`set_aside`, run by atomic-checkpoint-commit right after its writer
claim), never deleted: every iteration folder for a run that starts over, the iterations above
`--ckpt-step` for a deliberate rollback.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time

from moe_launcher.checkpoint_files.commit_protocol import TRACKER, read_tracker, write_tracker
from moe_launcher.runtime.durable_files import fsync_path
from moe_launcher.runtime.refusals import CheckpointLoadError

START_OVER_ENV = "MEGATRON_PATCHES_SAVE_START_OVER"
DROP_REPLACED_ENV = "MEGATRON_PATCHES_SAVE_DROP_REPLACED"  # =1: delete what is set aside
SET_ASIDE_PREFIX = "_set_aside_"
_ITERATION = re.compile(r"iter_(\d{7})$")


def _iteration(name: str) -> int | None:
    match = _ITERATION.match(name)
    return int(match.group(1)) if match else None


@dataclasses.dataclass(frozen=True)
class SaveUse:
    """What a run does to the committed checkpoint its --save holds."""
    save_dir: str
    latest: str                   # the iteration folder the tracker names
    continues: bool               # --load is this --save, without --finetune
    why_not: str                  # why it does not continue ('' when it does)
    rollback_to: int | None       # --ckpt-step below the latest iteration
    replaced: tuple[str, ...]     # committed folders this run's saves would write over


def writes_checkpoints(args) -> bool:
    """Whether the run writes into its --save: megatron saves nothing with --skip-train (an
    evaluation of --load), whatever --save says, so such a run claims and judges no --save."""
    return bool(getattr(args, "save", None)) and not getattr(args, "skip_train", False)


def save_use(args) -> SaveUse | None:
    """None where the run writes no checkpoint (writes_checkpoints) or --save holds no committed
    one (no tracker, or a tracker naming a folder that is not there: the load checks judge
    those)."""
    save_dir = getattr(args, "save", None)
    if not writes_checkpoints(args) or not os.path.isdir(save_dir):
        return None
    try:
        latest = read_tracker(save_dir)
    except CheckpointLoadError:
        return None
    if latest is None or not os.path.isdir(os.path.join(save_dir, latest)):
        return None
    load = getattr(args, "load", None)
    same = bool(load) and os.path.realpath(load) == os.path.realpath(save_dir)
    finetune = bool(getattr(args, "finetune", False))
    why_not = ("" if same and not finetune else
               "--finetune starts the iteration count over" if same else
               f"its --load is {load}" if load else "it has no --load")
    folders = sorted(name for name in os.listdir(save_dir)
                     if (_iteration(name) is not None or name == "release")
                     and os.path.isdir(os.path.join(save_dir, name)))
    step = getattr(args, "ckpt_step", None)
    latest_iteration = _iteration(latest)
    rollback_to = (step if not why_not and step is not None and latest_iteration is not None
                   and step < latest_iteration else None)
    if why_not:
        replaced = tuple(folders)
    elif rollback_to is not None:
        replaced = tuple(name for name in folders if (_iteration(name) or 0) > rollback_to)
    else:
        replaced = ()
    return SaveUse(save_dir, latest, not why_not, why_not, rollback_to, replaced)


def refusal(use: SaveUse | None, environ=os.environ) -> str | None:
    """The one-line refusal for a run that would write over another run's checkpoints."""
    if use is None or use.continues or environ.get(START_OVER_ENV) == "1":
        return None
    return (f"--save {use.save_dir} holds another run's checkpoints (latest {use.latest}, "
            f"{len(use.replaced)} iteration folder(s)) and this run does not continue them "
            f"({use.why_not}): its saves would replace them; fix: --load {use.save_dir} to "
            f"continue that run; or another --save for a new one; or {START_OVER_ENV}=1 to "
            f"start over there (its folders are moved aside into {use.save_dir}/"
            f"{SET_ASIDE_PREFIX}<time>, not deleted)")


def set_aside(use: SaveUse | None, environ=os.environ) -> str | None:
    """Moves what this run would write over into `<save>/_set_aside_<time>` (rank 0, holding
    the directory's writer claim), and deletes that folder only where DROP_REPLACED_ENV asks;
    returns the line that names them. The tracker first: a crash half-way leaves it naming a
    folder that is there (the rollback's iteration) or none."""
    if use is None or not use.replaced:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside = os.path.join(use.save_dir, f"{SET_ASIDE_PREFIX}{stamp}-{os.getpid()}")
    os.mkdir(aside)
    tracker = os.path.join(use.save_dir, TRACKER)
    if use.rollback_to is not None:
        write_tracker(aside, str(_iteration(use.latest)))
        write_tracker(use.save_dir, str(use.rollback_to))
        reason = f"--ckpt-step {use.rollback_to} rolls back from {use.latest}"
    else:
        os.rename(tracker, os.path.join(aside, TRACKER))
        reason = f"{START_OVER_ENV}=1 starts over ({use.why_not})"
    for name in use.replaced:
        os.rename(os.path.join(use.save_dir, name), os.path.join(aside, name))
    fsync_path(aside)
    fsync_path(use.save_dir)
    if environ.get(DROP_REPLACED_ENV) == "1":
        shutil.rmtree(aside)
        return (f"deleted {', '.join(use.replaced)} ({reason}; this run would have replaced "
                f"them), as {DROP_REPLACED_ENV}=1 asks")
    return (f"moved {', '.join(use.replaced)} aside into {aside} ({reason}; this run would have "
            f"replaced them); they are kept there until you delete that folder "
            f"(or set {DROP_REPLACED_ENV}=1)")
