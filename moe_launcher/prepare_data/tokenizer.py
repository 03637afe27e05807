"""The tokenizer, loaded exactly as a training run loads it.

A run with `--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR` gets its tokenizer from
megatron's build_tokenizer with the flags' defaults; the same call here means the same special
tokens, the same end-of-document id and the same vocabulary size (hence the same .bin dtype)."""

from __future__ import annotations

import logging
import os
import types
import warnings

from .errors import PrepareError

# What megatron's argument parser gives the tokenizer flags a run does not set.
_TRAINING_DEFAULTS = dict(
    tokenizer_type="HuggingFaceTokenizer", chat_template=None, vocab_file=None, merge_file=None,
    special_tokens=None, tokenizer_hf_no_use_fast=False, trust_remote_code=False,
    tokenizer_hf_no_include_special_tokens=False, metadata_path=None, pad_vocab_size=False,
)


def check_tokenizer_folder(path: str) -> None:
    """A folder with a tokenizer in it. Checked first: transformers would take any other path
    for a hub model id and try to download it."""
    if not os.path.isdir(path):
        raise PrepareError(f"tokenizer folder {path} does not exist")
    if not any(os.path.exists(os.path.join(path, name))
               for name in ("tokenizer.json", "tokenizer_config.json")):
        raise PrepareError(f"tokenizer folder {path} has neither tokenizer.json nor "
                           "tokenizer_config.json")


def load_tokenizer(path: str):
    """megatron's tokenizer for `path` (its .tokenize(text) is what training would see)."""
    # A local folder only: never reach for a hub.
    os.environ["HF_HUB_OFFLINE"] = "1"
    # Importing megatron on a machine without CUDA, Transformer Engine or Apex warns about each;
    # none of them matters for tokenizing, and a refusal is to stay one line.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import transformers
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    # Documents longer than the model's context are normal in pretraining data; transformers'
    # per-call warning about them says nothing here.
    transformers.logging.set_verbosity_error()
    try:
        return build_tokenizer(types.SimpleNamespace(tokenizer_model=path, **_TRAINING_DEFAULTS))
    except (ValueError, OSError) as err:
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise PrepareError(f"cannot load the tokenizer in {path}: {reason}") from None


def hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer inside megatron's, for batch calls. megatron's tokenize(text)
    is that tokenizer's `tokenizer(text).input_ids` (special tokens included, the flags'
    default); a batch call gives the same ids for each text, in one call."""
    library = tokenizer._tokenizer
    assert library.include_special_tokens, "built with the training defaults"
    return library.tokenizer
