"""The output datasets, written under temporary names beside the final ones and renamed into
place only when complete.

megatron takes a dataset to be there when both PREFIX.bin and PREFIX.idx exist. Partial files
are PREFIX.bin.partial and PREFIX.idx.partial (a killed run leaves only those; the next run
truncates them), and the commit renames the .bin first and the .idx last, after removing an
old .idx: at no point do a .bin and an .idx of different runs sit side by side. Before the pair,
PREFIX.prepare_data.json records what made it (moe_launcher/dataset_record.py)."""

from __future__ import annotations

import array
import os
import struct

import numpy

from moe_launcher import dataset_record
from moe_launcher.runtime.durable_files import fsync_path

from .errors import PrepareError

PARTIAL = ".partial"


def dataset_prefixes(output_prefix: str, keys: tuple[str, ...]) -> list[str]:
    """megatron's naming: one PREFIX_<key>_document dataset per key (its --data-path value)."""
    return [f"{output_prefix}_{key}_document" for key in keys]


def check_output(output_prefix: str, keys: tuple[str, ...], overwrite: bool) -> None:
    directory = os.path.dirname(output_prefix) or "."
    if not os.path.isdir(directory):
        raise PrepareError(f"output directory {directory} does not exist")
    if not os.access(directory, os.W_OK):
        raise PrepareError(f"output directory {directory} is not writable")
    if overwrite:
        return
    for prefix in dataset_prefixes(output_prefix, keys):
        existing = [prefix + ext for ext in (".bin", ".idx") if os.path.exists(prefix + ext)]
        if existing:
            raise PrepareError(f"{existing[0]} already exists (--overwrite replaces it)")


def _write_index(path: str, dtype: type, lengths: array.array,
                 document_indices: array.array) -> None:
    """The .idx megatron's _IndexWriter writes, byte for byte (its header, version 1, the dtype's
    code, the sequence and document counts, each sequence's length as int32 and byte offset in
    the .bin as int64, the documents' ends as int64), with the offsets from numpy: megatron's
    writer builds them as a Python list, ~36 bytes a sequence held at the end of the run."""
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    sizes = numpy.frombuffer(lengths, dtype=numpy.int64)
    offsets = numpy.zeros(len(sizes), dtype=numpy.int64)
    numpy.cumsum(sizes[:-1] * DType.size(dtype), out=offsets[1:])
    with open(path, "wb") as f:
        f.write(_INDEX_HEADER + struct.pack("<Q", 1)
                + struct.pack("<B", DType.code_from_dtype(dtype))
                + struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(document_indices)))
        sizes.astype(numpy.int32).tofile(f)
        offsets.tofile(f)
        numpy.frombuffer(document_indices, dtype=numpy.int64).tofile(f)


class DatasetWriter:
    """One key's dataset, through megatron's IndexedDatasetBuilder."""

    def __init__(self, prefix: str, dtype: type, record: dict):
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.prefix = prefix
        self.builder = IndexedDatasetBuilder(prefix + ".bin" + PARTIAL, dtype=dtype)
        # The builder keeps every sequence's length and every document's end in Python lists,
        # ~36 bytes an entry for the whole run; int64 arrays hold the same values in 8 bytes,
        # and its index writer reads them alike (numpy.array of either).
        self.builder.sequence_lengths = array.array("q")
        self.builder.document_indices = array.array("q", [0])
        self.record = record  # what made it (moe_launcher/dataset_record.py)
        self.largest = -1  # the largest token id written

    def add(self, tokens: numpy.ndarray, lengths: numpy.ndarray, sequences: numpy.ndarray) -> None:
        """Documents of a chunk: `tokens` concatenated, lengths[j] of them the j-th sequence's,
        sequences[i] sequences the i-th document's (none: a document of no sequence)."""
        if tokens.size:
            self.largest = max(self.largest, int(tokens.max()))
        token_ends = numpy.cumsum(lengths)
        sequence_ends = numpy.cumsum(sequences)
        start = 0
        for first, last in zip(sequence_ends - sequences, sequence_ends):
            end = int(token_ends[last - 1]) if last > first else start
            # A numpy slice, not a tensor: add_document converts with numpy.array(), which
            # copies either way, and warns (numpy 2) for every tensor.
            self.builder.add_document(tokens[start:end], lengths[first:last].tolist())
            start = end

    def finish(self) -> None:
        """Writes the index and makes both files durable, still under their partial names."""
        self.builder.data_file.close()  # what the builder's finalize does before its index
        _write_index(self.prefix + ".idx" + PARTIAL, self.builder.dtype,
                     self.builder.sequence_lengths, self.builder.document_indices)
        for ext in (".bin", ".idx"):
            fsync_path(self.prefix + ext + PARTIAL)

    def commit(self) -> None:
        if os.path.exists(self.prefix + ".idx"):
            os.unlink(self.prefix + ".idx")
        # The record before the pair: a complete .bin/.idx never sits beside an older record.
        dataset_record.write(self.prefix, {**self.record, "largest_token_id": self.largest})
        os.replace(self.prefix + ".bin" + PARTIAL, self.prefix + ".bin")
        os.replace(self.prefix + ".idx" + PARTIAL, self.prefix + ".idx")
        fsync_path(os.path.dirname(self.prefix) or ".")

    def discard(self) -> None:
        self.builder.data_file.close()
        for ext in (".bin", ".idx"):
            if os.path.exists(self.prefix + ext + PARTIAL):
                os.unlink(self.prefix + ext + PARTIAL)


class OutputSet:
    """All keys' datasets: finished together, committed together, or all discarded."""

    def __init__(self, output_prefix: str, keys: tuple[str, ...], dtype: type, record: dict):
        self.writers: dict[str, DatasetWriter] = {}
        try:
            for key, prefix in zip(keys, dataset_prefixes(output_prefix, keys)):
                self.writers[key] = DatasetWriter(prefix, dtype, {**record, "json_key": key})
        except OSError as err:
            self.discard()
            raise PrepareError(f"cannot write {err.filename}: {err.strerror}") from None

    def add(self, tokens: dict, lengths: dict, sequences: dict) -> None:
        for key, writer in self.writers.items():
            writer.add(tokens[key], lengths[key], sequences[key])

    def commit(self) -> None:
        for writer in self.writers.values():
            writer.finish()
        for writer in self.writers.values():
            writer.commit()

    def discard(self) -> None:
        for writer in self.writers.values():
            writer.discard()
