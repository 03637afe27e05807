"""A resumed run checks its first iteration's loss and gradients as it checks every other.

Upstream: none found; megatron-core 0.19.2 `megatron/core/rerun_state_machine.py`
(`validate_result`: "Do not validate results on the first iteration, as we cannot guarantee a
checkpoint can be taken before the optimizer has been stepped at least once"). Targets
megatron-core 0.19.x.

megatron's result checks (a NaN or Inf loss, NaN gradients, spiky losses) all go through the
rerun state machine, which passes every result of a process's first iteration unjudged. That is
right for a run's first step, before any optimizer state exists to checkpoint; megatron applies
it to the first iteration of every process, so also to the first step after each resume (a
requeue, a preemption, a time limit). A batch that gives a NaN loss there trains unchecked: in
a bf16 run (no loss scaler to find the NaN gradients) the optimizer writes NaN into the weights,
the next iteration's loss is NaN from the weights, not its batch, and megatron's recovery saves
the poisoned weights as the newest checkpoint, to rerun that good batch from (the test's run:
a NaN at the first iteration after a resume, megatron's tracker names the next one and its
checkpoint holds NaN weights). Under Megatron-FSDP (fsdp_dtensor checkpoints keep no rerun
state) the job megatron asks to rerun a failed iteration on another node always starts on that
iteration, so it always trains the bad batch unchecked.

The fix, at megatron's call site: once `setup_model_and_optimizer` has resumed a run from a
checkpoint with its optimizer state (iteration > 0, no --no-load-optim), the machine counts its
first iteration as done, so the first step is checked; megatron's recovery can then checkpoint
the weights it loaded. A fresh run, a --finetune start and a resume without optimizer state keep
megatron's rule.
"""

from __future__ import annotations

import functools
import math

from megatron_patches.registry import Patch, PatchContext, register, wrapped_by

NAME = "resumed-run-checks-first-iteration"


def resumed_with_optimizer_state(args) -> bool:
    return args.iteration > 0 and not args.no_load_optim and not args.finetune


def _checking_the_first_iteration(setup_model_and_optimizer):
    @functools.wraps(setup_model_and_optimizer)
    def setup_checking_the_first_iteration(*args, **kwargs):
        from megatron.core.rerun_state_machine import get_rerun_state_machine
        from megatron.training import get_args

        result = setup_model_and_optimizer(*args, **kwargs)
        if resumed_with_optimizer_state(get_args()):
            get_rerun_state_machine().first_iteration_complete = True
        return result

    setup_checking_the_first_iteration.__wrapped_by__ = NAME
    return setup_checking_the_first_iteration


def _apply() -> None:
    from megatron.training import training

    if wrapped_by(training.setup_model_and_optimizer, NAME):
        return
    training.setup_model_and_optimizer = _checking_the_first_iteration(
        training.setup_model_and_optimizer)


def _not_needed_because(context: PatchContext) -> str | None:
    """A machine as megatron's train loop sets it after a resume (its iteration past 0) judges a
    NaN loss at its first step, or lets it pass."""
    import torch
    from megatron.core.rerun_state_machine import RerunMode, RerunStateMachine

    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    machine.current_iteration = 4
    machine.should_run_forward_backward(None)
    machine.validate_result(torch.tensor(math.nan), rejection_func=torch.isnan,
                            message="probe", tolerance=0.0, fatal=True)
    if machine.rerun_requested:
        return "megatron checks the first iteration of a resumed run"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="megatron-core 0.19.2 rerun_state_machine.validate_result (the first iteration of "
             "every process is not checked)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="a run resumed with its optimizer state checks its first iteration's loss and "
            "gradients (megatron passed them unjudged: a NaN batch there trained into the "
            "weights and the checkpoint megatron saved to rerun from)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
