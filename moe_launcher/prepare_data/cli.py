"""Command line: flags into a PrepareConfig, and refusals into one line and exit status 2."""

from __future__ import annotations

import argparse
import os
import sys

from moe_launcher.runtime.refusals import EXIT_STATUS

from .config import PrepareConfig
from .errors import PrepareError


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prepare_data",
        description="Tokenize JSON lines (.jsonl, .jsonl.gz) and Parquet text into megatron "
                    "indexed datasets: PREFIX_<key>_document.bin/.idx, for --data-path.")
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE_OR_GLOB",
                        help="input files or glob patterns (quoted), read in the order given")
    parser.add_argument("--tokenizer", required=True, metavar="HF_DIR",
                        help="local Hugging Face tokenizer folder: the training run's "
                             "--tokenizer-model (with --tokenizer-type HuggingFaceTokenizer)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="load a tokenizer that is code of its folder's own (its "
                             "tokenizer_config.json's auto_map, e.g. a tiktoken tokenizer), "
                             "running that code; the training run needs megatron's "
                             "--trust-remote-code for it too")
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX")
    parser.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                        help="fields (JSON keys or Parquet columns) to tokenize; one dataset "
                             "each (default: text)")
    parser.add_argument("--append-eod", action="store_true",
                        help="end each document with the tokenizer's end-of-document token")
    parser.add_argument("--workers", type=_positive(int), default=len(os.sched_getaffinity(0)),
                        help="tokenizing processes (default: the CPU cores available)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output instead of refusing")
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="skip and count malformed JSON lines instead of stopping")
    parser.add_argument("--log-interval", type=_positive(float), default=30.0,
                        metavar="SECONDS",
                        help="seconds between progress lines when stderr is not a terminal")
    parser.add_argument("--chunk-bytes", type=_positive(int), default=1 << 20,
                        help="input bytes per worker task (default 1 MiB)")
    # Megatron-LM's tool splits sentences with NLTK; refused in one line rather than ignored.
    parser.add_argument("--split-sentences", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.split_sentences:
        print(PrepareError("--split-sentences (Megatron-LM's NLTK sentence splitting) is not "
                           "supported; fix: give each record's text as a list of sentences "
                           "(one sequence each, as the tool writes them), or drop the "
                           "flag").line(), file=sys.stderr)
        return EXIT_STATUS
    config = PrepareConfig(
        inputs=tuple(args.input), tokenizer=args.tokenizer,
        trust_remote_code=args.trust_remote_code, output_prefix=args.output_prefix,
        json_keys=tuple(args.json_keys), append_eod=args.append_eod, workers=args.workers,
        overwrite=args.overwrite, skip_bad_lines=args.skip_bad_lines,
        log_interval=args.log_interval, chunk_bytes=args.chunk_bytes)
    from .pipeline import prepare

    try:
        summary = prepare(config)
    except PrepareError as err:
        print(err.line(), file=sys.stderr)
        return EXIT_STATUS
    except KeyboardInterrupt:
        print("prepare_data: interrupted; nothing written", file=sys.stderr)
        return 130
    print(summary, flush=True)
    return 0
