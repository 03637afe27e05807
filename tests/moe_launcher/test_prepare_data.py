"""python -m moe_launcher.prepare_data: real files in, megatron's IndexedDataset read back out.

The tokenizer is a byte-level BPE trained here with `tokenizers` and saved as a Hugging Face
folder (tokenizer.json + tokenizer_config.json); it adds a BOS token, so "special tokens as
training adds them" is checked too. Runs that need no separate process (their subject is not
the process) call the CLI's main() in this process, where megatron is already imported."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import fcntl
import gzip
import io
import json
import os
import pty
import random
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import numpy
import psutil
import pytest

from _launch import REPO, TINY_MODEL, launch, tensorboard_scalars
from moe_launcher.prepare_data.cli import main

# The in-process runs fork from pytest's process, which has pyarrow's allocator thread once the
# corpus's Parquet file is written or read: Python's warning about that is this process's, not
# the command's (which is checked to fork with no thread, in `prepared`).
pytestmark = pytest.mark.filterwarnings("ignore:This process:DeprecationWarning")

WORDS = ("the of and to in is was for on that with as by at from expert router token layer "
         "gradient Ünïcödé naïve façade 中文 数据 emoji🙂 tab\there line\nbreak").split(" ")
EOS, BOS = "<|endoftext|>", "<|begin|>"


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _build_tokenizer(folder: Path, metaspace: bool = False) -> None:
    """A byte-level BPE (GPT-2's pre-tokenizer), or a SentencePiece-like Metaspace BPE, with a
    BOS post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(1)
    tokenizer = Tokenizer(models.BPE())
    if metaspace:
        tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
    # Trained serially: a parallel trainer leaves tokenizers' thread pool in this process, and
    # the in-process runs below fork.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TOKENIZERS_PARALLELISM", "false")
        tokenizer.train_from_iterator(
            (_text(rng, 50) for _ in range(400)),
            trainers.BpeTrainer(vocab_size=600, special_tokens=[EOS, BOS],
                                initial_alphabet=[] if metaspace else
                                pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=BOS,
                            model_max_length=64).save_pretrained(folder)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(folder))


@dataclasses.dataclass
class Corpus:
    root: Path
    tokenizer: Path
    inputs: list[str]       # --input values, a glob among them
    texts: list             # each document's text (a list: one sequence per element), in order
    bad_line: str           # where the first malformed line is: FILE:LINE


# What the corpus's bad records are counted as (the summary's wording). An empty text is a
# document, as Megatron-LM's tool writes it; a blank line is no record.
SKIPPED = "8 skipped (empty: 1, malformed JSON: 2, missing key: 2, non-UTF-8: 2, not text: 1)"


def _write_corpus(root: Path) -> Corpus:
    import pyarrow
    import pyarrow.parquet as pq

    rng = random.Random(0)
    texts = []

    def documents(count):
        batch = [_text(rng, rng.randint(1, 150)) for _ in range(count)]
        texts.extend(batch)
        return [json.dumps({"id": len(texts), "text": text}).encode() for text in batch]

    plain = root / "a.jsonl"
    head = documents(120)
    bad = [b'{"text": ""}', b'{"id": 7}', b'{"text": "caf\xe9"}', b'{"text": "\\ud800 lone"}',
           b"   ", b'{"text": "cut off', b'{"text": ["a", 5]}', b"[1, 2]"]
    texts.append("")  # the tokenizer's BOS alone, then EOD
    tail = documents(130)
    # The special tokens' text inside a document: megatron's tokenize() gives their ids.
    texts.append(f"{EOS} opens, {BOS} inside, {EOS}{EOS} at the end {EOS}")
    # A list is one sequence per element (an empty one adds none); an empty list is a document
    # of no sequence.
    texts += [[_text(rng, 12), "", _text(rng, 30), "Ünïcödé 中文 🙂"], [], [""]]
    tail += [json.dumps({"text": text}).encode() for text in texts[-4:]]
    plain.write_bytes(b"\n".join(head + bad + tail) + b"\n")
    for part in range(2):
        with gzip.open(root / f"part-{part}.jsonl.gz", "wb") as f:
            f.write(b"\n".join(documents(150)))  # no newline after the last line
    rows = documents(140)
    column = [json.loads(row)["text"] for row in rows]
    texts.insert(len(texts) - 70, "")  # the Parquet column's empty text, after its None
    pq.write_table(pyarrow.table({"text": column[:70] + [None, ""] + column[70:],
                                  "id": list(range(142))}),
                   root / "c.parquet", row_group_size=50)
    tokenizer = root / "tokenizer"
    _build_tokenizer(tokenizer)
    return Corpus(root, tokenizer, [str(plain), str(root / "part-*.jsonl.gz"),
                                    str(root / "c.parquet")], texts,
                  bad_line=f"{plain}:{len(head) + 6}")


def _cli(*args: str, python_flags=(), timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *python_flags, "-m", "moe_launcher.prepare_data",
                           *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def _in_process(*args: str) -> tuple[int, str, str]:
    """main(args) here; its exit status, stdout and stderr. Environment it sets is undone."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as env:
        for name in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM"):
            env.setenv(name, os.environ.get(name, ""))
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def _files(prefix: str) -> list[str]:
    folder, name = os.path.split(prefix)
    return sorted(entry for entry in os.listdir(folder) if entry.startswith(name))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Corpus:
    return _write_corpus(tmp_path_factory.mktemp("prepare_data"))


@pytest.fixture(scope="module")
def prepared(corpus):
    """The corpus prepared by 1 worker (here) and by 2 (the real command, replacing an old
    output, with a progress line per chunk); small chunks so there are many."""
    common = ["--tokenizer", str(corpus.tokenizer), "--append-eod", "--skip-bad-lines",
              "--chunk-bytes", "4096", "--input", *corpus.inputs]
    one = str(corpus.root / "one")
    code, out, err = _in_process(*common, "--output-prefix", one, "--workers", "1")
    assert code == 0, err
    two = str(corpus.root / "two")
    for ext in (".bin", ".idx"):
        Path(two + "_text_document" + ext).write_bytes(b"an older output")
    # Python warns (on stderr, checked below) when a process with threads forks: the command
    # forks its workers before it has any.
    run = _cli(*common, "--output-prefix", two, "--workers", "2", "--overwrite",
               "--log-interval", "0.001",
               python_flags=["-W", "always:This process:DeprecationWarning"])
    assert run.returncode == 0, run.stderr[-3000:]
    return {"one": one, "one_out": out, "two": two, "two_run": run}


def _tool_method(texts: list, tokenizer, prefix: str) -> None:
    """The dataset Megatron-LM's tools/preprocess_data.py writes for `texts` with --append-eod,
    its method written here from its documented behaviour: one document per record; a text is
    one sequence, a list one per element; each tokenized by megatron's tokenizer as training
    loads it; a sequence of no token left out; EOD appended to the last sequence of a document
    that has one; megatron-core's IndexedDatasetBuilder (uint16 for this vocabulary)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for text in texts:
        ids, lengths = [], []
        for sentence in text if isinstance(text, list) else [text]:
            if sentence_ids := tokenizer.tokenize(sentence):
                ids += sentence_ids
                lengths.append(len(sentence_ids))
        if ids:
            ids.append(tokenizer.eod)
            lengths[-1] += 1
        builder.add_document(ids, lengths)
    builder.finalize(prefix + ".idx")


def test_the_tools_method_writes_the_same_bytes(corpus, prepared, tmp_path):
    """Byte for byte what Megatron-LM's tool method writes for the same records, empty, list-
    valued, unicode and special-token ones included; the tokens are also those of the bare
    tokenizers library on the same tokenizer.json."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.tokenizers import MegatronTokenizer
    from tokenizers import Tokenizer

    # The tokenizer as a training run's --tokenizer-type HuggingFaceTokenizer loads it.
    megatron = MegatronTokenizer.from_pretrained(tokenizer_path=str(corpus.tokenizer),
                                                 metadata_path={"library": "huggingface"})
    bare = Tokenizer.from_file(str(corpus.tokenizer / "tokenizer.json"))
    eod, bos = bare.token_to_id(EOS), bare.token_to_id(BOS)
    assert megatron.eod == eod
    _tool_method(corpus.texts, megatron, str(tmp_path / "tool"))
    for ext in (".bin", ".idx"):
        assert Path(prepared["one"] + "_text_document" + ext).read_bytes() == \
            (tmp_path / ("tool" + ext)).read_bytes(), ext

    dataset = IndexedDataset(prepared["one"] + "_text_document")
    assert dataset.index.dtype == numpy.uint16  # megatron's choice for a 600-token vocabulary
    assert len(dataset.document_indices) == len(corpus.texts) + 1
    for i, text in enumerate(corpus.texts):
        first, last = dataset.document_indices[i], dataset.document_indices[i + 1]
        got = [dataset[j].tolist() for j in range(first, last)]
        expected = [bare.encode(t).ids for t in (text if isinstance(text, list) else [text])]
        expected = [ids for ids in expected if ids]
        if expected:
            expected[-1] = expected[-1] + [eod]
        assert got == expected, f"document {i}: {text!r}"
    assert [dataset[dataset.document_indices[corpus.texts.index("")]].tolist()] == [[bos, eod]]
    assert [] in corpus.texts  # a document of no sequence: two equal document indices
    tokens = sum(len(dataset[i]) for i in range(len(dataset)))
    assert (f"prepare_data: done: {len(corpus.texts)} documents, {tokens} tokens, {SKIPPED}"
            in prepared["one_out"])
    # the ASCII documents took the piece cache (moe_launcher/prepare_data/piece_cache.py)
    fast = re.search(r"; (\d+) documents by the piece cache, 0 mismatches", prepared["one_out"])
    assert fast and int(fast.group(1)) > 10, prepared["one_out"]  # (most hold a unicode word)


def test_a_metaspace_tokenizer_writes_the_tools_bytes_through_the_piece_cache(corpus, tmp_path):
    from megatron.core.tokenizers import MegatronTokenizer

    _build_tokenizer(tmp_path / "metaspace", metaspace=True)
    code, out, err = _in_process("--tokenizer", str(tmp_path / "metaspace"), "--append-eod",
                                 "--skip-bad-lines", "--input", *corpus.inputs,
                                 "--output-prefix", str(tmp_path / "ours"), "--workers", "1")
    assert code == 0, err
    fast = re.search(r"; (\d+) documents by the piece cache, 0 mismatches", out)
    assert fast and int(fast.group(1)) > 10, out
    megatron = MegatronTokenizer.from_pretrained(tokenizer_path=str(tmp_path / "metaspace"),
                                                 metadata_path={"library": "huggingface"})
    _tool_method(corpus.texts, megatron, str(tmp_path / "tool"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours_text_document{ext}").read_bytes() == \
            (tmp_path / f"tool{ext}").read_bytes(), ext


def test_split_sentences_is_refused(corpus, tmp_path):
    code, out, err = _in_process("--input", *corpus.inputs, "--tokenizer", str(corpus.tokenizer),
                                 "--output-prefix", str(tmp_path / "out"), "--split-sentences")
    assert (code, out) == (2, "") and len(err.splitlines()) == 1, err
    assert err.startswith("prepare_data: error: --split-sentences") and "fix:" in err, err
    assert os.listdir(tmp_path) == []


def test_one_and_two_workers_write_the_same_bytes(prepared):
    for ext in (".bin", ".idx"):
        one = Path(prepared["one"] + "_text_document" + ext).read_bytes()
        assert Path(prepared["two"] + "_text_document" + ext).read_bytes() == one
    assert _files(prepared["two"]) == ["two_text_document.bin", "two_text_document.idx",
                                       "two_text_document.prepare_data.json"]
    run = prepared["two_run"]
    assert SKIPPED in run.stdout
    progress = [line for line in run.stderr.splitlines() if line.startswith("prepare_data: ")]
    assert progress and all("docs/s" in line and "tokens/s" in line and "ETA" in line
                            for line in progress), run.stderr[-3000:]
    # Importing megatron on CPU warns; a run says only what it has to.
    assert len(progress) == len(run.stderr.splitlines()), run.stderr[-3000:]


def test_rerun_over_a_complete_output_refuses(corpus, prepared):
    before = Path(prepared["one"] + "_text_document.bin").read_bytes()
    run = _cli("--input", *corpus.inputs, "--tokenizer", str(corpus.tokenizer),
               "--output-prefix", prepared["one"])
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        f"prepare_data: error: {prepared['one']}_text_document.bin already exists "
        "(--overwrite replaces it)"]
    assert Path(prepared["one"] + "_text_document.bin").read_bytes() == before


@pytest.mark.parametrize("case", ["missing input", "no glob match", "directory input",
                                  "unknown format", "missing tokenizer", "hub id tokenizer",
                                  "no output folder"])
def test_refusals_before_reading(corpus, case, tmp_path):
    """Checked before megatron is even imported: one line, exit 2, nothing written."""
    inputs, tokenizer, prefix = corpus.inputs, str(corpus.tokenizer), str(tmp_path / "out")
    expected = {
        "missing input": f"input file {tmp_path}/gone.jsonl does not exist",
        "no glob match": f"no file matches --input {tmp_path}/*.jsonl",
        "directory input": f"input {tmp_path} is not a file",
        "unknown format": f"input {tmp_path}/notes.txt: unknown format (expected .jsonl, "
                          ".jsonl.gz or .parquet)",
        "missing tokenizer": f"tokenizer folder {tmp_path}/no-tokenizer does not exist",
        "hub id tokenizer": "Qwen/Qwen3-30B-A3B is a Hugging Face hub id, not a local folder: "
                            "every process that loads it would download it; fix: `hf download "
                            "Qwen/Qwen3-30B-A3B --include 'tokenizer*' --local-dir DIR` and "
                            "pass --tokenizer DIR",
        "no output folder": f"output directory {tmp_path}/nowhere does not exist",
    }[case]
    if case == "missing input":
        inputs = [*inputs, str(tmp_path / "gone.jsonl")]
    elif case == "no glob match":
        inputs = [str(tmp_path / "*.jsonl")]
    elif case == "directory input":
        inputs = [str(tmp_path)]
    elif case == "unknown format":
        (tmp_path / "notes.txt").write_text("{}\n")
        inputs = [str(tmp_path / "notes.txt")]
    elif case == "missing tokenizer":
        tokenizer = str(tmp_path / "no-tokenizer")
    elif case == "hub id tokenizer":
        tokenizer = "Qwen/Qwen3-30B-A3B"
    else:
        prefix = str(tmp_path / "nowhere" / "out")
    before = sorted(os.listdir(tmp_path))
    run = _cli("--input", *inputs, "--tokenizer", tokenizer, "--output-prefix", prefix)
    assert (run.returncode, run.stdout, run.stderr) == (2, "", f"prepare_data: error: {expected}\n")
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("case", ["malformed line", "damaged gzip", "nothing to write",
                                  "broken tokenizer"])
def test_refusals_while_reading(corpus, case, tmp_path):
    """Found once megatron is loaded or tokenizing has begun: the partial output goes too."""
    inputs, tokenizer = corpus.inputs, str(corpus.tokenizer)
    if case == "broken tokenizer":
        (tmp_path / "tokenizer").mkdir()
        (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
        tokenizer = str(tmp_path / "tokenizer")
    elif case == "damaged gzip":
        whole = (corpus.root / "part-0.jsonl.gz").read_bytes()
        (tmp_path / "damaged.jsonl.gz").write_bytes(whole[:len(whole) // 2])
        inputs = [str(tmp_path / "damaged.jsonl.gz")]
    elif case == "nothing to write":
        (tmp_path / "empty.jsonl").write_text('   \n{"title": "x"}\n')
        inputs = [str(tmp_path / "empty.jsonl")]
    prefix = str(tmp_path / "out")
    code, out, err = _in_process("--input", *inputs, "--tokenizer", tokenizer,
                                 "--output-prefix", prefix, "--workers", "2",
                                 "--chunk-bytes", "4096")
    expected = {
        "malformed line": f"{corpus.bad_line}: malformed JSON line: Unterminated string "
                          "starting at (column 10); --skip-bad-lines skips such lines",
        "damaged gzip": f"cannot read input {tmp_path}/damaged.jsonl.gz: Compressed file "
                        "ended before the end-of-stream marker was reached",
        "nothing to write": "no document to write (0 documents, 0 tokens, 2 skipped (empty: 1, "
                            "missing key: 1)",
        "broken tokenizer": f"cannot load the tokenizer in {tokenizer}: ",
    }[case]
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"prepare_data: error: {expected}"), err
    assert _files(prefix) == []


def _tokenizer_of_its_own_code(corpus: Corpus, folder: Path, replace: bool = False) -> Path:
    """The corpus's tokenizer as a folder whose tokenizer_config.json loads it through a class
    of the folder's own code (auto_map), as tiktoken tokenizers (Moonlight's, Kimi's) are
    published: transformers runs that code only with trust_remote_code."""
    import shutil

    shutil.copytree(corpus.tokenizer, folder, dirs_exist_ok=replace)
    (folder / "tokenization_wrapped.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class WrappedTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="WrappedTokenizer",
                  auto_map={"AutoTokenizer": [None, "tokenization_wrapped.WrappedTokenizer"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


# A tiktoken tokenizer published as code of its folder's own, shaped as Moonlight's and Kimi's
# (tokenization_moonshot.TikTokenTokenizer: tiktoken ranks in tiktoken.model, a python
# tokenizer whose tokens are the byte-level strings of tiktoken's ids), written here.
_TIKTOKEN_CODE = r"""
import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.tokenization_utils import PreTrainedTokenizer

PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", **kwargs):
        ranks = load_tiktoken_bpe(vocab_file)
        special = {"[BOS]": len(ranks), "[EOS]": len(ranks) + 1}
        self.model = tiktoken.Encoding(name="test", pat_str=PATTERN, mergeable_ranks=ranks,
                                       special_tokens=special)
        byte_encoder = bytes_to_unicode()
        self.decoder = {i: "".join(byte_encoder[b] for b in self.model.decode_single_token_bytes(i))
                        for i in range(len(ranks))}
        self.decoder.update({i: token for token, i in special.items()})
        self.encoder = {token: i for i, token in self.decoder.items()}
        self.byte_decoder = {v: k for k, v in byte_encoder.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, **kwargs)

    @property
    def vocab_size(self):
        return len(self.decoder)

    def get_vocab(self):
        return dict(self.encoder)

    def _tokenize(self, text, **kwargs):
        return [self.decoder[i] for i in self.model.encode(text, disallowed_special=())]

    def _convert_token_to_id(self, token):
        return self.encoder[token]

    def _convert_id_to_token(self, index):
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens):
        return bytes(self.byte_decoder[c] for c in "".join(tokens)).decode("utf-8", "replace")
"""


def _tiktoken_ranks(texts: list[str], merges: int) -> dict[bytes, int]:
    """Byte-pair ranks learnt here from `texts`: the 256 bytes, then `merges` merges, each of the
    most frequent adjacent pair of the texts' words as the merges so far split them."""
    import collections

    ranks = {bytes([b]): b for b in range(256)}
    words = collections.Counter(word.encode() for text in texts for word in re.findall(r" ?\S+", text))
    pieces = {word: [bytes([b]) for b in word] for word in words}
    for _ in range(merges):
        pairs = collections.Counter()
        for word, split in pieces.items():
            for pair in zip(split, split[1:]):
                pairs[pair] += words[word]
        if not pairs:
            break
        best = max(pairs, key=lambda pair: (pairs[pair], pair))
        ranks[best[0] + best[1]] = len(ranks)
        for word, split in pieces.items():
            merged, i = [], 0
            while i < len(split):
                if split[i:i + 2] == list(best):
                    merged.append(best[0] + best[1])
                    i += 2
                else:
                    merged.append(split[i])
                    i += 1
            pieces[word] = merged
    return ranks


def test_a_tiktoken_tokenizer_of_its_own_code_gives_tiktokens_ids(tmp_path):
    """Moonlight's and Kimi's tokenizers are tiktoken behind code of their own: tiktoken is in
    the lock (and the image), and prepare_data --trust-remote-code writes, for each document,
    the ids tiktoken's own Encoding gives its text (special tokens' text included, as
    Moonlight's encode() allows them), then the tokenizer's EOS (read back with megatron's
    IndexedDataset)."""
    import base64

    import tiktoken
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    texts = ["The cat's hat sat on the mat, and the rat ran.",
             "Numbers 12345 and 6 7 89 in   spaced    runs\n\nwith lines.",
             "Ünïcödé, 中文 and 🙂 fall back to bytes the merges never saw.",
             "[EOS] written in a document is the EOS token's id."]
    folder = tmp_path / "tiktoken_tokenizer"
    folder.mkdir()
    ranks = _tiktoken_ranks(texts * 3, merges=120)
    (folder / "tiktoken.model").write_text("".join(
        f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()))
    (folder / "tokenization_tiktoken_test.py").write_text(_TIKTOKEN_CODE)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]",
        "auto_map": {"AutoTokenizer": ["tokenization_tiktoken_test.TikTokenTokenizer", None]}}))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prefix = str(tmp_path / "data")
    code, _, err = _in_process("--input", str(tmp_path / "docs.jsonl"), "--tokenizer",
                               str(folder), "--output-prefix", prefix, "--append-eod",
                               "--workers", "1", "--trust-remote-code")
    assert code == 0, err

    namespace: dict = {}
    exec(compile(_TIKTOKEN_CODE, "tokenization_tiktoken_test.py", "exec"), namespace)
    eos = len(ranks) + 1
    reference = tiktoken.Encoding(name="reference", pat_str=namespace["PATTERN"],
                                  mergeable_ranks=ranks,
                                  special_tokens={"[BOS]": eos - 1, "[EOS]": eos})
    dataset = IndexedDataset(prefix + "_text_document")
    got = [dataset[i].tolist() for i in range(len(dataset))]
    assert got == [reference.encode(text, allowed_special="all") + [eos] for text in texts]
    assert got[3][0] == eos  # a special token's text is its id, as megatron's tokenize() gives

    # Code written for transformers 4 (Moonshot's tokenizers until they moved the import): one
    # line naming what transformers 5 no longer has, nothing written.
    (folder / "tokenization_tiktoken_test.py").write_text(_TIKTOKEN_CODE.replace(
        "transformers.convert_slow_tokenizer", "transformers.models.gpt2.tokenization_gpt2"))
    code, out, err = _in_process("--input", str(tmp_path / "docs.jsonl"), "--tokenizer",
                                 str(folder), "--output-prefix", str(tmp_path / "old"),
                                 "--workers", "1", "--trust-remote-code")
    assert (code, out) == (2, "") and len(err.splitlines()) == 1, err
    assert err.startswith(f"prepare_data: error: cannot load the tokenizer in {folder}: ") and \
        "cannot import name 'bytes_to_unicode'" in err, err
    assert _files(str(tmp_path / "old")) == []
    assert any(len(reference.decode_single_token_bytes(i)) > 2 for i in got[0])  # merges applied


