"""Parameter totals and weight+optimizer memory from the model actually built.

megatron's `theoretical_memory_usage.compute_weight_and_optimizer_memory` derives the parameter
total, the most loaded shard and the weight+optimizer memory from `--num-layers`, assuming every
pipeline stage holds num_layers / PP layers. With `--decoder-first/last-pipeline-num-layers` the
stages are uneven (and before the layout fix could even hold other layers than asked), so the
"most loaded shard" and the memory it implies are wrong for the stage that actually runs out of
memory (NVIDIA/Megatron-LM#1778). This patch counts the parameters each rank holds after the
model is built and reports those instead, with megatron's own bytes-per-parameter rule.
Targets megatron-core 0.15.x - 0.19.x.
"""

from __future__ import annotations

import dataclasses
import functools

from megatron_patches import collectives
from megatron_patches.registry import Patch, register


@dataclasses.dataclass(frozen=True)
class ParameterCensus:
    total: int  # unique parameters of the whole model built
    most_loaded_rank: int  # parameters held by the rank that holds the most
    weight_and_optimizer_bytes: float  # on the rank with the most such bytes

    def lines(self) -> list[str]:
        return [f"[megatron_patches] parameters of the model built: total {self.total}, "
                f"most loaded rank {self.most_loaded_rank}",
                f"[megatron_patches] weight and optimizer memory on the most loaded rank: "
                f"{self.weight_and_optimizer_bytes / 2**20:.2f} MB"]


def _bytes_per_parameter(distributed_optimizer: bool, data_parallel_size: int) -> float:
    # megatron's estimator: bf16 params, fp32 main grads and params, fp32 Adam moments;
    # the distributed optimizer shards the 12 bytes of fp32 state over data parallelism.
    return 6 + 12 / data_parallel_size if distributed_optimizer else 18


def parameter_census(model_chunks, distributed_optimizer: bool) -> ParameterCensus:
    """Counts this rank's parameters and combines the counts of all ranks (a collective)."""
    from megatron.core import parallel_state as ps

    dense_replicas = ps.get_data_parallel_world_size(with_context_parallel=True)
    expert_replicas = ps.get_expert_data_parallel_world_size()
    tp, etp = ps.get_tensor_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    later_stage = not ps.is_pipeline_first_stage(ignore_virtual=True)

    unique = held = 0.0
    held_bytes = 0.0
    for chunk in model_chunks:
        for param in chunk.parameters():
            numel = param.numel()
            expert = not getattr(param, "allreduce", True)
            sharded = getattr(param, "tensor_model_parallel", False)
            replicas = (expert_replicas * (1 if sharded else etp) if expert
                        else dense_replicas * (1 if sharded else tp))
            held += numel
            held_bytes += numel * _bytes_per_parameter(
                distributed_optimizer, expert_replicas if expert else dense_replicas)
            # A tied output layer on the last stage is a copy of the first stage's embedding.
            if not (later_stage and getattr(param, "shared_embedding", False)):
                unique += numel / replicas
    (total,) = collectives.reduce_numbers([unique], "sum")
    most, most_bytes = collectives.reduce_numbers([held, held_bytes], "max")
    return ParameterCensus(round(total), int(most), most_bytes)


_CENSUS: list[ParameterCensus] = []


def _apply() -> None:
    from megatron.training import get_args, theoretical_memory_usage, training

    setup = training.setup_model_and_optimizer
    estimate = theoretical_memory_usage.compute_weight_and_optimizer_memory

    @functools.wraps(setup)
    def setup_model_and_optimizer(*args, **kwargs):
        model, optimizer, scheduler = setup(*args, **kwargs)
        chunks = model if isinstance(model, list) else [model]
        _CENSUS[:] = [parameter_census(chunks, get_args().use_distributed_optimizer)]
        return model, optimizer, scheduler

    @functools.wraps(estimate)
    def compute_weight_and_optimizer_memory(args, verbose=False):
        if not _CENSUS:
            return estimate(args, verbose=verbose)
        if verbose:
            print("\n".join(_CENSUS[0].lines()), flush=True)
        return _CENSUS[0].weight_and_optimizer_bytes

    training.setup_model_and_optimizer = setup_model_and_optimizer
    theoretical_memory_usage.compute_weight_and_optimizer_memory = (
        compute_weight_and_optimizer_memory)


PATCH = register(Patch(
    name="parameter-census",
    upstream="NVIDIA/Megatron-LM#1778",
    versions=">=0.15,<0.20",
    summary="parameter totals and weight+optimizer memory counted on the model built, per rank",
    not_needed_because=lambda context: None,  # megatron's estimate never sees the built model
    apply=_apply,
))
