"""The second loss line a process prints covers the iterations it names, not two of them.

Upstream: NVIDIA/Megatron-LM#6237 (resumed runs), fixed by PR #7092 ("reset log accumulators
when the first iteration is on a boundary"), merged after core_r0.19. Targets megatron-core
0.19.x, where it was seen and tested.

megatron's `training_log` sums every loss over a log interval (`total_loss_dict`, with the
'advanced', 'skipped' and 'nan iterations' counts it divides by) and zeroes the sums, the
interval timer and the stdout timers when it prints. A process's first iteration is always
printed, to show the start-up cost, and `training_log` never resets after that line: right
when the first iteration lies inside an interval (`--log-interval 100`: the line is an extra,
the interval 1..100 still needs iteration 1), wrong when it lies on an interval boundary
(`--log-interval 1`, or a resume at a multiple of the interval): that line *is* the interval's
log, and the next one averages its iterations with the first's. With `--log-interval 1` the
second line of every process (iteration 2, or the second iteration after a resume) prints the
mean of two iterations, so a resumed and an uninterrupted run seem to disagree on identical
training. TensorBoard/wandb get each iteration's own loss and are not affected.

The fix wraps `training_log` as megatron's `train()` calls it: when the first iteration lies
on a boundary, megatron's function is called with `is_first_iteration=False`, so it resets
everything it resets on any boundary (that line is a regular interval log; its timers go to
TensorBoard as on every boundary). Off a boundary megatron's behaviour is kept.

Needed when megatron's own `training_log`, asked to log a first iteration that is on a boundary
(`--log-interval 1`, iteration 1), keeps the iteration in its sums (the probe runs it with
stand-ins for its args, timers and writers).
"""

from __future__ import annotations

import inspect

from megatron_patches import registry
from megatron_patches.accounting import training_log_sandbox
from megatron_patches.accounting.training_log_hook import wrap_training_log
from megatron_patches.registry import Patch, PatchContext, register

NAME = "first-log-interval-reset"
_ADVANCED = "advanced iterations"  # the count megatron's training_log divides the sums by


def _on_boundary_first(bound: inspect.BoundArguments, log_interval: int) -> bool:
    return bool(bound.arguments.get("is_first_iteration")) and \
        bound.arguments["iteration"] % log_interval == 0


def _reset_on_a_boundary(megatron_log, bound: inspect.BoundArguments):
    from megatron.training import training

    if _on_boundary_first(bound, training.get_args().log_interval):
        bound.arguments["is_first_iteration"] = False  # a regular interval log: reset
    return megatron_log(*bound.args, **bound.kwargs)


def _apply() -> None:
    wrap_training_log(NAME, _reset_on_a_boundary)


def _keeps_first_boundary_iteration(megatron_log) -> bool:
    """Runs megatron's training_log for iteration 1 with --log-interval 1 (a boundary, and the
    process's first iteration; training_log_sandbox) and says whether it kept the iteration in
    its sums. No losses are passed, so no tensor is made; the advanced-iteration count is what
    tells."""
    sums: dict = {}
    training_log_sandbox.run_training_log(megatron_log, training_log_sandbox.one_rank_args(),
                                          sums, is_first_iteration=True)
    return sums.get(_ADVANCED, 0) != 0


def _not_needed_because(context: PatchContext) -> str | None:
    from megatron.training import training

    megatron_log = registry.unwrapped(training.training_log)
    if "is_first_iteration" not in inspect.signature(megatron_log).parameters:
        return "megatron's training_log has no extra first-iteration log"
    if not _keeps_first_boundary_iteration(megatron_log):
        return "megatron's training_log resets its sums after a first iteration on a boundary"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="NVIDIA/Megatron-LM#6237 (PR #7092, after 0.19)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="a process's first log on a --log-interval boundary resets megatron's loss sums, "
            "iteration counts and timers (megatron.training.training.training_log), so the "
            "next line is its own interval's, not the mean with the first iteration",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
