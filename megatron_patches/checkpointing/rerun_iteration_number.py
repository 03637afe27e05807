"""The rerun state machine names the iteration it judged, so its tracker file skips that one.

Upstream: none found; megatron-core 0.19.2 `megatron/training/training.py` (`train`: "Make sure
rerun_state_machine has the right iteration loaded from checkpoint") and
`megatron/core/rerun_state_machine.py` (`should_run_forward_backward`,
`_log_validation_error_to_file`, `get_skipped_iterations_from_tracker_file`). Targets
megatron-core 0.19.x.

The machine's `current_iteration` is 0-indexed (its own comment) and every message and tracker
line adds 1. `train()` sets it to `args.iteration`, the number of iterations done, and the
machine then counts each step as it starts, so during the step megatron logs as iteration N it
holds N and prints N + 1: "Unexpected result nan ... at iteration #N+1", and the line written to
`--result-rejected-tracker-filename` says `iteration=N+1`. That file is how megatron gets past a
batch that fails twice on a rank: at the next start such an iteration joins megatron's
`iterations_to_skip` (1-indexed: the logged numbers). With reruns disabled the job skips the good
iteration after the bad one; with the default --rerun-mode validate_results the rerun from the
checkpoint (not counted again) names N, the first run N + 1, so nothing is named twice and
nothing is skipped. Either way the bad batch fails again, at every restart.

The fix, at megatron's call site: `train_step` is given the 0-indexed iteration it runs; the
machine is set to the count that its own increment turns into that index (or to the index,
where the machine resumes a rerun and does not count).
"""

from __future__ import annotations

import functools
import inspect
import logging

from megatron_patches.registry import Patch, PatchContext, register, wrapped_by

NAME = "rerun-iteration-number"


def _numbering_the_step(train_step):
    signature = inspect.signature(train_step)

    @functools.wraps(train_step)
    def train_step_numbered(*args, **kwargs):
        from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

        iteration = signature.bind(*args, **kwargs).arguments.get("iteration")
        if iteration is not None:
            machine = get_rerun_state_machine()
            counts_the_step = machine.state == RerunState.NOT_RUNNING_YET
            machine.current_iteration = iteration - 1 if counts_the_step else iteration
        return train_step(*args, **kwargs)

    train_step_numbered.__wrapped_by__ = NAME
    return train_step_numbered


def _apply() -> None:
    from megatron.training import training

    if wrapped_by(training.train_step, NAME):
        return
    training.train_step = _numbering_the_step(training.train_step)


def _not_needed_because(context: PatchContext) -> str | None:
    """Runs megatron's machine from what train() gives it before a fresh start's first step
    (read from train's source), and reads which iteration the step is then numbered."""
    from megatron.core.rerun_state_machine import RerunStateMachine
    from megatron.training import training

    source = inspect.getsource(training.train)
    if "rerun_state_machine.current_iteration = iteration\n" not in source:
        return "megatron's train() no longer sets the rerun state machine to the iterations done"
    quiet = logging.getLogger("megatron.core.rerun_state_machine")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its "initialized in mode DISABLED" is about this probe only
    try:
        machine = RerunStateMachine()
        machine.current_iteration = 0  # train(): args.iteration of a fresh start
        machine.should_run_forward_backward(None)
    finally:
        quiet.setLevel(level)
    if machine.current_iteration == 0:
        return "megatron's rerun state machine numbers the first step 0 (printed as 1)"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="megatron-core 0.19.2 training.train / rerun_state_machine (the tracker file and "
             "messages name the iteration after the one judged)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="the rerun state machine's messages and --result-rejected-tracker-filename name the "
            "iteration megatron logs, so a batch that fails twice is the one skipped",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
