"""A MoE run logs the load-balancing losses of its own types only.

megatron-core 0.19.2's `training_log` picks the MoE losses to report by substring:
`"aux_loss" in args.moe_router_load_balancing_type` holds for "seq_aux_loss" and
"global_aux_loss" too (a single type is a string). So a run with DeepSeek's sequence-wise loss
(the DeepSeek-V2/V3 and Moonlight recipes) or the global one also reports a
`load_balancing_loss` that no router records: megatron's tracker pre-creates it at zero, and
`load_balancing_loss: 0.000000E+00` goes to every log line, to TensorBoard and to wandb, beside
the loss the run does compute. Local (found here; megatron-core 0.19.2
training/training.py training_log).

The patch hooks megatron's call site: `training_log`'s tracker (`get_moe_metrics_tracker` as
training.py imports it) reports only the loss names of the run's own types (the names megatron's
router records them under: aux_loss -> load_balancing_loss, seq_aux_loss ->
seq_load_balancing_loss, global_aux_loss -> global_load_balancing_loss); other names (z_loss,
the patches' own metrics) pass unchanged.

Needed when megatron's own training_log, run for a sequence-wise-loss run
(training_log_sandbox), asks its tracker for `load_balancing_loss`. Targets megatron-core 0.19.x.
"""

from __future__ import annotations

import functools

from megatron_patches import registry
from megatron_patches.accounting import training_log_sandbox
from megatron_patches.registry import Patch, PatchContext, register

NAME = "moe-loss-names-by-type"
# --moe-router-load-balancing-type -> the name megatron's router records that loss under
LOSS_NAME_OF_TYPE = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                     "global_aux_loss": "global_load_balancing_loss"}


def run_types(load_balancing_type) -> set[str]:
    """The run's load-balancing types: megatron keeps one as a string, several as a list."""
    if isinstance(load_balancing_type, str):
        return {load_balancing_type}
    return set(load_balancing_type or ())


class _RunTypesOnly:
    """megatron's MoE metrics tracker, reporting no loss name of a type the run lacks."""

    def __init__(self, tracker, types: set[str]):
        self._tracker = tracker
        self._not_run = {name for kind, name in LOSS_NAME_OF_TYPE.items() if kind not in types}

    def report(self, *args, track_names=None, **kwargs):
        if track_names is not None:
            names = [track_names] if isinstance(track_names, str) else track_names
            track_names = [name for name in names if name not in self._not_run]
        return self._tracker.report(*args, track_names=track_names, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tracker, name)


def _apply() -> None:
    from megatron.training import training

    if registry.wrapped_by(training.get_moe_metrics_tracker, NAME):
        return
    megatron_tracker = training.get_moe_metrics_tracker

    @functools.wraps(megatron_tracker)
    def get_moe_metrics_tracker(*args, **kwargs):
        return _RunTypesOnly(megatron_tracker(*args, **kwargs),
                             run_types(training.get_args().moe_router_load_balancing_type))

    get_moe_metrics_tracker.__wrapped_by__ = NAME
    training.get_moe_metrics_tracker = get_moe_metrics_tracker


class _AskedNames:
    """A stand-in tracker that keeps the names training_log asks it to report."""

    def __init__(self):
        self.asked: list[str] = []

    def report(self, *args, track_names=None, **kwargs) -> str:
        self.asked += list(track_names or ())
        return ""


def _not_needed_because(context: PatchContext) -> str | None:
    from megatron.training import training

    if not hasattr(training, "get_moe_metrics_tracker"):
        return "megatron's training_log has no MoE metrics tracker"
    tracker = _AskedNames()
    args = training_log_sandbox.one_rank_args(
        num_experts=2, num_layers=1, moe_router_load_balancing_type="seq_aux_loss")
    training_log_sandbox.run_training_log(
        registry.unwrapped(training.training_log), args, {},
        stand_ins={"get_moe_metrics_tracker": lambda: tracker}, is_first_iteration=False)
    if LOSS_NAME_OF_TYPE["aux_loss"] not in tracker.asked:
        return "megatron's training_log reports only the losses of the run's types"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 training.training_log: \"aux_loss\" in the type string)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="a seq_aux_loss or global_aux_loss run no longer reports a load_balancing_loss of 0 "
            "(megatron.training.training.training_log's MoE metrics tracker reports the losses "
            "of the run's own types)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
