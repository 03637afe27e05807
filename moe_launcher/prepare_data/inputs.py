"""Which files a run reads, and reading them as a stream of bounded chunks.

The chunking depends on the files and `chunk_bytes` only, never on the number of workers, so
the output is the same for any --workers."""

from __future__ import annotations

import glob
import gzip
import os
import zlib
from collections.abc import Iterator

from .config import Chunk
from .errors import PrepareError

JSON_LINES = (".jsonl", ".json")
GZIP_JSON_LINES = (".jsonl.gz", ".json.gz")
PARQUET = (".parquet",)
READ_BLOCK = 1 << 20


def resolve_inputs(patterns: tuple[str, ...]) -> list[str]:
    """The files named, globs expanded (sorted, so a run is reproducible), each checked to be a
    readable file of a known format, before anything is written."""
    files = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matched = sorted(path for path in glob.glob(pattern, recursive=True)
                             if os.path.isfile(path))
            if not matched:
                raise PrepareError(f"no file matches --input {pattern}")
        else:
            matched = [pattern]
        for path in matched:
            _check_readable(path)
            if path not in files:
                files.append(path)
    return files


def _check_readable(path: str) -> None:
    if not os.path.exists(path):
        raise PrepareError(f"input file {path} does not exist")
    if not os.path.isfile(path):
        raise PrepareError(f"input {path} is not a file")
    if not path.endswith(JSON_LINES + GZIP_JSON_LINES + PARQUET):
        raise PrepareError(f"input {path}: unknown format (expected .jsonl, .jsonl.gz or "
                           ".parquet)")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as err:
        raise PrepareError(f"cannot read input {path}: {err.strerror}") from None


def total_input_bytes(files: list[str]) -> int:
    return sum(os.path.getsize(path) for path in files)


def read_chunks(files: list[str], keys: tuple[str, ...], chunk_bytes: int) -> Iterator[Chunk]:
    for path in files:
        if path.endswith(PARQUET):
            yield from _parquet_chunks(path, keys, chunk_bytes)
            continue
        try:
            yield from _json_lines_chunks(path, chunk_bytes)
        except (OSError, EOFError, zlib.error) as err:  # gzip: damaged or truncated
            raise PrepareError(f"cannot read input {path}: {err}") from None


def _json_lines_chunks(path: str, chunk_bytes: int) -> Iterator[Chunk]:
    """Whole lines, about chunk_bytes at a time. Progress counts bytes on disk (for gzip, the
    compressed bytes in proportion to those decompressed), so one ETA holds for mixed inputs."""
    with open(path, "rb") as raw:
        stream = gzip.GzipFile(fileobj=raw) if path.endswith(GZIP_JSON_LINES) else raw
        first_line, pending, at_end = 1, b"", False
        decompressed, emitted, reported = 0, 0, 0
        while not at_end:
            block = stream.read(max(READ_BLOCK, chunk_bytes))
            at_end = not block
            decompressed += len(block)
            pending += block
            while pending and (at_end or len(pending) >= chunk_bytes):
                cut = _line_boundary(pending, chunk_bytes) or (len(pending) if at_end else 0)
                if not cut:  # a line longer than chunk_bytes: read on to its end
                    break
                lines, pending = pending[:cut], pending[cut:]
                emitted += len(lines)
                on_disk = raw.tell() * emitted // max(1, decompressed)
                yield Chunk(path, first_line, on_disk - reported, lines=lines)
                reported = on_disk
                first_line += lines.count(b"\n")


def _line_boundary(buffer: bytes, chunk_bytes: int) -> int:
    """Where a chunk of whole lines ends: after the last newline within chunk_bytes, or else
    after the first one past it; 0 if the buffer holds no newline."""
    cut = buffer.rfind(b"\n", 0, chunk_bytes) + 1
    return cut or buffer.find(b"\n", chunk_bytes) + 1


def _parquet_chunks(path: str, keys: tuple[str, ...], chunk_bytes: int) -> Iterator[Chunk]:
    """Row batches of about chunk_bytes of uncompressed text. A key the file has no column for
    is left out of `columns`, so its rows count as missing that key."""
    import pyarrow
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        present = [key for key in keys if key in names]
        metadata = parquet.metadata
        text_bytes = sum(
            metadata.row_group(g).column(c).total_uncompressed_size
            for g in range(metadata.num_row_groups) for c in range(metadata.num_columns)
            if metadata.row_group(g).column(c).path_in_schema in present)
        total_rows = max(1, metadata.num_rows)
        batch_rows = max(1, chunk_bytes * total_rows // max(1, text_bytes))
        file_bytes, reported, first_row = os.path.getsize(path), 0, 1
        # With none of the keys present, one column is still read for the row counts.
        for batch in parquet.iter_batches(batch_size=batch_rows, columns=present or names[:1]):
            on_disk = file_bytes * (first_row + batch.num_rows - 1) // total_rows
            yield Chunk(path, first_row, on_disk - reported, rows=batch.num_rows,
                        columns={key: batch.column(key) for key in present})
            reported, first_row = on_disk, first_row + batch.num_rows
    except (OSError, pyarrow.ArrowException) as err:
        raise PrepareError(f"cannot read input {path}: {err}") from None
