"""What made an indexed dataset: prepare_data's record beside its .bin/.idx (issue 46).

A dataset's .bin/.idx hold token ids and nothing of the tokenizer that made them: data made with
one tokenizer trains with another without a word, and ids past the model's vocabulary surface
only when a batch reaches the embedding. `python -m moe_launcher.prepare_data` therefore writes
`<prefix>.prepare_data.json` beside each dataset it makes (the .bin/.idx stay byte-identical to
megatron's tool): the tokenizer's identity (a hash of its vocabulary, merges and added tokens,
its size, its end-of-document id), --append-eod, the inputs and the largest token id written.

Before the datasets are built, a run compares every record with the tokenizer megatron built
for it and the model's vocabulary: another tokenizer, or a largest id the embedding has no row
for, is refused in one line naming both (OTHER_TOKENIZER_ENV=1 lets a user who means it go on).
Datasets without a record (made by megatron's own tool) train as before, said in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

from moe_launcher.runtime.durable_files import fsync_path

SUFFIX = ".prepare_data.json"
OTHER_TOKENIZER_ENV = "MOE_LAUNCHER_DATA_OTHER_TOKENIZER_OK"


def record_path(prefix: str) -> str:
    return prefix + SUFFIX


def _transformers_tokenizer(tokenizer):
    """The transformers tokenizer inside megatron's wrappers (MegatronTokenizer ->
    HuggingFaceTokenizer -> AutoTokenizer's); None for tokenizers without one."""
    for _ in range(4):
        if tokenizer is None or any(cls.__name__ == "PreTrainedTokenizerBase"
                                    for cls in type(tokenizer).__mro__):
            return tokenizer
        tokenizer = getattr(tokenizer, "_tokenizer", None) or getattr(tokenizer, "tokenizer", None)
    return None


def tokenizer_identity(tokenizer, kind: str, source: str | None = None) -> dict:
    """What identifies megatron tokenizer `tokenizer` of --tokenizer-type `kind`: the type, its
    size, end-of-document id and, for a Hugging Face tokenizer, a SHA-256 of its vocabulary
    (with added tokens, by id) and its BPE merges."""
    hf = _transformers_tokenizer(tokenizer)
    identity = {"type": kind, "vocab_size": int(tokenizer.vocab_size),
                "eod": getattr(tokenizer, "eod", None)}
    if source:
        identity["source"] = os.path.abspath(source)
    if hf is not None:
        digest = hashlib.sha256()
        vocabulary = sorted(hf.get_vocab().items(), key=lambda item: item[1])
        digest.update(json.dumps(vocabulary, ensure_ascii=False).encode())
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is not None:
            merges = json.loads(backend.to_str()).get("model", {}).get("merges")
            digest.update(json.dumps(merges, ensure_ascii=False).encode())
        identity["sha256"] = digest.hexdigest()
        identity["special_tokens"] = list(hf.all_special_tokens)
    return identity


def write(prefix: str, record: dict) -> None:
    """Writes `prefix`'s record durably, replacing an older one in one rename."""
    folder = os.path.dirname(prefix) or "."
    handle, temporary = tempfile.mkstemp(prefix=os.path.basename(prefix) + ".", dir=folder)
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(record, file, indent=1, ensure_ascii=False)
        fsync_path(temporary)
        os.replace(temporary, record_path(prefix))
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def read(prefix: str) -> dict | None:
    """`prefix`'s record; None where it has none. An unreadable one raises ValueError."""
    try:
        with open(record_path(prefix)) as file:
            return json.load(file)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{record_path(prefix)} cannot be read: {error}") from None


def _describe(identity: dict) -> str:
    where = f" in {identity['source']}" if identity.get("source") else ""
    digest = f", sha256 {identity['sha256'][:12]}" if identity.get("sha256") else ""
    return f"{identity['type']}{where} (vocabulary {identity['vocab_size']}{digest})"


def judge(datasets: list[tuple[str, str]], tokenizer, kind: str, model_rows: int,
          environ=os.environ) -> tuple[str | None, str | None]:
    """(the refusal, the note) for the (flag, prefix) datasets a run reads with megatron
    tokenizer `tokenizer` (--tokenizer-type `kind`) and `model_rows` embedding rows: the
    refusal where a record names
    another tokenizer or a largest id past the rows (None when none does, or the user opted in;
    the note then says so), the note for datasets without a record."""
    run = tokenizer_identity(tokenizer, kind)
    unrecorded, problems = [], []
    for flag, prefix in datasets:
        try:
            record = read(prefix)
        except ValueError as error:
            return f"{flag} {prefix}: {error}; fix: make the dataset again with prepare_data, " \
                   f"or remove the record to train unchecked", None
        if record is None:
            unrecorded.append(prefix)
            continue
        made = record.get("tokenizer", {})
        if made.get("sha256") is None or made.get("sha256") != run.get("sha256"):
            problems.append(
                f"{flag} {prefix} was tokenized by prepare_data with {_describe(made)}, but this "
                f"run's tokenizer is {_describe(run)}; fix: train with the tokenizer the data was "
                f"made with (--tokenizer-type HuggingFaceTokenizer --tokenizer-model "
                f"{made.get('source', 'DIR')}), or make the data again with this one")
        elif (largest := record.get("largest_token_id", -1)) >= model_rows:
            problems.append(
                f"{flag} {prefix} holds token id {largest} (prepare_data's record), past the "
                f"model's {model_rows} embedding rows; fix: a --vocab-size of at least "
                f"{largest + 1}, or the tokenizer's own size (no --vocab-size)")
    note = (f"{len(unrecorded)} dataset(s) have no prepare_data record (made by megatron's own "
            f"tool?), e.g. {unrecorded[0]}: the tokenizer that made them is not checked; token "
            f"ids past the vocabulary still stop the run at the batch that holds them"
            if unrecorded else None)
    if not problems:
        return None, note
    refusal = problems[0] + (f" (and {len(problems) - 1} more dataset(s))"
                             if len(problems) > 1 else "")
    if environ.get(OTHER_TOKENIZER_ENV) == "1":
        return None, f"{refusal}; going on, as {OTHER_TOKENIZER_ENV}=1 asks"
    return f"{refusal}; or set {OTHER_TOKENIZER_ENV}=1 to train on it anyway", note
