"""Parameter totals and weight+optimizer memory from the model actually built.

megatron's `theoretical_memory_usage.compute_weight_and_optimizer_memory` derives the parameter
total, the most loaded shard and the weight+optimizer memory from `--num-layers`, assuming every
pipeline stage holds num_layers / PP layers. With `--decoder-first/last-pipeline-num-layers` the
stages are uneven (and before the layout fix could even hold other layers than asked), so the
"most loaded shard" and the memory it implies are wrong for the stage that actually runs out of
memory (NVIDIA/Megatron-LM#1778). This patch reports, from the record of the model built
(moe_launcher/model/built_model.py, hence it requires `layer-census`), the parameters each rank holds, and
prices them as the run keeps them: weights in the run's dtype, gradients in megatron's gradient
buffer's, and the optimizer's main copies and state by moe_launcher/optimizer_state.py (megatron's
estimate prices every run as bf16 with Adam: 18 bytes per parameter without the distributed
optimizer, where a bf16 Muon run keeps 14 for each weight matrix and an fp32 Adam run 16; and
it prices Muon under --use-distributed-optimizer, which megatron turns into its layer-wise
distributed optimizer, as unsharded). Under Megatron-FSDP a rank
holds its DTensor shards of the optimizer state and, as the sharding strategy has it, shards or
whole copies of the weights and gradients, in Megatron-FSDP's dtypes
(moe_launcher/model/built_model.py).
Targets megatron-core 0.15.x - 0.19.x.
"""

from __future__ import annotations

import dataclasses
import functools

from moe_launcher import optimizer_state
from moe_launcher.model.built_model import BuiltModel, HeldElements
from megatron_patches import registry
from megatron_patches.accounting import layer_census  # registered first: this patch requires it
from megatron_patches.registry import Patch, register, wrapped_by

NAME = "parameter-census"


# megatron's layer-wise distributed optimizer (what --use-distributed-optimizer gives Muon's
# matrices) gives each data-parallel rank whole parameters, not an even slice of them.
LAYER_WISE_NOTE = (" (the even share over data-parallel ranks: the layer-wise distributed "
                   "optimizer gives each rank whole parameters, so ranks differ)")


def layer_wise(args) -> bool:
    return bool(getattr(args, "use_layer_wise_distributed_optimizer", False))


@dataclasses.dataclass(frozen=True)
class ParameterCensus:
    total: int  # unique parameters of the whole model built
    most_loaded_rank: int  # parameters held by the rank that holds the most
    weight_and_optimizer_bytes: float  # on the rank with the most such bytes
    share_note: str = ""  # what the figure is where it cannot be the busiest rank's

    @classmethod
    def of(cls, built: BuiltModel, args) -> ParameterCensus:
        return cls(built.unique_parameters,
                   max(held.total for held in built.held_per_rank),
                   max(weight_and_optimizer_bytes(held, built.parallelism, args)
                       for held in built.held_per_rank),
                   LAYER_WISE_NOTE if layer_wise(args) else "")

    def lines(self) -> list[str]:
        return [f"[megatron_patches] parameters of the model built: total {self.total}, "
                f"most loaded rank {self.most_loaded_rank}",
                f"[megatron_patches] weight and optimizer memory on the most loaded rank: "
                f"{self.weight_and_optimizer_bytes / 2**20:.2f} MB{self.share_note}"]


def weight_and_optimizer_bytes(held: HeldElements, parallelism, args) -> float:
    """Bytes of the weights, gradients, main weights and optimizer state `held` stands for, for
    megatron's parsed arguments `args`."""
    state = optimizer_state.state_bytes(args)
    weight = 2 if (args.bf16 or args.fp16) else 4
    gradient = 4 if args.accumulate_allreduce_grads_in_fp32 else weight

    def plain(elements: int, scalar: int, replicas: int) -> float:
        # the distributed optimizer shards main weights and state over the parameter's replicas
        # (megatron turns --use-distributed-optimizer into its layer-wise one for Muon)
        shards = replicas if args.use_distributed_optimizer or layer_wise(args) else 1
        return (weight + gradient) * elements + state.of(elements - scalar, scalar) / shards

    # DTensor parameters: what the rank keeps of their weights, gradients and main weights, and
    # two fp32 Adam moments per element of the shard.
    return (plain(held.dense, held.dense_scalar, parallelism.data)
            + plain(held.expert, held.expert_scalar, parallelism.expert_data)
            + held.sharded_kept_bytes + 8 * held.sharded)


def _apply() -> None:
    from megatron.training import theoretical_memory_usage

    estimate = theoretical_memory_usage.compute_weight_and_optimizer_memory
    if wrapped_by(estimate, NAME):
        return

    @functools.wraps(estimate)
    def compute_weight_and_optimizer_memory(args, verbose=False):
        built = registry.record_of(layer_census.PATCH.name).built
        if built is None:
            return estimate(args, verbose=verbose)
        census = ParameterCensus.of(built, args)
        if verbose:
            print("\n".join(census.lines()), flush=True)
        return census.weight_and_optimizer_bytes

    compute_weight_and_optimizer_memory.__wrapped_by__ = NAME
    theoretical_memory_usage.compute_weight_and_optimizer_memory = (
        compute_weight_and_optimizer_memory)


PATCH = register(Patch(
    name=NAME,
    upstream="NVIDIA/Megatron-LM#1778",
    versions=">=0.15,<0.20",
    packages=("megatron.training",),
    summary="parameter totals and weight+optimizer memory counted on the model built, per rank "
            "(megatron.training.theoretical_memory_usage.compute_weight_and_optimizer_memory)",
    not_needed_because=lambda context: None,  # megatron's estimate never sees the built model
    apply=_apply,
    requires=(layer_census.PATCH.name,),
))
