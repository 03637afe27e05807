"""A log line whose interval stepped no iteration prints no losses, instead of a loss of 0.

Local fix (megatron-core 0.19.2 `training_log`, read and tested there). megatron prints each
loss of a log line as its sum over the interval's stepped iterations divided by their count,
at least 1; iterations the loss scaler skips (fp16 overflow) or that hit a NaN add nothing. An
interval in which every iteration was skipped thus prints `lm loss: 0.000000E+00` (and every
other loss 0) once the run has stepped before: with `--log-interval 1` every skipped iteration
of an fp16 run. A loss of 0 reads as a model that has learned everything, or a broken loss
function. TensorBoard and wandb get each iteration's own loss (megatron computes it for a
skipped step too) and are not affected.

The fix wraps `training_log` as megatron's `train()` calls it: when the line it is about to
print covers no stepped iteration, megatron's function sees the loss sums without the losses
(they hold nothing of this interval) and gets them back afterwards; its counts, the loss scale
and the skipped-iteration count are printed as before.

Needed when megatron's own `training_log`, asked to print an interval that only skipped with a
loss summed before, prints that loss (the probe runs it with stand-ins, training_log_sandbox).
"""

from __future__ import annotations

import inspect

import torch

from megatron_patches import registry
from megatron_patches.accounting import training_log_sandbox
from megatron_patches.accounting.training_log_hook import wrap_training_log
from megatron_patches.registry import Patch, PatchContext, register

NAME = "skipped-interval-loss-line"
# megatron's counts in the sums dict; every other key is a loss summed over stepped iterations
_COUNTS = ("advanced iterations", "skipped iterations", "nan iterations")


def _prints_without_a_step(bound: inspect.BoundArguments, log_interval: int) -> bool:
    """Whether this call prints a line whose interval has stepped no iteration."""
    sums = bound.arguments["total_loss_dict"]
    return (bound.arguments["iteration"] % log_interval == 0
            and bool(bound.arguments.get("skipped_iter"))
            and sums.get(_COUNTS[0], 0) == 0)


def _without_losses_where_nothing_stepped(megatron_log, bound: inspect.BoundArguments):
    from megatron.training import training

    if not _prints_without_a_step(bound, training.get_args().log_interval):
        return megatron_log(*bound.args, **bound.kwargs)
    sums = bound.arguments["total_loss_dict"]
    losses = {key: sums.pop(key) for key in list(sums) if key not in _COUNTS}
    try:
        return megatron_log(*bound.args, **bound.kwargs)
    finally:
        sums.update(losses)


def _apply() -> None:
    wrap_training_log(NAME, _without_losses_where_nothing_stepped)


def _prints_a_loss_for_a_skipped_interval(megatron_log) -> bool:
    """megatron's training_log (training_log_sandbox) for a skipped iteration 1 with an 'lm loss'
    summed before and nothing stepped since: whether its line names that loss."""
    printed: list[str] = []
    sums = {"lm loss": torch.zeros(1), _COUNTS[0]: 0}
    training_log_sandbox.run_training_log(
        megatron_log, training_log_sandbox.one_rank_args(), sums, skipped_iter=1,
        loss_dict={"lm loss": torch.zeros(1)},
        stand_ins={"print_rank_last": printed.append, "torch": _HostTorch()})
    return any("lm loss" in line for line in printed)


class _HostTorch:
    """torch for the probe: the sums megatron resets are made on 'cuda'; here on the host (no
    CUDA context before the run picks its device)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, device=None, **kwargs):
        return torch.tensor(*args, **kwargs)


def _not_needed_because(context: PatchContext) -> str | None:
    from megatron.training import training

    if not _prints_a_loss_for_a_skipped_interval(registry.unwrapped(training.training_log)):
        return "megatron's training_log prints no loss for an interval that stepped nothing"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 training_log: the sum over no stepped iteration "
             "divided by max(1, 0))",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="a log line whose interval stepped no iteration (fp16 overflow skips) prints no "
            "losses instead of a loss of 0 for each (TensorBoard/wandb get each iteration's "
            "own loss as before)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