def test_a_tokenizer_of_its_own_code_runs_with_trust_remote_code(corpus, prepared, tmp_path):
    """A tokenizer that is code of its folder's own: without --trust-remote-code prepare_data
    refuses in one line naming the flag, and so does a run (megatron's flag), every rank before
    any work; with it prepare_data writes what the same tokenizer without the code writes
    (the corpus's 1-worker output, the reference), and the run trains on it, its record
    matching the run's tokenizer."""
    folder = _tokenizer_of_its_own_code(corpus, tmp_path / "own_code")
    common = ["--tokenizer", str(folder), "--append-eod", "--skip-bad-lines", "--chunk-bytes",
              "4096", "--workers", "1", "--input", *corpus.inputs]
    prefix = str(tmp_path / "data")
    code, out, err = _in_process(*common, "--output-prefix", prefix)
    assert (code, out) == (2, "") and len(err.splitlines()) == 1, err
    assert err.startswith(f"prepare_data: error: the tokenizer in {folder} is code of the "
                          "folder's own (tokenization_wrapped.WrappedTokenizer), which runs only "
                          "when asked; fix: pass --trust-remote-code"), err
    assert _files(prefix) == []
    # code that imports what is not installed (Moonlight's imports tiktoken): transformers'
    # own words, in one line
    (folder / "tokenization_wrapped.py").write_text(
        "import tiktoken_not_installed\n" + (folder / "tokenization_wrapped.py").read_text())
    code, _, err = _in_process(*common, "--output-prefix", prefix, "--trust-remote-code")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"prepare_data: error: cannot load the tokenizer in {folder}: "), err
    assert "tiktoken_not_installed" in err and _files(prefix) == []
    _tokenizer_of_its_own_code(corpus, folder, replace=True)
    code, _, err = _in_process(*common, "--output-prefix", prefix, "--trust-remote-code")
    assert code == 0, err
    for ext in (".bin", ".idx"):
        assert (Path(prefix + "_text_document" + ext).read_bytes()
                == Path(prepared["one"] + "_text_document" + ext).read_bytes())

    model = _without(TINY_MODEL, {"--mock-data"}, {"--tokenizer-type", "--vocab-size"})
    data = [*model, "--data-path", prefix + "_text_document", "--split", "98,2,0",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(folder),
            "--data-cache-path", str(tmp_path / "cache"), "--train-iters", "2",
            "--tensorboard-dir", str(tmp_path / "tb")]
    refused = launch(2, data)
    errors = [line for line in refused.log.splitlines() if "pretrain_moe: error:" in line]
    assert refused.exit_codes == [2, 2] and len(errors) == 1, refused.log[-3000:]
    assert (f"--tokenizer-model {folder}: the tokenizer is code of the folder's own "
            "(tokenization_wrapped.WrappedTokenizer), which megatron runs only with "
            "--trust-remote-code; fix: pass --trust-remote-code") in errors[0], errors[0]
    assert "Traceback" not in refused.log and not (tmp_path / "cache").exists()
    run = launch(2, [*data, "--trust-remote-code"])
    run.check()
    assert sorted(tensorboard_scalars(tmp_path / "tb", "lm loss")) == [1, 2]
    assert "prepare_data record" not in run.log  # its record names this tokenizer


