"""Expert-load metrics: how evenly each MoE layer's router spreads tokens, per logging interval.

Upstream: NVIDIA/Megatron-LM issue #2398 (feature request; megatron-core 0.19.x logs aux-loss
values, not the load they are meant to balance). Targets megatron-core 0.19.x.

Per MoE layer and logging interval: tokens per expert (min, max, mean, coefficient of variation
= std / mean), the number of experts that received no token, and the tokens dropped by the
capacity factor (--moe-expert-capacity-factor). Under a capacity factor the experts' tokens are
capped, so their spread no longer shows the router's: the tokens the router chose for each
expert before the drop (max, and cv) are reported beside them, read from the map before the
drop that patch expert-bias-counts-routed-tokens keeps beside the kept one. With
--moe-pad-expert-input-to-capacity the router's map holds the padding as well: the tokens
counted are those of it the router chose (with that patch left out, the padded map is counted,
and neither drops nor the chosen tokens are reported).

* Counting: after `TopKRouter.routing` returns its routing map, each router adds the map's
  per-expert sums to a device tensor of its own: no host sync, no collective, on the step's
  critical path. Like megatron's expert-bias counts, only passes with grad enabled count, so a
  recomputed forward (activation checkpointing) counts once and evaluation does not count; a
  step megatron's rerun state machine reruns in place (a rejected result, e.g. a spiky loss) is
  counted once, by its first run.
* Reporting: at every --log-interval iteration, after megatron's training_log, one sum over
  all ranks (collectives.reduce_numbers on the current device) of a [layers x (experts + 1)]
  table: every PP stage fills its own layers' rows, TP (sequence parallel) x DP x CP ranks
  their shares of the tokens. The last rank prints one summary line over all MoE layers; every
  rank with a TensorBoard / wandb writer logs per-layer scalars "expert_load/<metric>/layer_<n>".
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref

import torch

from moe_launcher.runtime import collectives
from megatron_patches.accounting.training_log_hook import wrap_training_log
from megatron_patches.moe.expert_bias_counts_routed_tokens import routed_before_capacity
from megatron_patches.registry import Patch, PatchContext, register

NAME = "expert-load-metrics"
_ROUTERS: "weakref.WeakSet" = weakref.WeakSet()  # routers that counted since the last report


@dataclasses.dataclass(frozen=True)
class LayerLoad:
    layer: int  # 1-based layer number (MTP layers follow the decoder layers)
    tokens_per_expert: tuple[int, ...]
    dropped: int | None  # None where drops cannot be told (padded to capacity)
    # the tokens the router chose per expert before a capacity drop; None without a capacity
    # factor (they are tokens_per_expert) or where the map before the drop is not kept
    chosen: tuple[int, ...] | None = None

    @property
    def mean(self) -> float:
        return sum(self.tokens_per_expert) / len(self.tokens_per_expert)

    @property
    def cv(self) -> float:
        return _cv(self.tokens_per_expert)

    @property
    def chosen_cv(self) -> float | None:
        return None if self.chosen is None else _cv(self.chosen)

    @property
    def idle_experts(self) -> int:
        return sum(1 for n in self.tokens_per_expert if n == 0)

    def scalars(self) -> dict[str, float]:
        counts = self.tokens_per_expert
        values = {"tokens_min": min(counts), "tokens_max": max(counts), "tokens_mean": self.mean,
                  "tokens_cv": self.cv, "idle_experts": self.idle_experts}
        if self.dropped is not None:
            values["dropped_tokens"] = self.dropped
        if self.chosen is not None:
            values["chosen_tokens_max"] = max(self.chosen)
            values["chosen_tokens_cv"] = self.chosen_cv
        return values


def _cv(counts: tuple[int, ...]) -> float:
    mean = sum(counts) / len(counts)
    variance = sum((n - mean) ** 2 for n in counts) / len(counts)
    return math.sqrt(variance) / mean if mean else 0.0


def _layer_index(router) -> int | None:
    if router.layer_number is None:
        return None
    return router.layer_number - 1 + (router.config.num_layers if router.is_mtp_layer else 0)


def _count(router, routing_map: torch.Tensor) -> None:
    # A few device ops per router and micro-batch (no autograd: the maps are boolean); the drop
    # and chosen counts only where a capacity factor can drop tokens.
    config = router.config
    capacity = config.moe_expert_capacity_factor is not None
    # the map before the drop (expert-bias-counts-routed-tokens keeps it): what the router chose
    routed = routed_before_capacity(routing_map) if capacity else routing_map
    chosen_known = routed is not routing_map
    drops_known, kept = True, routing_map
    if capacity and config.moe_pad_expert_input_to_capacity:
        # The map holds the padding too: the tokens an expert really got are those of it the
        # router chose.
        drops_known = chosen_known
        if drops_known:
            kept = routing_map & routed
    assigned = kept.sum(dim=0)
    if getattr(router, "_expert_load", None) is None:
        router._expert_load = torch.zeros_like(assigned)
        router._expert_chosen = torch.zeros_like(assigned)
        router._expert_drops = torch.zeros((), dtype=assigned.dtype, device=assigned.device)
    router._expert_load += assigned
    router._expert_drops_known = drops_known
    router._expert_chosen_known = chosen_known
    if chosen_known:
        router._expert_chosen += routed.sum(dim=0)
    if capacity and drops_known:
        # Top-k routing assigns every token k experts; what the map lacks was dropped.
        router._expert_drops += kept.shape[0] * router.topk - assigned.sum()
    _ROUTERS.add(router)


def interval_loads(num_layers: int, num_experts: int) -> list[LayerLoad]:
    """Every MoE layer's load since the last call, summed over all ranks; resets the counts.
    Every rank must call it (one all-reduce)."""
    # a layer's row: tokens per expert, chosen tokens per expert, drops
    width = 2 * num_experts + 1
    table = [0.0] * (num_layers * width)
    known = [0.0] * (2 * num_layers)  # per layer: drops known, chosen known
    counted = [(router, index) for router in list(_ROUTERS)
               if (index := _layer_index(router)) is not None
               and getattr(router, "_expert_load", None) is not None]
    if counted:
        # One copy to the host for all layers (on a GPU one sync per log line, not per router).
        rows = torch.stack([torch.cat([router._expert_load, router._expert_chosen,
                                       router._expert_drops.reshape(1)])
                            for router, _ in counted]).tolist()
        for (router, index), row in zip(counted, rows):
            table[index * width:(index + 1) * width] = row
            known[2 * index] = float(router._expert_drops_known)
            known[2 * index + 1] = float(router._expert_chosen_known)
            router._expert_load.zero_()
            router._expert_chosen.zero_()
            router._expert_drops.zero_()
    summed = collectives.reduce_numbers(table + known, op="sum")
    table, known = summed[:num_layers * width], summed[num_layers * width:]
    loads = []
    for index in range(num_layers):
        row = [int(round(v)) for v in table[index * width:(index + 1) * width]]
        tokens, chosen = row[:num_experts], row[num_experts:-1]
        if sum(tokens) == 0:
            continue  # a dense layer, or no training step in this interval
        loads.append(LayerLoad(index + 1, tuple(tokens), row[-1] if known[2 * index] else None,
                               tuple(chosen) if known[2 * index + 1] else None))
    return loads


def summary_line(iteration: int, loads: list[LayerLoad]) -> str:
    worst = max(loads, key=lambda load: load.cv)
    counts = [n for load in loads for n in load.tokens_per_expert]
    idle = sum(load.idle_experts for load in loads)
    dropped = [load.dropped for load in loads if load.dropped is not None]
    routed = sum(counts)
    line = (f" [expert load] iteration {iteration} | {len(loads)} MoE layers | tokens/expert "
            f"min {min(counts)} max {max(counts)} mean {routed / len(counts):.1f} | "
            f"cv mean {sum(load.cv for load in loads) / len(loads):.3f} "
            f"max {worst.cv:.3f} (layer {worst.layer}) | experts with no token {idle} |")
    if dropped:
        total = sum(dropped)
        line += f" dropped tokens {total} ({100 * total / max(total + routed, 1):.2f}%) |"
    if chose := [load for load in loads if load.chosen is not None]:
        hottest = max(chose, key=lambda load: load.chosen_cv)
        line += (f" chosen before the drop: max {max(max(load.chosen) for load in chose)} | "
                 f"cv mean {sum(load.chosen_cv for load in chose) / len(chose):.3f} "
                 f"max {hottest.chosen_cv:.3f} (layer {hottest.layer}) |")
    return line


def write_scalars(loads: list[LayerLoad], iteration: int, writer, wandb_writer) -> None:
    values = {f"expert_load/{metric}/layer_{load.layer}": value
              for load in loads for metric, value in load.scalars().items()}
    if writer is not None:
        for tag, value in values.items():
            writer.add_scalar(tag, value, iteration)
    if wandb_writer is not None:
        wandb_writer.log(values, iteration)


def report(iteration: int, args, writer, wandb_writer, print_line) -> None:
    num_layers = args.num_layers + (args.mtp_num_layers or 0)
    loads = interval_loads(num_layers, args.num_experts)
    if loads:
        print_line(summary_line(iteration, loads))
        write_scalars(loads, iteration, writer, wandb_writer)


def _apply() -> None:
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.training import training

    routing = TopKRouter.routing
    if getattr(routing, "__wrapped_by__", None) == NAME:
        return

    @functools.wraps(routing)
    def routing_and_counting(self, logits, *args, **kwargs):
        probs, routing_map = routing(self, logits, *args, **kwargs)
        if self.training and torch.is_grad_enabled() \
                and get_rerun_state_machine().state != RerunState.RERUNNING_IN_PLACE:
            _count(self, routing_map)
        return probs, routing_map

    routing_and_counting.__wrapped_by__ = NAME
    TopKRouter.routing = routing_and_counting

    def with_expert_load(megatron_log, bound):
        result = megatron_log(*bound.args, **bound.kwargs)
        megatron_args, iteration = training.get_args(), bound.arguments["iteration"]
        if megatron_args.num_experts and iteration % megatron_args.log_interval == 0:
            report(iteration, megatron_args, training.get_tensorboard_writer(),
                   training.get_wandb_writer(), training.print_rank_last)
        return result

    wrap_training_log(NAME, with_expert_load)


def _not_needed_because(context: PatchContext) -> str | None:
    from megatron.core.transformer.moe import moe_logging

    if any("expert_load" in name or "tokens_per_expert" in name
           for name in vars(moe_logging.MoEMetricsTracker)):
        return "megatron's MoE metrics tracker reports expert load itself"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="NVIDIA/Megatron-LM#2398",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="per-layer tokens per expert (min/max/mean/cv), idle experts, dropped tokens "
            "and those chosen before the drop, per log interval",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
