"""What one run is asked to do, and what flows between the reader, the workers and the writer."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    inputs: tuple[str, ...]          # files or glob patterns, as given
    tokenizer: str                   # a local Hugging Face tokenizer folder
    output_prefix: str
    trust_remote_code: bool = False  # the folder's own tokenizer code may run
    json_keys: tuple[str, ...] = ("text",)
    append_eod: bool = False
    workers: int = 1
    overwrite: bool = False
    skip_bad_lines: bool = False
    log_interval: float = 30.0
    chunk_bytes: int = 1 << 20       # input bytes per worker task


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A run of consecutive records of one input file, tokenized as one worker task.

    JSON lines carry `lines` (complete lines, newline-separated); Parquet carries `rows` and
    `columns` (key -> pyarrow array, for the keys the file has a column for)."""

    source: str
    first_record: int                # 1-based line (JSON lines) or row (Parquet) number
    input_bytes: int                 # how much of the input this chunk accounts for (progress)
    lines: bytes | None = None
    rows: int = 0
    columns: dict | None = None


@dataclasses.dataclass
class ChunkResult:
    """One chunk tokenized: per key, the concatenated tokens, each sequence's length, and each
    document's number of sequences (its sequences follow one another)."""

    tokens: dict[str, numpy.ndarray]
    lengths: dict[str, numpy.ndarray]
    sequences: dict[str, numpy.ndarray]
    skipped: Counter                 # reason -> records skipped
    bad_line: str | None = None      # the first malformed line, when not skipping them
    input_bytes: int = 0
    fast: Counter = dataclasses.field(default_factory=Counter)  # piece cache: documents, mismatches

    @property
    def documents(self) -> int:
        return len(next(iter(self.sequences.values())))

    @property
    def token_count(self) -> int:
        return sum(int(t.size) for t in self.tokens.values())
