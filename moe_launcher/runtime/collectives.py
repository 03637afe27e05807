"""The collectives this project runs itself, on data every process group megatron builds accepts.

On a GPU cluster megatron's default process group, and every group it creates without
`backend="gloo"`, is NCCL: NCCL moves only tensors that live on the current CUDA device and
refuses a host tensor ("No backend type associated with device type cpu"). gloo, which the CPU
tests run on, accepts host tensors, so a host-tensor collective passes every CPU test and kills
every GPU run. Patches therefore never call `torch.distributed` collectives directly:

* numbers (counts, sizes, maxima) go through `reduce_numbers`, whose tensor is created on the
  current (CUDA, or the CPU backend's virtual CUDA) device;
* integer vectors (shapes, offsets) go through `gather_integers`, likewise on that device;
* small Python payloads (verdicts, problem lists, per-stage counts) go through the object
  collectives below, which torch itself places on the device the group needs.

Without an initialised process group every helper answers for this one process.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group=None) -> int:
    return dist.get_world_size(group) if distributed() else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if distributed() else 0


def collective_device() -> torch.device:
    """The device megatron's NCCL groups move tensors on: the current CUDA device (under the
    CPU backend the virtual one, which is the CPU)."""
    return torch.device("cuda", torch.cuda.current_device())


def reduce_numbers(values: Sequence[float], op: str = "sum", group=None) -> list[float]:
    """Element-wise sum/max/min of `values` over the ranks of `group` (float64: integers up to
    2**53 stay exact)."""
    if not distributed():
        return [float(v) for v in values]
    tensor = torch.tensor(list(values), dtype=torch.float64, device=collective_device())
    dist.all_reduce(tensor, op=_OPS[op], group=group)
    return tensor.tolist()


def gather_integers(values: Sequence[int], group=None, what: str = "values") -> list[list[int]]:
    """Every rank's `values` (int64), in rank order of `group`: one collective for the lot, where
    an object gather per value would be one each. Every rank must offer as many; a rank that
    offers a different number is an error on every rank (a length check goes first), not a
    hang."""
    if world_size(group) == 1:
        return [[int(v) for v in values]]
    device = collective_device()
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size(group))]
    dist.all_gather(counts, torch.tensor([len(values)], dtype=torch.int64, device=device),
                    group=group)
    offered = torch.cat(counts).tolist()  # one device-to-host copy, not one per rank
    if len(set(offered)) != 1:
        raise RuntimeError(f"the ranks of one group offer different numbers of {what}: {offered}")
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone]


def gather_objects(value: Any, group=None) -> list[Any]:
    """Every rank's `value` (a small picklable payload), in rank order of `group`."""
    if world_size(group) == 1:
        return [value]
    everyone: list[Any] = [None] * world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def union(items: list[str], group=None) -> list[str]:
    """The sorted union of every rank's strings: each rank ends with the same list."""
    return sorted({item for rank_items in gather_objects(list(items), group) for item in rank_items})


def any_rank(flag: bool, group=None) -> bool:
    return any(gather_objects(bool(flag), group))


def barrier(group=None) -> None:
    if distributed():
        dist.barrier(group=group)