def test_several_keys_keep_records_aligned(corpus, tmp_path):
    """One dataset per key; a record missing one key is left out of all of them."""
    from tokenizers import Tokenizer

    records = [{"title": "a title", "text": "its text"}, {"text": "no title"},
               {"title": "second", "text": "more text here"}]
    (tmp_path / "keys.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    prefix = str(tmp_path / "keys")
    code, out, err = _in_process("--input", str(tmp_path / "keys.jsonl"), "--tokenizer",
                                 str(corpus.tokenizer), "--output-prefix", prefix,
                                 "--json-keys", "text", "title")
    assert code == 0, err
    assert "2 documents" in out and "1 skipped (missing key: 1)" in out
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    bare = Tokenizer.from_file(str(corpus.tokenizer / "tokenizer.json"))
    for key in ("text", "title"):
        dataset = IndexedDataset(f"{prefix}_{key}_document")
        assert [dataset[i].tolist() for i in range(len(dataset))] == [
            bare.encode(records[i][key]).ids for i in (0, 2)]


def test_killed_run_leaves_no_complete_output(corpus, tmp_path):
    """SIGKILL mid-run (as the OOM killer would): only partial files remain, the workers die
    with the run, and the next run replaces the partial files without being told to."""
    rng = random.Random(2)
    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        for _ in range(30000):
            f.write(json.dumps({"text": _text(rng, 60)}) + "\n")
    prefix = str(tmp_path / "killed")
    partial = Path(prefix + "_text_document.bin.partial")
    # stderr on a terminal (of a terminal's size; a new pty has none): the tqdm bar.
    terminal, terminal_end = pty.openpty()
    fcntl.ioctl(terminal_end, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_launcher.prepare_data", "--input", str(big), "--tokenizer",
         str(corpus.tokenizer), "--output-prefix", prefix, "--workers", "2",
         "--chunk-bytes", "65536"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
        stderr=terminal_end, start_new_session=True)
    os.close(terminal_end)
    shown = []
    reader = threading.Thread(target=lambda: _drain(terminal, shown), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        # tqdm redraws at most every 0.1 s: wait for a drawn rate as well as for written output.
        while not (partial.exists() and partial.stat().st_size > 200_000
                   and b"tokens/s" in b"".join(shown)):
            assert proc.poll() is None and time.monotonic() < deadline, b"".join(shown)[-2000:]
            time.sleep(0.05)
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, "workers outlived the killed run"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    reader.join(10)
    assert _files(prefix) == ["killed_text_document.bin.partial"]
    bar = b"".join(shown).decode(errors="replace")
    assert "docs/s" in bar and "tokens/s" in bar and "<" in bar, bar[-2000:]  # ETA: elapsed<left

    code, out, err = _in_process("--input", corpus.inputs[0], "--tokenizer",
                                 str(corpus.tokenizer), "--output-prefix", prefix,
                                 "--skip-bad-lines")
    assert code == 0, err
    assert _files(prefix) == ["killed_text_document.bin", "killed_text_document.idx",
                              "killed_text_document.prepare_data.json"]


def _drain(fd: int, into: list[bytes]) -> None:
    with contextlib.suppress(OSError):  # EIO once the terminal's other end is closed
        while chunk := os.read(fd, 65536):
            into.append(chunk)
    os.close(fd)


def _without(args: list[str], flags: set[str], valued: set[str]) -> list[str]:
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in valued:
            skip = True
        elif arg not in flags:
            kept.append(arg)
    return kept


def test_trains_on_the_prepared_data(corpus, prepared, tmp_path):
    """The output, named as train.sh names it (DATA_PATH, TOKENIZER_MODEL, no --vocab-size),
    trains 2 ranks; the model's vocabulary is the tokenizer's, padded as megatron pads it."""
    from tokenizers import Tokenizer

    model = _without(TINY_MODEL, {"--mock-data"}, {"--tokenizer-type", "--vocab-size"})
    run = launch(2, [*model, "--data-path", prepared["one"] + "_text_document",
                     "--tokenizer-type", "HuggingFaceTokenizer",
                     "--tokenizer-model", str(corpus.tokenizer), "--split", "98,2,0",
                     "--data-cache-path", str(tmp_path / "cache"),
                     "--expert-model-parallel-size", "2", "--train-iters", "3",
                     "--tensorboard-dir", str(tmp_path / "tb")])
    run.check()
    assert sorted(tensorboard_scalars(tmp_path / "tb", "lm loss")) == [1, 2, 3]
    assert "prepare_data record" not in run.log  # its record names this tokenizer
    vocab = Tokenizer.from_file(str(corpus.tokenizer / "tokenizer.json")).get_vocab_size()
    padded = -(-vocab // 128) * 128  # --make-vocab-size-divisible-by 128 at TP 1
    assert (f"padded vocab (size: {vocab}) with {padded - vocab} dummy tokens (new size: "
            f"{padded})") in run.log, run.log[-3000:]


def test_the_record_names_the_tokenizer_and_the_largest_id(corpus, prepared):
    """Beside each dataset, what made it. References: the tokenizer loaded again (its
    identity), megatron's IndexedDataset reading the .bin back (the largest id)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from moe_launcher import dataset_record
    from moe_launcher.prepare_data.tokenizer import load_tokenizer

    prefix = prepared["two"] + "_text_document"
    record = json.loads(Path(prefix + dataset_record.SUFFIX).read_text())
    assert record["tokenizer"] == dataset_record.tokenizer_identity(
        load_tokenizer(str(corpus.tokenizer)), "HuggingFaceTokenizer", str(corpus.tokenizer))
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(corpus.tokenizer / "tokenizer.json")).get_vocab_size()
    assert record["tokenizer"]["vocab_size"] == vocab and len(record["tokenizer"]["sha256"]) == 64
    assert record["append_eod"] is True and record["json_key"] == "text"
    assert record["inputs"] and all(os.path.isabs(p) for p in record["inputs"])
    data = IndexedDataset(prefix)
    assert record["largest_token_id"] == max(int(data[i].max()) for i in range(len(data)))
    # the 1-worker output of the same corpus records the same
    one = json.loads(Path(prepared["one"] + "_text_document" + dataset_record.SUFFIX).read_text())
    assert one == record | {"inputs": one["inputs"]}


def test_training_with_another_tokenizer_is_refused_before_any_work(corpus, prepared, tmp_path):
    """The data's tokenizer is a BPE of a few hundred tokens; a run with --tokenizer-type
    NullTokenizer --vocab-size 1000 has rows for every id, so only the record can tell (before,
    it trained without a word)."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(corpus.tokenizer / "tokenizer.json")).get_vocab_size()
    model = _without(TINY_MODEL, {"--mock-data"}, {"--vocab-size"})
    prefix = prepared["one"] + "_text_document"
    run = launch(2, [*model, "--vocab-size", "1000", "--data-path", prefix, "--split", "98,2,0",
                     "--data-cache-path", str(tmp_path / "cache"), "--train-iters", "3"])
    errors = [line for line in run.log.splitlines() if "pretrain_moe: error:" in line]
    assert run.exit_codes == [1, 1] and len(errors) == 1, run.log[-3000:]
    assert (f"--data-path {prefix} was tokenized by prepare_data with HuggingFaceTokenizer in "
            f"{corpus.tokenizer} (vocabulary {vocab}, sha256 " in errors[0]), errors[0]
    assert "but this run's tokenizer is NullTokenizer (vocabulary 1000)" in errors[0]
    assert "MOE_LAUNCHER_DATA_OTHER_TOKENIZER_OK=1" in errors[0]
    assert "Traceback" not in run.log and "lm loss" not in run.log
    assert not (tmp_path / "cache").exists()  # refused before megatron built a dataset



def test_records_judged_against_the_run(corpus, prepared, tmp_path):
    """dataset_record.judge on the prepared dataset with the data's own tokenizer: rows for every
    id pass; a vocabulary that ends at the largest id is refused naming it; the opt-in goes on,
    saying so; a damaged record is refused naming the file."""
    import shutil

    from moe_launcher import dataset_record
    from moe_launcher.prepare_data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(corpus.tokenizer))
    prefix = prepared["one"] + "_text_document"
    largest = json.loads(Path(prefix + dataset_record.SUFFIX).read_text())["largest_token_id"]
    datasets = [("--data-path", prefix)]
    judge = functools.partial(dataset_record.judge, datasets, tokenizer, "HuggingFaceTokenizer")
    assert judge(largest + 1, environ={}) == (None, None)
    refusal, _ = judge(largest, environ={})
    assert f"--data-path {prefix} holds token id {largest}" in refusal, refusal
    assert f"past the model's {largest} embedding rows" in refusal, refusal
    refusal, note = judge(largest, environ={dataset_record.OTHER_TOKENIZER_ENV: "1"})
    assert refusal is None and note.endswith(f"as {dataset_record.OTHER_TOKENIZER_ENV}=1 asks")
    damaged = str(tmp_path / "damaged_text_document")
    for ext in (".bin", ".idx"):
        shutil.copyfile(prefix + ext, damaged + ext)
    Path(damaged + dataset_record.SUFFIX).write_text("{not json")
    refusal, _ = dataset_record.judge([("--data-path", damaged)], tokenizer,
                                      "HuggingFaceTokenizer", largest + 1, environ={})
    assert f"{damaged}{dataset_record.SUFFIX} cannot be read" in refusal, refusal


def test_vocab_size_sizes_the_model_for_a_hugging_face_tokenizer(corpus, prepared, monkeypatch,
                                                                 capsys):
    """An imported model's rows (--vocab-size, as import-hf's model_flags.txt has it) with its
    own tokenizer: the model gets --vocab-size's rows, padded, where megatron sizes it from the
    tokenizer and ignores the flag (issue 40 item 3); one below the tokenizer's size is refused
    before any work, naming both."""
    import argparse

    from _judge import judge
    from moe_launcher.megatron_validation import _model_rows_from_vocab_size
    from moe_launcher.prepare_data.tokenizer import load_tokenizer
    from tokenizers import Tokenizer

    tokens = Tokenizer.from_file(str(corpus.tokenizer / "tokenizer.json")).get_vocab_size()
    args = argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", vocab_size=1000,
                              tokenizer_model=str(corpus.tokenizer), padded_vocab_size=384,
                              make_vocab_size_divisible_by=128, tensor_model_parallel_size=1,
                              rank=0)
    monkeypatch.setenv("RANK", "0")
    _model_rows_from_vocab_size(args, load_tokenizer(str(corpus.tokenizer)))
    assert args.padded_vocab_size == 1024  # 1000, padded to a multiple of 128
    assert (f"--vocab-size 1000 (1024 rows, padded) for the tokenizer's {tokens} tokens "
            f"(megatron alone would give the model 384)") in capsys.readouterr().out

    model = _without(TINY_MODEL, {"--mock-data"}, {"--tokenizer-type", "--vocab-size"})
    argv = [*model, "--data-path", prepared["one"] + "_text_document",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(corpus.tokenizer),
            "--train-iters", "2"]
    assert judge(1, [*argv, "--vocab-size", str(tokens)], monkeypatch) is None
    line = judge(1, [*argv, "--vocab-size", str(tokens - 1)], monkeypatch)
    assert line == (f"pretrain_moe: error: --vocab-size {tokens - 1} is below the {tokens} "
                    f"tokens of --tokenizer-model {corpus.tokenizer}: its ids from {tokens - 1} "
                    f"up would have no embedding row; fix: drop --vocab-size (the tokenizer's "
                    f"size, padded) or pass at least {tokens}"), line
