"""A result that reproduces in a run without --save stops the run with one line, not a TypeError.

Upstream: none found; megatron-core 0.19.2 `megatron/training/training.py` (`train`: "if
should_checkpoint: save_checkpoint_and_time(...)") and `megatron/core/rerun_state_machine.py`
(`should_checkpoint_and_exit`). Targets megatron-core 0.19.x.

With the default --rerun-mode validate_results, a NaN/Inf loss that reproduces when megatron
reruns the step in place makes the rerun state machine ask for a checkpoint to rerun the step
from on another GPU ("Saving a checkpoint and exiting now"). A run without --save has nowhere to
write it: megatron's save died on every rank with `TypeError: expected str, bytes or
os.PathLike object, not NoneType` from `os.path.join` and its traceback, exit 1.

The fix, at megatron's call site: where the machine asks for that checkpoint and the run has no
--save, it asks for none; rank 0 says in one line that the result reproduced on this GPU and
that nothing can be rerun elsewhere without a checkpoint, and the run stops with megatron's
"failed on result validation" exit code (17).
"""

from __future__ import annotations

import functools
import inspect

from megatron_patches.registry import Patch, PatchContext, register, wrapped_by
from moe_launcher.runtime import collectives

NAME = "rerun-without-save"


def _no_checkpoint_without_save(should_checkpoint_and_exit):
    @functools.wraps(should_checkpoint_and_exit)
    def should_checkpoint_and_exit_with_save(self, *args, **kwargs):
        from megatron.core.rerun_state_machine import EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        from megatron.training import get_args

        should_checkpoint, should_exit, exit_code = should_checkpoint_and_exit(
            self, *args, **kwargs)
        if not (should_checkpoint and get_args().save is None):
            return should_checkpoint, should_exit, exit_code
        if collectives.rank() == 0:
            print(f"[megatron_patches] {NAME}: iteration {self.current_iteration + 1}'s result "
                  "reproduced when rerun on this GPU; megatron would save a checkpoint to rerun "
                  "it on another GPU, but this run has no --save: the run stops here, nothing "
                  "saved (exit 17). Fix: run with --save and --load to let megatron tell the GPU "
                  "from the data", flush=True)
        return False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION

    should_checkpoint_and_exit_with_save.__wrapped_by__ = NAME
    return should_checkpoint_and_exit_with_save


def _apply() -> None:
    from megatron.core.rerun_state_machine import RerunStateMachine

    if wrapped_by(RerunStateMachine.should_checkpoint_and_exit, NAME):
        return
    RerunStateMachine.should_checkpoint_and_exit = _no_checkpoint_without_save(
        RerunStateMachine.should_checkpoint_and_exit)


def _not_needed_because(context: PatchContext) -> str | None:
    """Reads megatron's training loop: the rerun's checkpoint is saved unless --save is checked
    before it."""
    from megatron.training import training

    source = inspect.getsource(training.train)
    if "if should_checkpoint:\n            save_checkpoint_and_time(" not in source:
        return "megatron's training loop no longer saves the rerun's checkpoint unchecked"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="megatron-core 0.19.2 training.train (the rerun's checkpoint is saved to --save "
             "even where there is none)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="a result that reproduces in a run without --save stops the run with one line "
            "(exit 17) instead of a TypeError in megatron's save",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
