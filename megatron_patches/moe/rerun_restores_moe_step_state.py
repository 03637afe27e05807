"""A step megatron's rerun state machine reruns in place starts from the state the step began in.

Upstream: none found; megatron-core 0.19.2 `megatron/training/training.py` (`train_step`: the
`while rerun_state_machine.should_run_forward_backward(...)` loop),
`megatron/core/rerun_state_machine.py` (`_save_state` keeps the RNG states only) and
`megatron/core/distributed/finalize_model_grads.py`. Targets megatron-core 0.19.x.

When a result check rejects a step (--check-for-spiky-loss; a NaN/Inf loss), megatron reruns the
step in place: it restores the RNG, rewinds the data, zeroes the gradients and runs the
micro-batches again; the rerun's gradients are the ones the optimizer steps with. But the first
run's `finalize_model_grads` has already updated every router's per-expert bias from that run's
routing (`expert_bias`, --moe-router-enable-expert-bias; `qb_beta`,
--moe-router-load-balancing-type quantile_balancing), so the rerun routes with another bias (its
loss may then differ and be called "not reproducible") and its own finalize updates the bias a
second time: the step moves the bias twice. And megatron's MoE metrics tracker keeps both runs'
values, so the rerun iteration logs twice its load-balancing losses. Nothing is said.

The fix, at megatron's call sites: `train_step` notes the model and each router's biases as the
step begins (one small copy per MoE layer); when `RerunStateMachine.should_run_forward_backward`
starts an in-place rerun, the biases are put back and the MoE tracker is cleared (`clear()`, as
megatron does after logging), so the rerun runs, and updates, as the step itself. (A step rerun
after a checkpoint resume starts in a new process from the checkpoint's biases.)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch

from megatron_patches.registry import Patch, PatchContext, register, wrapped_by

NAME = "rerun-restores-moe-step-state"
# The router buffers megatron's finalize_model_grads updates once per step (0.19.2).
STEP_BIASES = ("expert_bias", "qb_beta")


@dataclasses.dataclass
class RunningStep:
    """The train_step running: each router bias as the step began (empty between steps and
    without such biases); which routers hold which biases, found once per model (each bias is
    read from its router at every step: a router may hand its buffer a new tensor)."""

    biases: list = dataclasses.field(default_factory=list)  # (bias, its value at step start)
    model: list | None = None
    holders: list = dataclasses.field(default_factory=list)  # (router, bias name)

    def biases_of(self, model: list) -> list:
        if model is not self.model:
            self.model = model
            self.holders = [(module, name) for chunk in model for module in chunk.modules()
                            for name in STEP_BIASES if getattr(module, name, None) is not None]
        return [getattr(module, name) for module, name in self.holders]


def _tracking_the_step(train_step, step: RunningStep):
    signature = inspect.signature(train_step)

    @functools.wraps(train_step)
    def train_step_tracked(*args, **kwargs):
        model = signature.bind(*args, **kwargs).arguments["model"]
        step.biases = [(bias, bias.detach().clone()) for bias in step.biases_of(model)]
        try:
            return train_step(*args, **kwargs)
        finally:
            step.biases = []

    train_step_tracked.__wrapped_by__ = NAME
    return train_step_tracked


def _restarting_the_step(should_run, step: RunningStep):
    @functools.wraps(should_run)
    def should_run_restarting(self, *args, **kwargs):
        from megatron.core.rerun_state_machine import RerunState
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        run = should_run(self, *args, **kwargs)
        if run and self.state == RerunState.RERUNNING_IN_PLACE:
            with torch.no_grad():
                for bias, at_start in step.biases:
                    bias.copy_(at_start)
            get_moe_metrics_tracker().clear()
        return run

    should_run_restarting.__wrapped_by__ = NAME
    return should_run_restarting


def _apply(step: RunningStep) -> None:
    from megatron.core.rerun_state_machine import RerunStateMachine
    from megatron.training import training

    if wrapped_by(training.train_step, NAME):
        return
    training.train_step = _tracking_the_step(training.train_step, step)
    RerunStateMachine.should_run_forward_backward = _restarting_the_step(
        RerunStateMachine.should_run_forward_backward, step)


def _not_needed_because(context: PatchContext) -> str | None:
    """Reads whether megatron's rerun puts the step's MoE state back itself: its in-place
    restore would have to reach every router bias and the MoE metrics tracker."""
    from megatron.core.rerun_state_machine import RerunStateMachine

    restore = inspect.getsource(RerunStateMachine._restore_state)
    if all(name in restore for name in (*STEP_BIASES, "moe_metrics")):
        return "megatron's rerun state machine restarts the step's MoE state itself"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="megatron-core 0.19.2 rerun_state_machine (an in-place rerun keeps the first run's "
             "expert-bias update and MoE metrics)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="a step megatron's rerun state machine reruns in place starts from the router "
            "biases it began with and logs its MoE metrics once",
    not_needed_because=_not_needed_because,
    apply=functools.partial(_apply, RunningStep()),
))
