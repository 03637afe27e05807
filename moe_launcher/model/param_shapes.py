"""Each checkpointed model tensor's true global shape, read from the parameters megatron built.

A parameter's true global shape is its local shape with the dimension it is partitioned on
(`param.partition_dim` where `param.tensor_model_parallel`) multiplied by the size of the group
that partitions it: the `tp_group` of the layer that owns it (the expert tensor-parallel group
for expert layers), else megatron's TP/ETP group by `param.allreduce`. Parallelism never changes
that shape, flags do not enter it, and under Megatron-LM #1836 expert tensors declared a global
shape 1/ETP of it.

The declared shapes judged here:
* torch_dist ShardedTensors, whose `data` is the parameter or a view of it (a
  ShardedTensorFactory's `data` is the parameter; the tensors it builds, e.g. the two SwiGLU
  halves or per-expert slices of one grouped weight, are views). A piece that covers only part
  of the parameter along an axis must declare that share of the true global size there, summed
  over the pieces this rank gives one key at one position on the prepended (layer/expert) axes.
* fsdp_dtensor DTensors, whose global shape must equal the true shape of the parameter of the
  same name (Megatron-FSDP keeps the layer's own parameter as `orig_param`).
Anything else (no backing parameter, a view whose axes do not map onto the parameter's) cannot
be judged and passes; `Judgement.unjudged` lists it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory


@dataclasses.dataclass(frozen=True)
class ParamTruth:
    name: str
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    expert: bool
    # (group size, dim) the local shape is multiplied by; None: not partitioned
    partition: tuple[int, int] | None
    # This rank's place in that group: which piece along `dim` it holds (0 if not partitioned)
    partition_rank: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def how(self) -> str:
        """Where the global shape comes from, for messages."""
        if self.partition is None:
            return f"local {list(self.local_shape)}"
        size, dim = self.partition
        group = "ETP" if self.expert else "TP"
        return f"local {list(self.local_shape)} x {group}={size} on dim {dim}"


@dataclasses.dataclass
class Judgement:
    problems: list[str] = dataclasses.field(default_factory=list)
    unjudged: list[str] = dataclasses.field(default_factory=list)
    judged: int = 0
    # Pieces of parameters megatron did not mark tensor-parallel whose key declares a global
    # shape larger than the parameter: whether the ranks' pieces tile it once is for a judge
    # that sees every rank's pieces (the checkpoint guard's gathered tiling).
    to_tile: list[ShardedTensor] = dataclasses.field(default_factory=list)


def _partition_group(module: torch.nn.Module, param: torch.Tensor) -> tuple[int, int]:
    """(size, this rank's place) of the group that partitions `param`."""
    group = getattr(module, "_tp_group", None) or getattr(module, "tp_group", None)
    if group is not None and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0
    if not getattr(param, "allreduce", True):  # megatron's mark of an expert parameter
        return (ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_rank())
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def param_truth(name: str, module: torch.nn.Module, param: torch.Tensor) -> ParamTruth | None:
    """None where the local shape is not known (a DTensor parameter without `orig_param`)."""
    local = getattr(param, "orig_param", param)
    if isinstance(local, DTensor):
        return None
    local_shape = tuple(local.shape)
    shape = list(local_shape)
    expert = not getattr(local, "allreduce", True) or ".experts." in f".{name}"
    partition, partition_rank = None, 0
    dim = getattr(local, "partition_dim", -1)
    if getattr(local, "tensor_model_parallel", False) and 0 <= dim < len(shape):
        size, partition_rank = _partition_group(module, local)
        partition = (size, dim)
        shape[dim] *= size
    return ParamTruth(name, local_shape, tuple(shape), expert, partition, partition_rank)


def _strip_wrappers(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


class ModelParams:
    """The true shape of every parameter of the model chunks, by identity and by name."""

    def __init__(self, model_chunks: Iterable[torch.nn.Module]):
        self.by_id: dict[int, tuple[torch.Tensor, ParamTruth]] = {}
        self.by_name: dict[str, ParamTruth] = {}
        for chunk in model_chunks:
            for module_name, module in chunk.named_modules():
                for param_name, param in module.named_parameters(recurse=False):
                    name = _strip_wrappers(f"{module_name}.{param_name}".lstrip("."))
                    truth = param_truth(name, module, param)
                    if truth is None:
                        continue
                    self.by_id.setdefault(id(param), (param, truth))
                    self.by_name.setdefault(name, truth)

    def truth_of(self, param: torch.Tensor) -> ParamTruth | None:
        """The true shape of parameter `param` itself (None where it cannot be known)."""
        entry = self.by_id.get(id(param))
        return entry[1] if entry is not None else None

    def backing(self, tensor: Any) -> tuple[torch.Tensor, ParamTruth] | None:
        """The parameter `tensor` is, or is a view of."""
        for candidate in (tensor, getattr(tensor, "_base", None)):
            if candidate is not None and id(candidate) in self.by_id:
                return self.by_id[id(candidate)]
        return None


def sharded_tensors(sharded_state_dict: Any) -> list[ShardedTensor]:
    tensors = []
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensorFactory):
            tensors.extend(v for v in nested_values(value.build()) if isinstance(v, ShardedTensor))
        elif isinstance(value, ShardedTensor):
            tensors.append(value)
    return tensors


def judge_sharded_state_dict(sharded_state_dict: Any, params: ModelParams) -> Judgement:
    """Declared global shapes of this rank's ShardedTensors against their parameters."""
    verdict = Judgement()
    pieces: dict[tuple, tuple[ParamTruth, list[ShardedTensor]]] = {}
    for sh in sharded_tensors(sharded_state_dict):
        backing = params.backing(sh.data)
        if backing is None:
            continue  # optimizer states, buffers, extra states: no parameter behind them
        param, truth = backing
        if sh.flattened_range is not None or (
                sh.data is not param and sh.data.stride() != param.stride()):
            verdict.unjudged.append(sh.key)  # a flattened shard, a transposed or reshaped view
            continue
        group = (id(param), sh.key, tuple(sh.global_offset[:sh.prepend_axis_num]))
        pieces.setdefault(group, (truth, []))[1].append(sh)
    wrong: dict[str, str] = {}  # one problem per key: its first wrong piece
    for (_, key, _), (truth, shardings) in pieces.items():
        problem = _judge_pieces(key, shardings, truth)
        if problem is None:
            verdict.unjudged.append(key)
        elif problem is TILED_ACROSS_RANKS:
            verdict.to_tile.extend(sh.without_data() for sh in shardings)
        else:
            verdict.judged += 1
            if problem:
                wrong.setdefault(key, problem)
    verdict.problems = sorted(wrong.values())
    return verdict


# _judge_pieces' answer for a parameter without megatron's tensor-parallel mark whose key declares
# a larger global shape: sharded by a layer that never marked it (megatron-core 0.19.2's
# attention sinks, Megatron-LM #7452 finding 8), or wrong; only all ranks' pieces can tell.
TILED_ACROSS_RANKS = "tiled across ranks"


def _judge_pieces(key: str, shardings: list[ShardedTensor], truth: ParamTruth) -> str | None:
    """'' if the declared global shape is right, the problem if not, None if unjudgeable,
    TILED_ACROSS_RANKS where an unmarked parameter's key declares a larger global shape."""
    p = shardings[0].prepend_axis_num
    declared = tuple(shardings[0].global_shape[p:])
    local = truth.local_shape
    if any(tuple(sh.global_shape[p:]) != declared or len(sh.local_shape) != len(local)
           for sh in shardings):
        return None
    expected = []
    for d, (param_size, true_size) in enumerate(zip(local, truth.global_shape)):
        sizes = [sh.local_shape[d] for sh in shardings]
        if all(s == param_size for s in sizes):
            covered = param_size
        else:
            # Pieces split the parameter along d: they must be whole along every other axis.
            if any(sh.local_shape[o] != local[o] for sh in shardings
                   for o in range(len(local)) if o != d):
                return None
            covered = sum(sizes)
        if (true_size * covered) % param_size:
            return None
        expected.append(true_size * covered // param_size)
    if tuple(expected) == declared:
        return ""
    if truth.partition is None and all(
            size >= want and size % want == 0 for size, want in zip(declared, expected)):
        return TILED_ACROSS_RANKS  # (the #1836 signature, smaller than the parameter, is not)
    lead = list(shardings[0].global_shape[:p])
    return (f"{key}: global shape {lead + list(declared)} but its parameter {truth.name} implies "
            f"{['*'] * p + expected} ({truth.how})")


def judge_dtensor_state_dict(model_state_dict: dict, params: ModelParams) -> Judgement:
    """Global shapes of an fsdp_dtensor model state dict's DTensors against their parameters."""
    verdict = Judgement()
    for key, value in model_state_dict.items():
        if not isinstance(value, DTensor):
            continue
        truth = params.by_name.get(_strip_wrappers(key))
        if truth is None:
            verdict.unjudged.append(key)
            continue
        verdict.judged += 1
        if tuple(value.shape) != truth.global_shape:
            verdict.problems.append(
                f"{key}: global shape {list(value.shape)} but its parameter implies "
                f"{list(truth.global_shape)} ({truth.how}); placements "
                f"{[str(p) for p in value.placements]} on mesh {list(value.device_mesh.shape)}")
    return verdict
