"""What Megatron-FSDP holds beside its shards: the weights it gathers and the unsharded gradients
waiting for their reduce-scatter, at their peak, under --data-parallel-sharding-strategy
optim_grads_params (megatron-core 0.19.2's megatron_fsdp; the dry run prices it).

Megatron-FSDP makes each transformer layer an FSDP unit and keeps everything else (embedding,
output layer, final norm, an MTP layer's own projection and norms) gathered for the whole step.
A unit's weights are in one bucket group for its non-expert and one for its expert parameters
(sharded over DP and expert-DP). Replayed here as megatron runs them:

* before a unit's forward (backward) megatron gathers its groups and prefetches the next groups
  in that direction until the prefetched ones hold at least half the communication unit; a
  unit's weights are let go after its forward, and after its backward;
* a unit's backward allocates each group's unsharded gradients at its first parameter's
  gradient (the experts' before the rest of the layer's) and queues the group's reduce-scatter
  when its last one is in, first freeing the oldest queued groups while the queue holds more
  than the communication unit; the gradients outside the units (embedding, output layer) are
  allocated at the start of the backward and kept to its end.

The communication unit is `--suggested-communication-unit-size` (elements) where it is given;
megatron's default is twice the mean unit and at least 10^9 elements, so without the flag a
model's gather window is at least 0.5 and its reduce-scatter queue 1 billion elements whatever
its size. Judged against megatron's own bucket allocators in real CPU runs
(tests/moe_launcher/test_fsdp_buffers_cpu.py).
"""

from __future__ import annotations

import dataclasses

MEGATRON_MIN_COMMUNICATION_UNIT = 1_000_000_000  # elements


@dataclasses.dataclass(frozen=True)
class BucketGroup:
    elements: int  # on one GPU before sharding
    sharded: bool  # over a DP (expert-DP) group of more than one rank: else megatron keeps the
    # group whole in its own buffers and neither gathers it nor unshards its gradients


@dataclasses.dataclass(frozen=True)
class FsdpUnit:
    """One FSDP unit (a transformer layer): its bucket groups in megatron's order (non-expert,
    then expert)."""

    groups: tuple[BucketGroup, ...]


@dataclasses.dataclass(frozen=True)
class FsdpBuffers:
    weights: float  # bytes of gathered weights at the peak (the kept ones included)
    grads: float  # bytes of unsharded gradients at the same moment
    communication_unit: int  # elements

    @property
    def total(self) -> float:
        return self.weights + self.grads


def communication_unit(units: list[FsdpUnit]) -> int:
    """megatron's suggested communication unit when none is configured (MegatronFSDP.__init__):
    twice the units' mean size, at least 10^9 elements."""
    mean = sum(g.elements for unit in units for g in unit.groups) // len(units) if units else 0
    return max(MEGATRON_MIN_COMMUNICATION_UNIT, mean * 2)


def peak_buffers(units: list[FsdpUnit], kept: int, weight_bytes: int, grad_bytes: int,
                 unit_size: int | None = None) -> FsdpBuffers:
    """The most bytes of gathered weights and unsharded gradients alive at once through one
    micro-batch's forward and backward. `units` in forward order; `kept`: the elements outside
    every unit (gathered for the whole step, their gradients kept through the backward)."""
    unit_size = communication_unit(units) if unit_size is None else unit_size
    # bucket groups in megatron's order: (unit index, group); the windows and the queue count
    # every group, the memory only the sharded ones
    groups = [(u, g) for u, unit in enumerate(units) for g in unit.groups]
    mine = {u: [i for i, (owner, _) in enumerate(groups) if owner == u] for u in range(len(units))}

    def elements(indices, sharded_only: bool = True) -> int:
        return sum(groups[i][1].elements for i in indices
                   if groups[i][1].sharded or not sharded_only)

    def window(u: int, step: int) -> set[int]:
        """Unit u's groups and those megatron prefetches after them (step +1 forward, -1
        backward): further groups until they hold at least half the communication unit."""
        taken, prefetched = set(mine[u]), 0
        index = (max(mine[u]) if step > 0 else min(mine[u])) + step
        while 0 <= index < len(groups) and prefetched < unit_size // 2:
            taken.add(index)
            prefetched += groups[index][1].elements
            index += step
        return taken

    peak = (0, 0)

    def seen(gathered: set[int], grads: int) -> None:
        nonlocal peak
        weights = kept + elements(gathered)
        if weights * weight_bytes + grads * grad_bytes > \
                peak[0] * weight_bytes + peak[1] * grad_bytes:
            peak = (weights, grads)

    gathered: set[int] = set()
    for u in range(len(units)):  # forward
        gathered |= window(u, +1)
        seen(gathered, 0)
        gathered -= set(mine[u])
    gathered, queue = set(), []
    for u in reversed(range(len(units))):  # backward
        gathered |= window(u, -1)
        for index in reversed(mine[u]):  # the expert group's gradients come first
            seen(gathered, kept + elements(queue) + elements([index]))
            while elements(queue, sharded_only=False) > unit_size:
                queue.pop(0)
            queue.append(index)
        gathered -= set(mine[u])
    return FsdpBuffers(peak[0] * weight_bytes, peak[1] * grad_bytes, unit_size)
