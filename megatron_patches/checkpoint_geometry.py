"""Do a tensor's saved chunks tile its global shape exactly once? (geometry only, no I/O).

Shared by the offline checkpoint audit and the save/load guards (Megatron-LM #1836: a checkpoint
whose chunks leave part of a tensor uncovered loads without a word, the gaps keep their initial
values).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

import numpy as np

Box = tuple[Sequence[int], Sequence[int]]  # (global offset, size) of one chunk


@dataclasses.dataclass(frozen=True)
class Coverage:
    missing_fraction: float  # share of the global tensor no chunk covers
    overlapping: bool  # some element is covered by more than one chunk
    out_of_bounds: bool  # some chunk reaches outside the global shape

    @property
    def exact(self) -> bool:
        return self.missing_fraction == 0 and not self.overlapping and not self.out_of_bounds

    def problems(self) -> list[str]:
        """What is wrong with the coverage, in words ([] when exact)."""
        parts = []
        if self.missing_fraction:
            parts.append(f"{self.missing_fraction:.1%} of the global tensor has no chunk")
        if self.overlapping:
            parts.append("chunks overlap")
        if self.out_of_bounds:
            parts.append("a chunk lies outside the global shape")
        return parts


def coverage(global_shape: Sequence[int], boxes: Iterable[Box]) -> Coverage:
    """Checks how (offset, size) boxes cover `global_shape`.

    Works on the grid that all box boundaries induce, so cost grows with the number of chunks,
    not with the tensor size.
    """
    boxes = [(tuple(o), tuple(s)) for o, s in boxes]
    ndim = len(global_shape)
    total = math.prod(global_shape)
    if ndim == 0:
        return Coverage(0.0 if boxes else 1.0, len(boxes) > 1, False)
    out_of_bounds = any(
        len(o) != ndim or any(a < 0 or a + b > g for a, b, g in zip(o, s, global_shape))
        for o, s in boxes
    )
    boxes = [(o, s) for o, s in boxes if len(o) == ndim]
    if not out_of_bounds and (regular := _regular_grid_coverage(global_shape, boxes)) is not None:
        return regular
    bounds = [sorted({0, g} | {min(max(o[d], 0), g) for o, _ in boxes}
                     | {min(max(o[d] + s[d], 0), g) for o, s in boxes})
              for d, g in enumerate(global_shape)]
    counts = np.zeros([len(b) - 1 for b in bounds], dtype=np.int32)
    for o, s in boxes:
        index = tuple(slice(np.searchsorted(b, min(max(o[d], 0), global_shape[d])),
                            np.searchsorted(b, min(max(o[d] + s[d], 0), global_shape[d])))
                      for d, b in enumerate(bounds))
        counts[index] += 1
    cell_volume = np.ones(counts.shape, dtype=np.float64)
    for d, b in enumerate(bounds):
        widths = np.diff(np.asarray(b, dtype=np.float64))
        cell_volume *= widths.reshape([-1 if i == d else 1 for i in range(ndim)])
    missing = float(cell_volume[counts == 0].sum()) / total if total else 0.0
    return Coverage(missing, bool((counts > 1).any()), out_of_bounds)


def _regular_grid_coverage(global_shape: Sequence[int], boxes: list) -> Coverage | None:
    """Fast path for the usual case: equal boxes on a grid of their size (a set, no array).

    None when the boxes are not such a grid; the general path handles them.
    """
    if not boxes:
        return None
    size = boxes[0][1]
    if any(s != size for _, s in boxes) or any(
            o % max(n, 1) for offsets, _ in boxes for o, n in zip(offsets, size)):
        return None
    cells = math.prod(-(-g // max(n, 1)) for g, n in zip(global_shape, size))
    if any(g % max(n, 1) for g, n in zip(global_shape, size)):
        return None  # a ragged last row of cells: let the general path measure it
    distinct = len({o for o, _ in boxes})
    return Coverage(1 - distinct / cells if cells else 0.0, distinct < len(boxes), False)



def describe_chunks(boxes: Iterable[Box]) -> str:
    """The chunk sizes, e.g. "32 chunks of [1, 1, 24, 32]"."""
    sizes: dict[tuple, int] = {}
    for _, size in boxes:
        sizes[tuple(size)] = sizes.get(tuple(size), 0) + 1
    return ", ".join(f"{n} chunk{'s' if n > 1 else ''} of {list(size)}"
                     for size, n in sizes.items()) or "no chunks"
