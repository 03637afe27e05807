"""One run: check everything that can be checked before writing, then stream chunks through a
pool of tokenizing workers, in order, into the output, and commit it.

Workers are forked so they share the parent's imports and tokenizer instead of paying
megatron's import again, and forked first, while this process has no other thread (reading
Parquet starts pyarrow's allocator thread, a progress bar on a terminal tqdm's monitor). At
most 2 x workers chunks are in flight, so memory does not grow with the corpus; results are
taken in submission order, so the output does not depend on the number of workers."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from moe_launcher import dataset_record

from . import inputs, output, tokenize_chunks
from .config import Chunk, ChunkResult, PrepareConfig
from .errors import PrepareError
from .progress import Progress
from .piece_cache import PieceCacheEncoder
from .tokenizer import check_tokenizer_folder, hf_tokenizer, load_tokenizer


def prepare(config: PrepareConfig) -> str:
    """Runs `config`; returns the summary line. Raises PrepareError with nothing written."""
    files = inputs.resolve_inputs(config.inputs)
    check_tokenizer_folder(config.tokenizer)
    output.check_output(config.output_prefix, config.json_keys, config.overwrite)

    # One thread per worker: the pool is the parallelism, and tokenizers' own thread pool would
    # oversubscribe the cores (and must not have run before a fork).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = load_tokenizer(config.tokenizer, config.trust_remote_code)
    if config.append_eod and tokenizer.eod is None:
        raise PrepareError(f"--append-eod: the tokenizer in {config.tokenizer} has no "
                           "end-of-document (eos) token")
    from megatron.core.datasets.indexed_dataset import DType

    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    encoder = PieceCacheEncoder.for_tokenizer(hf_tokenizer(tokenizer))
    setup = tokenize_chunks.WorkerSetup(tokenizer, config.json_keys, config.append_eod,
                                        config.skip_bad_lines, dtype, os.getpid(), encoder)
    datasets = output.dataset_prefixes(config.output_prefix, config.json_keys)
    with _workers(config.workers, setup) as pool:
        progress = Progress(inputs.total_input_bytes(files), config.log_interval,
                            piece_cache=encoder is not None)
        record = {"made_by": "python -m moe_launcher.prepare_data",
                  "tokenizer": dataset_record.tokenizer_identity(tokenizer, "HuggingFaceTokenizer",
                                                               config.tokenizer),
                  "append_eod": config.append_eod,
                  "inputs": [os.path.abspath(path) for path in files]}
        outputs = output.OutputSet(config.output_prefix, config.json_keys, dtype, record)
        try:
            chunks = inputs.read_chunks(files, config.json_keys, config.chunk_bytes)
            for result in _in_order(pool, chunks, 2 * config.workers):
                if result.bad_line:
                    raise PrepareError(f"{result.bad_line}; --skip-bad-lines skips such lines")
                _write(outputs, result)
                progress.update(result.documents, result.token_count, result.skipped,
                                result.input_bytes, result.fast)
            progress.close()
            if not progress.documents:
                raise PrepareError(f"no document to write ({progress.summary()})")
            outputs.commit()
        except BaseException:
            progress.close()
            outputs.discard()
            raise
    return f"prepare_data: done: {progress.summary()} -> {', '.join(datasets)}"


@contextlib.contextmanager
def _workers(count: int, setup: tokenize_chunks.WorkerSetup) -> Iterator[ProcessPoolExecutor]:
    pool = ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("fork"),
                               initializer=tokenize_chunks.install, initargs=(setup,))
    try:
        # A fork-context executor forks all its workers at its first task: this one.
        pool.submit(os.getpid).result()
        yield pool
    except BrokenProcessPool:
        raise PrepareError("a tokenizer worker died (out of memory?)") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _in_order(pool: ProcessPoolExecutor, chunks: Iterable[Chunk],
              in_flight: int) -> Iterator[ChunkResult]:
    pending = deque()
    for chunk in chunks:
        pending.append(pool.submit(tokenize_chunks.tokenize_chunk, chunk))
        if len(pending) >= in_flight:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _write(outputs: output.OutputSet, result: ChunkResult) -> None:
    try:
        outputs.add(result.tokens, result.lengths, result.sequences)
    except OSError as err:
        raise PrepareError(f"cannot write the output: {err.strerror}") from None
