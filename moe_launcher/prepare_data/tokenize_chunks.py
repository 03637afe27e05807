"""What a worker does with one chunk: parse its records, check each key's text, tokenize each
key's texts in one batch call, and return flat token arrays with the sequences' lengths and
each document's number of sequences.

Each record is written as Megatron-LM's tools/preprocess_data.py writes it (one document per
record and key): a text is one sequence, a list of texts one sequence per element; a sequence
that tokenizes to nothing is left out, so an empty text is a document of its BOS token where
the tokenizer adds one, else a document of no sequence; --append-eod ends a document's last
sequence with the end-of-document token when it has one. A record is kept or skipped as a
whole, so document i of every key's output comes from the same record."""

from __future__ import annotations

import dataclasses
import ctypes
import itertools
import json
import os
import signal
import sys
from collections import Counter
from collections.abc import Iterator

import numpy

from .config import Chunk, ChunkResult

MALFORMED = "malformed JSON"


@dataclasses.dataclass(frozen=True)
class WorkerSetup:
    tokenizer: object                # megatron's HuggingFaceTokenizer (see tokenizer.py)
    keys: tuple[str, ...]
    append_eod: bool
    skip_bad_lines: bool
    dtype: type                      # the .bin dtype megatron picks for the vocabulary
    parent_pid: int
    encoder: object = None           # a piece_cache.PieceCacheEncoder where it is exact


_setup: WorkerSetup | None = None


def install(setup: WorkerSetup) -> None:
    """Pool initializer. Ctrl-C is the parent's to handle (it removes the partial output);
    workers are stopped by it, not by the signal. A parent killed outright (the OOM killer,
    SIGKILL) cannot stop them: the kernel does, where it can, as they would otherwise wait on
    their task queue forever."""
    global _setup
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != setup.parent_pid:  # the parent died before that took effect
            os._exit(1)
    _setup = setup


def tokenize_chunk(chunk: Chunk) -> ChunkResult:
    return process(chunk, _setup)


def process(chunk: Chunk, setup: WorkerSetup) -> ChunkResult:
    from .tokenizer import hf_tokenizer

    skipped = Counter()
    texts: dict[str, list[str]] = {key: [] for key in setup.keys}  # every sequence's text
    per_document: dict[str, list[int]] = {key: [] for key in setup.keys}  # texts per document
    for values in _records(chunk, setup, skipped):
        if isinstance(values, str):  # the malformed line, not skipping: stop here
            return ChunkResult({}, {}, {}, skipped, bad_line=values)
        reason, checked = _check(values)
        if reason:
            skipped[reason] += 1
            continue
        for key, sequences in zip(setup.keys, checked):
            texts[key].extend(sequences)
            per_document[key].append(len(sequences))

    hf = hf_tokenizer(setup.tokenizer)
    encoder = setup.encoder
    before = (encoder.fast_documents, encoder.mismatches) if encoder else (0, 0)
    eod = setup.tokenizer.eod  # a property that looks the token up on every call
    tokens, lengths, sequences = {}, {}, {}
    for key in setup.keys:
        if not texts[key]:
            ids = iter([])
        elif encoder:
            ids = iter(encoder.encode(texts[key]))
        else:
            ids = iter(hf(texts[key], return_attention_mask=False, return_token_type_ids=False)
                       ["input_ids"])
        kept, counts = [], []
        for count in per_document[key]:
            document = [sequence for sequence in itertools.islice(ids, count) if sequence]
            if document and setup.append_eod:
                document[-1].append(eod)
            kept.extend(document)
            counts.append(len(document))
        lengths[key] = numpy.fromiter(map(len, kept), dtype=numpy.int64, count=len(kept))
        sequences[key] = numpy.array(counts, dtype=numpy.int64)
        tokens[key] = numpy.fromiter(itertools.chain.from_iterable(kept), dtype=setup.dtype,
                                     count=int(lengths[key].sum()))
    fast = Counter()
    if encoder:
        fast.update(documents=encoder.fast_documents - before[0],
                    mismatches=encoder.mismatches - before[1])
    return ChunkResult(tokens, lengths, sequences, +skipped, input_bytes=chunk.input_bytes,
                       fast=fast)


def _records(chunk: Chunk, setup: WorkerSetup, skipped: Counter) -> Iterator[list | str]:
    """Each record's values for the keys (None where missing), or for a malformed line that is
    not to be skipped, its one-line description."""
    if chunk.lines is None:
        columns = {key: array.to_pylist() for key, array in chunk.columns.items()}
        for row in range(chunk.rows):
            yield [columns[key][row] if key in columns else None for key in setup.keys]
        return
    lines = chunk.lines.split(b"\n")
    if not lines[-1]:  # the newline ending the chunk's last line
        lines.pop()
    for number, line in enumerate(lines, start=chunk.first_record):
        if not line.strip():
            skipped["empty"] += 1
            continue
        try:
            record = json.loads(line)
        except UnicodeDecodeError:  # json.loads decodes bytes itself, strictly
            skipped["non-UTF-8"] += 1
            continue
        except json.JSONDecodeError as err:
            problem = f"{err.msg} (column {err.colno})"
            record = None
        else:
            problem = None if isinstance(record, dict) else "not a JSON object"
        if problem:
            if not setup.skip_bad_lines:
                yield f"{chunk.source}:{number}: {MALFORMED} line: {problem}"
                return
            skipped[MALFORMED] += 1
            continue
        yield [record.get(key) for key in setup.keys]


def _check(values: list) -> tuple[str | None, list[list[str]]]:
    """(why the record is skipped, or None; each key's sequences: a text, or a list's texts)."""
    checked = []
    for value in values:
        if value is None:
            return "missing key", []
        sequences = []
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, bytes):  # a Parquet binary column
                try:
                    text = text.decode("utf-8")
                except UnicodeDecodeError:
                    return "non-UTF-8", []
            if not isinstance(text, str):
                return "not text", []
            try:  # a JSON "\ud800" escape decodes to a lone surrogate, which is no UTF-8 text
                text.encode("utf-8")
            except UnicodeEncodeError:
                return "non-UTF-8", []
            sequences.append(text)
        checked.append(sequences)
    return None, checked
