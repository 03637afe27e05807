"""Throughput of `python -m moe_launcher.prepare_data` at 1 and at n workers (n = the cores),
against a plain loop of megatron's tokenize(text) in one process, and peak memory.

    .venv/bin/python bench/prepare_data_bench.py [--megabytes 50] [--workers N]
        [--tokenizer byte-level|metaspace]

Builds, in a temporary folder, a synthetic JSON lines corpus (pseudo-words, documents of 50 to
800 words) and a byte-level BPE tokenizer trained on part of it with `tokenizers` (saved as a
Hugging Face folder, vocabulary 32000). Throughput is tokens over the seconds the command's
summary reports (workers started to output committed): megatron's import, paid once per run
whatever the corpus, is left out. Peak memory is the command's process tree (parent + workers,
PSS), sampled; the n-worker run is repeated on a quarter of the corpus to show it does not grow
with the input. Goal: scaling >= 0.8, per-worker throughput no lower than the plain loop, and
3x Megatron-LM's tool method at the same workers (issue 38: met with the piece cache). The
2-worker output is compared with the tool method's, byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
SYLLABLES = ("ka to ri men sa lo qu ex pert rou ter gra di ent ion tha the an in on mo e "
             "la yer to ken sha rd ck pt ba tch").split()


def write_corpus(path: Path, megabytes: int) -> int:
    rng = random.Random(0)
    words = ["".join(rng.choices(SYLLABLES, k=rng.randint(1, 4))) for _ in range(20000)]
    documents, written = 0, 0
    with open(path, "w") as f:
        while written < megabytes * 1_000_000:
            text = " ".join(rng.choices(words, k=rng.randint(50, 800))) + "."
            written += f.write(json.dumps({"id": documents, "text": text}) + "\n")
            documents += 1
    return documents


def build_tokenizer(corpus: Path, folder: Path, kind: str = "byte-level") -> None:
    """A BPE of 32000 tokens trained on the corpus: GPT-2's byte-level pre-tokenizer, or a
    SentencePiece-like Metaspace one (`kind` "metaspace")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    with open(corpus) as f:
        sample = [json.loads(line)["text"] for line, _ in zip(f, range(3000))]
    tokenizer = Tokenizer(models.BPE())
    metaspace = kind == "metaspace"
    if metaspace:
        tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(sample, trainers.BpeTrainer(
        vocab_size=32000, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=[] if metaspace else pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer,
                            eos_token="<|endoftext|>").save_pretrained(folder)


def plain_loop(corpus: Path, tokenizer: Path, seconds: float = 30) -> float:
    """tokens/s of megatron's HuggingFaceTokenizer.text_to_ids(text) (what training's
    tokenize(text) calls), one document at a time, in a fresh process (the same tokenizer object
    prepare_data loads), over the corpus's first documents; only those calls are timed."""
    code = f"""
import json, os, sys, time
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from moe_launcher.prepare_data.tokenizer import load_tokenizer
tokenizer = load_tokenizer({str(tokenizer)!r})
tokens, spent = 0, 0.0
with open({str(corpus)!r}, "rb") as f:
    for line in f:
        text = json.loads(line)["text"]
        start = time.perf_counter()
        tokens += len(tokenizer.text_to_ids(text))
        spent += time.perf_counter() - start
        if spent > {seconds}:
            break
print(tokens / spent)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return float(done.stdout.split()[-1])


def tool_method(corpus: Path, tokenizer: Path, prefix: Path, workers: int) -> float:
    """tokens/s of Megatron-LM's tools/preprocess_data.py method, written here from its
    behaviour: a Pool of `workers` processes, each loading the tokenizer once, mapped over the
    lines with imap (chunksize 32), one json.loads and one tokenize per document plus EOD; the
    parent adds each document to megatron's IndexedDatasetBuilder and writes the index. Timed
    from the pool's start to the index written (the tokenizer's and megatron's import left out,
    as in prepare_data's summary)."""
    code = f"""
import json, multiprocessing, os, time
os.environ["TOKENIZERS_PARALLELISM"] = "false"
import numpy
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from moe_launcher.prepare_data.tokenizer import load_tokenizer

def start():
    global tokenizer
    tokenizer = load_tokenizer({str(tokenizer)!r})

def encode(line):
    ids = tokenizer.text_to_ids(json.loads(line)["text"])
    if ids:
        ids.append(tokenizer.eod)
    return ids

if __name__ == "__main__":
    vocabulary = load_tokenizer({str(tokenizer)!r}).vocab_size
    dtype = numpy.uint16 if vocabulary < 65500 else numpy.int32
    began = time.perf_counter()
    builder = IndexedDatasetBuilder({str(prefix) + ".bin"!r}, dtype=dtype)
    tokens = 0
    with open({str(corpus)!r}, "rb") as f, multiprocessing.Pool({workers}, initializer=start) as pool:
        for ids in pool.imap(encode, f, 32):
            builder.add_document(ids, [len(ids)] if ids else [])
            tokens += len(ids)
    builder.finalize({str(prefix) + ".idx"!r})
    print(tokens / (time.perf_counter() - began))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return float(done.stdout.split()[-1])


def prepare(inputs: list[Path], tokenizer: Path, prefix: Path, workers: int) -> dict:
    """One run of the command: its tokens, seconds (from its summary) and the peak of its
    process tree's memory, as PSS (forked workers share the parent's pages; RSS would count
    them once per process)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_launcher.prepare_data", "--input", *map(str, inputs),
         "--tokenizer", str(tokenizer), "--output-prefix", str(prefix), "--append-eod",
         "--workers", str(workers), "--overwrite"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    peak = [0]

    def sample():
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
                peak[0] = max(peak[0], sum(p.memory_full_info().pss for p in tree))
            except psutil.Error:
                pass
            time.sleep(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    assert proc.returncode == 0, err[-3000:]
    found = re.search(r"(\d+) documents, (\d+) tokens, .* ([\d.]+) seconds", out)
    assert found, out
    return {"tokens": int(found[2]), "seconds": float(found[3]), "pss": peak[0] / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=50)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--tokenizer", choices=("byte-level", "metaspace"), default="byte-level")
    args = parser.parse_args()
    n = args.workers
    with tempfile.TemporaryDirectory(prefix="prepare-data-bench-") as folder:
        root = Path(folder)
        corpus, quarter, tokenizer = root / "corpus.jsonl", root / "quarter.jsonl", root / "tok"
        documents = write_corpus(corpus, args.megabytes)
        write_corpus(quarter, args.megabytes // 4)
        build_tokenizer(corpus, tokenizer, args.tokenizer)
        print(f"corpus: {corpus.stat().st_size / 1e6:.1f} MB JSON lines, {documents} documents;"
              f" tokenizer: {args.tokenizer} BPE, vocabulary 32000; cores: {os.cpu_count()}",
              flush=True)
        plain = plain_loop(corpus, tokenizer)
        tool = tool_method(corpus, tokenizer, root / "tool", n)
        one = prepare([corpus], tokenizer, root / "one", 1)
        many = prepare([corpus], tokenizer, root / "many", n)
        small = prepare([quarter], tokenizer, root / "small", n)
        a, b = one["tokens"] / one["seconds"], many["tokens"] / many["seconds"]
        print(f"plain tokenizer loop (megatron tokenize(text), 1 process): {plain:,.0f} tokens/s")
        print(f"tokens/s at 1 worker: {a:,.0f}, at {n} workers: {b:,.0f}, scaling {b / a / n:.2f}")
        print(f"per worker vs the plain loop: at 1 worker x{a / plain:.2f}, "
              f"at {n} workers x{b / n / plain:.2f}")
        print(f"tokens/s ours / tool-method at {n} workers: {b / tool:.2f} (tool method "
              f"{tool:,.0f} tokens/s; goal 3)")
        same = [(root / f"many_text_document{ext}").read_bytes() == (root / f"tool{ext}")
                .read_bytes() for ext in (".bin", ".idx")]
        print(f"output at {n} workers vs the tool method's: "
              f"{'byte-identical' if all(same) else 'DIFFERENT'} (.bin, .idx)")
        print("load average (1, 5, 15 min) at the end: %.1f %.1f %.1f (another load on the "
              "machine skews the scaling)" % os.getloadavg())
        print(f"peak RSS (PSS of parent + workers): 1 worker {one['pss']:.0f} MiB, {n} workers "
              f"{many['pss']:.0f} MiB; {n} workers on a quarter of the corpus "
              f"{small['pss']:.0f} MiB")
        if not all(same):
            raise SystemExit("the output differs from the tool method's")


if __name__ == "__main__":
    main()
