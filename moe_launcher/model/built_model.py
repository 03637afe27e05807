"""One record of the model megatron built: made once, after setup_model_and_optimizer, read by
every patch that needs the truth about the model (NVIDIA/Megatron-LM#1778).

megatron derives layer counts, parameter totals, FLOPs and the aux-loss divisor from the flags;
with an uneven pipeline split (and before the layout fix, layers built twice or not at all) the
flags and the model disagree. The `layer-census` patch (megatron_patches/accounting/layer_census.py) wraps
`megatron.training.training.setup_model_and_optimizer` once: it makes a `BuiltModel` from the
model chunks megatron returns (a collective: every rank takes part), refuses a model whose
layers differ from the flags, prints the layout, and keeps the record. Its consumers declare
`requires=("layer-census",)`, so with the census disabled they report "skipped (needs
layer-census, ...)" and megatron's own behaviour stays:

* `moe-aux-loss-per-built-layer`: the aux-loss divisor;
* `flops-from-layer-census`: FLOPs per batch;
* `parameter-census`: parameter totals and weight+optimizer memory.

Parameter counts are DTensor-aware: under Megatron-FSDP parameters are DTensors whose `numel()`
is the global size; what a rank holds is its local shard, where the optimizer state lives. How
much of the weights and gradients a rank keeps depends on Megatron-FSDP's sharding strategy
(`optim` and `optim_grads` keep the whole TP/ETP-local weights, `optim` and `no_shard` the whole
gradients), and their dtypes are Megatron-FSDP's: by default the gradients are kept in the
parameters' dtype (`--megatron-fsdp-main-grads-dtype auto`), not megatron's fp32 main grads.

Other modules read the record through the registry (`registry.record_of("layer-census").built`).
Per-parameter sharding (for checkpoint checks): `built.parameters`, `built.parameter(name,
chunk)` and `built.parameter_of(tensor)`.
Targets megatron-core 0.15.x - 0.19.x.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from moe_launcher.runtime import collectives
from moe_launcher.model import layer_layout
from moe_launcher.model.layer_layout import LayerCensus
from moe_launcher.model.param_shapes import ModelParams, ParamTruth


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """The parallel sizes the model was built with (as megatron's parallel_state has them)."""

    world: int
    pipeline: int
    tensor: int
    expert: int
    expert_tensor: int
    data: int  # dense-parameter replicas: data parallel x context parallel
    expert_data: int  # expert-parameter replicas
    first_stage: bool  # this rank is on the first pipeline stage

    @classmethod
    def of_megatron(cls) -> Parallelism:
        from megatron.core import parallel_state as ps

        return cls(
            world=collectives.world_size(),
            pipeline=ps.get_pipeline_model_parallel_world_size(),
            tensor=ps.get_tensor_model_parallel_world_size(),
            expert=ps.get_expert_model_parallel_world_size(),
            expert_tensor=ps.get_expert_tensor_parallel_world_size(),
            data=ps.get_data_parallel_world_size(with_context_parallel=True),
            expert_data=ps.get_expert_data_parallel_world_size(),
            first_stage=ps.is_pipeline_first_stage(ignore_virtual=True),
        )

    def owners(self, expert: bool) -> int:
        """Ranks that hold a part (or a copy) of one parameter: a dense one lives on every rank
        of its pipeline stage (TP x CP x DP), an expert on those of its expert-parallel rank
        (ETP x EDP)."""
        return self.world // (self.pipeline * (self.expert if expert else 1))


@dataclasses.dataclass(frozen=True)
class ParameterSharding:
    """How one parameter of this rank is split."""

    name: str  # as named_parameters() of the unwrapped model chunk names it
    chunk: int  # model chunk (virtual pipeline stage) on this rank
    local_shape: tuple[int, ...]  # what this rank holds (a DTensor's local shard)
    global_shape: tuple[int, ...]  # the whole parameter, over TP/ETP and Megatron-FSDP
    partition_dim: int | None  # dimension split by tensor parallelism, None if not split
    split_over: int  # ranks partition_dim is split over: TP (dense) or ETP (expert); else 1
    # In megatron's expert groups (allreduce=False): split over ETP, replicated over expert DP.
    # With EP=1 and ETP=TP megatron keeps expert weights in the dense groups: False then.
    expert: bool
    dtensor: bool  # a Megatron-FSDP DTensor (its shard is this rank's part of the state too)
    # A 2-D weight matrix other than the embedding and the output layer: what megatron gives
    # emerging-optimizers' optimizers (Muon) to step; the others go to Adam (moe_launcher/
    # optimizer_state.py).
    matrix: bool
    tied_copy: bool  # the last stage's copy of a tied embedding (counted once, on stage 0)
    held_numel: int  # elements this rank holds (its optimizer state covers them)
    # Elements of the weights this rank keeps: held_numel, except where a Megatron-FSDP strategy
    # keeps the weights unsharded.
    weight_numel: int
    # DTensors: bytes of the weights, gradients and main weights this rank keeps of the parameter
    # (the optimizer's moments are the census's); 0 for plain tensors, which megatron's rule prices.
    kept_bytes: int

    @property
    def global_numel(self) -> int:
        numel = 1
        for size in self.global_shape:
            numel *= size
        return numel


@dataclasses.dataclass(frozen=True)
class HeldElements:
    """Parameter elements one rank holds, by how megatron keeps their optimizer state."""

    dense: int  # plain tensors, state sharded over `data` by the distributed optimizer
    expert: int  # plain tensors, state sharded over `expert_data`
    dense_scalar: int  # of `dense`, the elements that are not in weight matrices
    expert_scalar: int  # of `expert`, likewise
    sharded: int  # DTensor shards: their optimizer state lives with the shard
    sharded_weights: int  # the weights this rank keeps of the DTensor parameters
    sharded_kept_bytes: int  # their weights, gradients and main weights on this rank

    @property
    def total(self) -> int:
        """Parameters whose weights this rank keeps."""
        return self.dense + self.expert + self.sharded_weights


@dataclasses.dataclass(frozen=True)
class BuiltModel:
    layers: LayerCensus  # every pipeline stage's layers
    config: object  # the model's TransformerConfig
    parallelism: Parallelism
    parameters: tuple[ParameterSharding, ...]  # this rank's, in named_parameters() order
    held_per_rank: tuple[HeldElements, ...]  # every rank's, in global rank order
    unique_parameters: int  # the whole model's, each parameter counted once
    # (address of the first element, element count) of this rank's parameters at record time
    addresses: dict[tuple[int, int], ParameterSharding] = dataclasses.field(
        default_factory=dict, repr=False, compare=False)

    def parameter(self, name: str, chunk: int = 0) -> ParameterSharding | None:
        return self._by_name.get((chunk, name))

    def parameter_of(self, tensor: torch.Tensor) -> ParameterSharding | None:
        """The parameter whose elements `tensor` is (or starts at: views of a whole parameter,
        as state dicts hold them). Matched by the address of the first element and the element
        count, not the storage: megatron's gradient buffers put all parameters in one storage.
        Addresses are those at the end of setup_model_and_optimizer."""
        local = _local(tensor)
        return self.addresses.get((local.data_ptr(), local.numel()))

    @functools.cached_property
    def _by_name(self) -> dict[tuple[int, str], ParameterSharding]:
        return {(p.chunk, p.name): p for p in self.parameters}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # DTensor keeps this rank's shard in _local_tensor (to_local() returns a view of it).
    return getattr(tensor, "_local_tensor", tensor)


def _attribute(param, name: str, default):
    # Megatron-FSDP keeps megatron's parameter attributes on the original parameter.
    if hasattr(param, name):
        return getattr(param, name)
    return getattr(getattr(param, "orig_param", None), name, default)


def sharding_of(name: str, chunk: int, param: torch.Tensor, parallelism: Parallelism,
                truth: ParamTruth | None) -> ParameterSharding:
    """How `param` is split; its true global shape and partition come from `truth`, the one
    reader of them (param_shapes.py: the group of the layer that owns it, not the flags)."""
    local = _local(param)
    dtensor = local is not param
    expert = not _attribute(param, "allreduce", True)
    split_over, partition_dim = truth.partition if truth and truth.partition else (1, None)
    # A DTensor's shape is global (TP included); else the truth's.
    global_shape = tuple(param.shape) if dtensor or truth is None else truth.global_shape
    weight_numel, kept_bytes = local.numel(), 0
    fsdp = _attribute(param, "_megatron_fsdp_model", None) if dtensor else None
    if fsdp is not None:
        weight_numel, kept_bytes = _kept_by_megatron_fsdp(param, fsdp)
    elif dtensor:  # another DTensor sharding (torch FSDP2): all of it sharded, megatron's dtypes
        kept_bytes = local.numel() * (2 + 4 + 4)
    return ParameterSharding(
        name=name, chunk=chunk, local_shape=tuple(local.shape),
        global_shape=global_shape, partition_dim=partition_dim, split_over=split_over,
        expert=expert, dtensor=dtensor,
        matrix=param.dim() == 2 and not _attribute(param, "is_embedding_or_output_parameter",
                                                   False),
        tied_copy=not parallelism.first_stage and bool(_attribute(param, "shared_embedding",
                                                                  False)),
        held_numel=local.numel(), weight_numel=weight_numel, kept_bytes=kept_bytes)


def _kept_by_megatron_fsdp(param, fsdp) -> tuple[int, int]:
    """(weight elements, bytes of weights, gradients and main weights) this rank keeps of a
    Megatron-FSDP parameter. Its DTensor is this rank's shard of the main weights; gradients are
    sharded too from optim_grads, weights only under optim_grads_params; what is not sharded,
    the rank keeps whole (the TP/ETP-local parameter Megatron-FSDP wrapped)."""
    orig = param.orig_param
    shard, whole = _local(param).numel(), orig.numel()
    strategy = fsdp.data_parallel_sharding_strategy
    weights = shard if strategy == "optim_grads_params" else whole
    grads = shard if strategy in ("optim_grads", "optim_grads_params") else whole
    buffers = fsdp.param_and_grad_buffer
    group = buffers.parameter_groups[buffers.param_to_param_group[orig]]
    kept = weights * orig.element_size()
    if group.main_grad_buffer is not None:  # None for frozen parameters
        kept += grads * group.main_grad_buffer.dtype.itemsize
    if group.main_weight_buffer is not None:  # else the weights are the main weights
        kept += shard * _local(param).element_size()
    return weights, kept


def count_parameters(shardings, parallelism: Parallelism) -> tuple[int, tuple[HeldElements, ...]]:
    """The model's unique parameters and every rank's held elements (collectives).

    Each rank adds global_numel / owners for each parameter it holds, so the owners of one
    parameter add up to its global size however they split it (TP, ETP, FSDP shards, or copies).
    """
    unique = sum(p.global_numel / parallelism.owners(p.expert)
                 for p in shardings if not p.tied_copy)
    held = HeldElements(
        dense=sum(p.held_numel for p in shardings if not p.dtensor and not p.expert),
        expert=sum(p.held_numel for p in shardings if not p.dtensor and p.expert),
        dense_scalar=sum(p.held_numel for p in shardings
                         if not p.dtensor and not p.expert and not p.matrix),
        expert_scalar=sum(p.held_numel for p in shardings
                          if not p.dtensor and p.expert and not p.matrix),
        sharded=sum(p.held_numel for p in shardings if p.dtensor),
        sharded_weights=sum(p.weight_numel for p in shardings if p.dtensor),
        sharded_kept_bytes=sum(p.kept_bytes for p in shardings))
    (total,) = collectives.reduce_numbers([unique], "sum")
    return round(total), tuple(collectives.gather_objects(held))


def make_record(model_chunks) -> BuiltModel:
    """The record of `model_chunks` (megatron's list of model chunks); every rank calls it."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    parallelism = Parallelism.of_megatron()
    params = ModelParams(layer_layout.unwrap(chunk) for chunk in chunks)
    entries = [(sharding_of(name, index, param, parallelism, params.truth_of(param)), _local(param))
               for index, chunk in enumerate(chunks)
               for name, param in layer_layout.unwrap(chunk).named_parameters()]
    shardings = tuple(sharding for sharding, _ in entries)
    unique, held = count_parameters(shardings, parallelism)
    return BuiltModel(
        layers=layer_layout.census_of_model(chunks), config=layer_layout.unwrap(chunks[0]).config,
        parallelism=parallelism, parameters=shardings, held_per_rank=held,
        unique_parameters=unique,
        addresses={(local.data_ptr(), local.numel()): sharding
                   for sharding, local in entries if local.numel()})


class ModelRecord:
    """The record of the model this process trains: kept once by the layer-census patch, which
    registers it (`registry.record_of("layer-census")`); the patches that declare
    `requires=("layer-census",)` read it there."""

    def __init__(self):
        self.built: BuiltModel | None = None  # None before setup_model_and_optimizer

    def keep(self, built: BuiltModel) -> None:
        self.built = built
