"""The preflight's dataset check (moe_launcher.data.index_problem) on large synthetic datasets:
its cost against megatron's own opening of the same dataset (IndexedDataset, which every rank
runs before training), measured in the same run, at growing sizes.

Each dataset is an .idx as megatron's IndexedDatasetBuilder writes it (header, int32 sequence
lengths, int64 sequence pointers, int64 document indices) for N sequences of 2,048 uint16 tokens,
and a sparse .bin of the length those pointers need (no data is written: 2^20 sequences make a
4 GiB .bin that takes no room). The check reads three small pieces of the .idx and stats the
.bin, whatever N: its time should stay flat while megatron's grows with the index.

    python bench/dataset_check_bench.py [--sizes 16384,1048576,16777216]
"""

from __future__ import annotations

import argparse
import logging
import os
import struct
import sys
import tempfile

import numpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType, IndexedDataset  # noqa: E402

from bench.timing import median_seconds  # noqa: E402
from moe_launcher.data import index_problem  # noqa: E402

TOKENS_PER_SEQUENCE = 2048


def write_dataset(prefix: str, sequences: int) -> int:
    """A sequences-long .idx and the sparse .bin it describes; returns the .bin's length."""
    dtype = numpy.uint16
    lengths = numpy.full(sequences, TOKENS_PER_SEQUENCE, dtype=numpy.int32)
    pointers = numpy.arange(sequences, dtype=numpy.int64) * TOKENS_PER_SEQUENCE * 2
    documents = numpy.arange(sequences + 1, dtype=numpy.int64)
    with open(prefix + ".idx", "wb") as f:
        f.write(_INDEX_HEADER)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", DType.code_from_dtype(dtype)))
        f.write(struct.pack("<Q", sequences))
        f.write(struct.pack("<Q", documents.size))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(documents.tobytes(order="C"))
    size = sequences * TOKENS_PER_SEQUENCE * 2
    with open(prefix + ".bin", "wb") as f:
        f.truncate(size)
    return size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="16384,1048576,16777216",
                        help="sequence counts (2,048 tokens each)")
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    logging.getLogger("megatron.core.datasets").setLevel(logging.WARNING)  # a line per open
    with tempfile.TemporaryDirectory(prefix="dataset_check_bench_") as folder:
        for sequences in map(int, options.sizes.split(",")):
            prefix = os.path.join(folder, f"synthetic_{sequences}_text_document")
            bin_size = write_dataset(prefix, sequences)
            assert index_problem(prefix) is None
            ours = median_seconds(options.repeats, lambda: index_problem(prefix))
            megatron = median_seconds(options.repeats, lambda: IndexedDataset(prefix, mmap=True))
            print(f"{sequences:9d} sequences: .idx {os.path.getsize(prefix + '.idx') / 2**20:8.1f} "
                  f"MiB, .bin {bin_size / 2**30:7.1f} GiB (sparse) | check {ours * 1e3:7.3f} ms | "
                  f"megatron's IndexedDataset open {megatron * 1e3:8.2f} ms | check / megatron "
                  f"{ours / megatron:.4f}", flush=True)
            for suffix in (".idx", ".bin"):
                os.unlink(prefix + suffix)


if __name__ == "__main__":
    main()
