"""The tokenizer, loaded exactly as a training run loads it.

For `--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR` megatron's build_tokenizer
wraps megatron's HuggingFaceTokenizer, built with arguments from the flags. The same class with
the arguments of the flags' defaults is built here: the same AutoTokenizer call and the same
special tokens added after it, so the same ids, end-of-document id and vocabulary size (hence
the same .bin dtype). Its transformers tokenizer, for batch calls, is its public `tokenizer`
(megatron's wrapper keeps the class itself in a private attribute)."""

from __future__ import annotations

import logging
import os
import warnings

from moe_launcher.tokenizer_folder import (
    download_hint, folder_problem, is_hub_id, untrusted_own_code)

from .errors import PrepareError

# The arguments megatron's build_tokenizer gives HuggingFaceTokenizer when a run sets none of
# --chat-template, --vocab-file, --merge-file, --special-tokens, --tokenizer-hf-no-use-fast,
# --tokenizer-hf-no-include-special-tokens; --trust-remote-code is prepare_data's flag too.
_TRAINING_DEFAULTS = dict(
    chat_template=None, vocab_file=None, merges_file=None, additional_special_tokens=[],
    use_fast=True, include_special_tokens=True,
)


class TokenizerCodeNotTrusted(PrepareError):
    """The tokenizer is code of its folder's own, and trust_remote_code was not given."""


def check_tokenizer_folder(path: str) -> None:
    """A local folder with a tokenizer in it, checked first (moe_launcher/tokenizer_folder.py)."""
    problem = folder_problem(path)
    if problem and is_hub_id(path):
        raise PrepareError(f"{problem}; fix: `{download_hint(path)}` and pass --tokenizer DIR")
    if problem:
        raise PrepareError(problem)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """megatron's HuggingFaceTokenizer for `path`, as training builds it (its text_to_ids(text)
    is training's tokenize(text)); with `trust_remote_code`, as a run with --trust-remote-code
    builds it: a tokenizer of the folder's own code runs that code."""
    # A local folder only: never reach for a hub.
    os.environ["HF_HUB_OFFLINE"] = "1"
    # Importing megatron on a machine without CUDA, Transformer Engine or Apex warns about each;
    # none of them matters for tokenizing, and a refusal is to stay one line.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import transformers
        from megatron.core.tokenizers.text.libraries import HuggingFaceTokenizer

    # Documents longer than the model's context are normal in pretraining data; transformers'
    # per-call warning about them says nothing here.
    transformers.logging.set_verbosity_error()
    if not trust_remote_code and (code := untrusted_own_code(path)):
        raise TokenizerCodeNotTrusted(
            f"the tokenizer in {path} is code of the folder's own ({code}), which runs only "
            "when asked; fix: pass --trust-remote-code if you trust that code (and "
            "--trust-remote-code to the training run, which loads it the same way)")
    try:
        return HuggingFaceTokenizer(path, **_TRAINING_DEFAULTS,
                                    trust_remote_code=trust_remote_code)
    except (ValueError, OSError, ImportError) as err:
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise PrepareError(f"cannot load the tokenizer in {path}: {reason}") from None


def hf_tokenizer(tokenizer):
    """The transformers tokenizer inside megatron's HuggingFaceTokenizer, for batch calls: with
    special tokens included (the flags' default) text_to_ids(text) is its
    `tokenizer(text).input_ids`, so one batch call gives the same ids for each text."""
    return tokenizer.tokenizer
