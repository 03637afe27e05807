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
    if ndim == 0:
        return Coverage(0.0 if boxes else 1.0, len(boxes) > 1, False)
    if len(boxes) == 1 and boxes[0] == ((0,) * ndim, tuple(global_shape)):
        return Coverage(0.0, False, False)  # one whole chunk (unsharded): no arrays to build
    ragged = any(len(o) != ndim or len(s) != ndim for o, s in boxes)
    boxes = [(o, s) for o, s in boxes if len(o) == ndim and len(s) == ndim]
    shape = np.asarray(global_shape, dtype=np.int64)
    offsets = np.asarray([o for o, _ in boxes], dtype=np.int64).reshape(-1, ndim)
    sizes = np.asarray([s for _, s in boxes], dtype=np.int64).reshape(-1, ndim)
    return coverage_of_arrays(shape, offsets, sizes, ragged)


def coverage_of_arrays(shape: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
                       out_of_bounds: bool = False) -> Coverage:
    """`coverage` of boxes given as [n, ndim] offset and size arrays (the save guard's form)."""
    out_of_bounds = bool(out_of_bounds or (offsets < 0).any() or (offsets + sizes > shape).any())
    if not out_of_bounds and (regular := _regular_grid_coverage(shape, offsets, sizes)):
        return regular
    total = float(np.prod(shape.astype(np.float64)))
    ends = np.clip(offsets + sizes, 0, shape)
    starts = np.clip(offsets, 0, shape)
    bounds = [np.asarray(sorted({0, g, *starts[:, d].tolist(), *ends[:, d].tolist()}))
              for d, g in enumerate(shape.tolist())]
    counts = np.zeros([len(b) - 1 for b in bounds], dtype=np.int32)
    for start, end in zip(starts, ends):
        counts[tuple(slice(np.searchsorted(b, a), np.searchsorted(b, e))
                     for b, a, e in zip(bounds, start, end))] += 1
    cell_volume = np.ones(counts.shape, dtype=np.float64)
    for d, b in enumerate(bounds):
        widths = np.diff(b.astype(np.float64))
        cell_volume *= widths.reshape([-1 if i == d else 1 for i in range(len(bounds))])
    missing = float(cell_volume[counts == 0].sum()) / total if total else 0.0
    return Coverage(missing, bool((counts > 1).any()), out_of_bounds)


def _regular_grid_coverage(shape: np.ndarray, offsets: np.ndarray,
                           sizes: np.ndarray) -> Coverage | None:
    """Fast path for the usual case: equal boxes on a grid of their size that divides the
    shape (cells counted by their grid index, no array of the grid). Per-dimension arithmetic
    is plain Python: most tensors have a handful of chunks, where numpy's per-call cost rules.

    None when the boxes are not such a grid; the general path handles them.
    """
    if not len(offsets):
        return None
    size, dims = sizes[0].tolist(), shape.tolist()
    if min(size) <= 0 or (sizes != sizes[0]).any():
        return None  # empty boxes cover nothing (the general path counts them so), or unequal
    if any(g % n for g, n in zip(dims, size)) or (offsets % sizes[0]).any():
        return None  # off the grid, or a ragged last row of cells: the general path measures it
    grid = [g // n for g, n in zip(dims, size)]
    cells = math.prod(grid)
    strides = [math.prod(grid[d + 1:]) for d in range(len(grid))]
    index = offsets // sizes[0]
    if cells < 2**62:
        flat = (index @ np.asarray(strides, dtype=np.int64)).tolist()
    else:  # beyond int64: Python integers
        flat = [sum(i * n for i, n in zip(row, strides)) for row in index.tolist()]
    distinct = len(set(flat))
    return Coverage(1 - distinct / cells if cells else 0.0, distinct < len(flat), False)


def describe_chunks(boxes: Iterable[Box]) -> str:
    """The chunk sizes, e.g. "32 chunks of [1, 1, 24, 32]"."""
    sizes: dict[tuple, int] = {}
    for _, size in boxes:
        sizes[tuple(size)] = sizes.get(tuple(size), 0) + 1
    return ", ".join(f"{n} chunk{'s' if n > 1 else ''} of {list(size)}"
                     for size, n in sizes.items()) or "no chunks"
