"""A checkpoint saved for megatron's rerun of a failed iteration resumes when that iteration is
skipped.

Upstream: none found; megatron-core 0.19.2 `megatron/training/training.py` (`train`'s
"Completely skip iteration if needed" and `dummy_train_step`) and
`megatron/core/rerun_state_machine.py` (`should_run_forward_backward`). Targets megatron-core
0.19.x.

When a result check fails and reproduces in place (a NaN loss, with the default --rerun-mode
validate_results), megatron saves a checkpoint holding its rerun state machine in
WILL_RERUN_FROM_CHECKPOINT and exits: the next job reruns the iteration from it on another GPU
and, if the result reproduces there too, exits again ("Correct result (but possible Application
error)"). Every later job resumes from that same checkpoint, so from the same machine state. With
--result-rejected-tracker-filename the iteration is then in megatron's iterations_to_skip, and
megatron skips it with `dummy_train_step`, whose `should_run_forward_backward` loop moves the machine to
RERUNNING_FROM_CHECKPOINT and leaves it there (nothing was judged, so nothing asks to continue).
The next iteration's `train_step` then runs no forward or backward at all and exits with code 17
("Exiting now. A checkpoint at the last iteration already exists"): the skip meant to get past
the bad batch stops the job one step later, on every restart.

The fix, at megatron's call site: after `dummy_train_step`, a machine left rerunning from the
checkpoint goes back to its normal state, with one line saying so: the iteration it was to judge
was skipped, so there is nothing left to rerun.
"""

from __future__ import annotations

import functools
import inspect

from moe_launcher.runtime import collectives
from megatron_patches.registry import Patch, PatchContext, register, wrapped_by

NAME = "skipped-iteration-ends-rerun"


def _ending_the_rerun(dummy_train_step):
    @functools.wraps(dummy_train_step)
    def dummy_train_step_ending_rerun(*args, **kwargs):
        from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

        result = dummy_train_step(*args, **kwargs)
        machine = get_rerun_state_machine()
        if machine.state == RerunState.RERUNNING_FROM_CHECKPOINT:
            machine.state = RerunState.NOT_RUNNING_YET
            if collectives.rank() == 0:
                print(f"[megatron_patches] {NAME}: iteration {machine.current_iteration + 1}, "
                      "which the checkpoint was saved to rerun, is skipped "
                      "(iterations_to_skip): no rerun left, training goes on", flush=True)
        return result

    dummy_train_step_ending_rerun.__wrapped_by__ = NAME
    return dummy_train_step_ending_rerun


def _apply() -> None:
    from megatron.training import training

    if wrapped_by(training.dummy_train_step, NAME):
        return
    training.dummy_train_step = _ending_the_rerun(training.dummy_train_step)


def _not_needed_because(context: PatchContext) -> str | None:
    """Reads megatron's skipped step: it ends a rerun only if it looks at the machine's state
    or asks it whether to checkpoint and exit, as a trained step does."""
    from megatron.training import training

    source = inspect.getsource(training.dummy_train_step)
    if "RerunState" in source or "should_checkpoint_and_exit" in source:
        return "megatron's skipped step ends a rerun from a checkpoint itself"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="megatron-core 0.19.2 training.dummy_train_step (a skipped iteration leaves the rerun "
             "state machine rerunning from the checkpoint; the next step exits)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="a job resumed from the checkpoint megatron saved to rerun a failed iteration trains "
            "on when that iteration is skipped (iterations_to_skip)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
