"""Small indexed datasets (.bin/.idx) written with megatron-core's own IndexedDatasetBuilder."""

from __future__ import annotations

import numpy
import torch


def write_indexed_corpus(prefix: str, vocab: int, documents: int = 64) -> None:
    """`documents` documents of 20-200 random token ids in 1..vocab-2 (seeded), as
    prefix.bin/prefix.idx."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for _ in range(documents):
        length = int(rng.integers(20, 200))
        builder.add_item(torch.from_numpy(rng.integers(1, vocab - 1, length).astype(numpy.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")
