"""prepare_data's piece cache (issue 38) gives, text by text, the ids of the tokenizer's own
encoding (transformers' fast tokenizer, `tokenizer(texts).input_ids`, the reference) for the
configurations it recognises: GPT-2's ByteLevel regex, Llama 3 / Qwen's Split regex + ByteLevel,
and a Metaspace (SentencePiece-like) BPE, each with a BOS post-processor; it declines what it
does not reproduce (a prefix space, an unsplit Metaspace), and a wrong cached piece is caught
by its check and the batch re-encoded by the tokenizer. Tokenizers are trained here with
`tokenizers`."""

from __future__ import annotations

import random
import re

import pytest

from moe_launcher.prepare_data import piece_cache

WORDS = ("the of and to in is was for on that with as by at from expert router token layer "
         "gradient it's we'll I'm DON'T 12 345 6789 3.14 e-mail (x) [y] {z} -- ... ?!").split(" ")
UNICODE = ("naïve", "中文", "🙂")  # in one text of four
SPACES = (" ", " ", " ", "  ", "\n", "\t", "\n\n", "   ")
BOS, EOS = "<|begin|>", "<|endoftext|>"
# Llama 3's split regex (tokenizer.json of Meta-Llama-3), digits in threes, contractions
# case-insensitive.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = ["".join(word + rng.choice(SPACES) for word in rng.choices(WORDS, k=rng.randint(1, 80)))
             + (rng.choice(UNICODE) if rng.random() < 0.25 else "") for _ in range(count)]
    return texts + ["", " ", "  lead and trail  ", f"{EOS} in {BOS} text", "x" * 500]


def _fast_tokenizer(kind: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    if kind == "gpt2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif kind == "llama3":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:  # SentencePiece-like
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.ByteLevel() if kind != "metaspace" else decoders.Metaspace()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if kind != "metaspace" else []
    tokenizer.train_from_iterator(_texts(300, 1), trainers.BpeTrainer(
        vocab_size=700, special_tokens=[EOS, BOS], initial_alphabet=alphabet,
        show_progress=False))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=BOS)


@pytest.fixture(autouse=True)
def _serial_tokenizers(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # no thread pool left in pytest


def _reference(hf, texts: list[str]) -> list[list[int]]:
    return hf(texts, return_attention_mask=False, return_token_type_ids=False)["input_ids"]


@pytest.mark.parametrize("kind", ["gpt2", "llama3", "metaspace"])
def test_same_ids_as_the_tokenizer(kind):
    hf = _fast_tokenizer(kind)
    encoder = piece_cache.PieceCacheEncoder.for_tokenizer(hf)
    assert encoder is not None
    texts = _texts(400, 2)
    assert encoder.encode(texts) == _reference(hf, texts)
    # ASCII documents without an added token's text take the cache; the rest the tokenizer
    fast = [t for t in texts if t and t.isascii() and BOS not in t and EOS not in t]
    assert encoder.fast_documents == len(fast) > 100 and encoder.mismatches == 0
    assert encoder.prefix == [hf.convert_tokens_to_ids(BOS)] and encoder.suffix == []
    if kind != "metaspace":  # its split: the regex written for ASCII, run by `re`
        assert isinstance(encoder.split.__self__, re.Pattern)


def test_declines_what_it_does_not_reproduce():
    hf = _fast_tokenizer("gpt2")
    hf.backend_tokenizer.pre_tokenizer = __import__("tokenizers").pre_tokenizers.ByteLevel(
        add_prefix_space=True)
    assert piece_cache.PieceCacheEncoder.for_tokenizer(hf) is None
    hf = _fast_tokenizer("metaspace")
    hf.backend_tokenizer.pre_tokenizer = __import__("tokenizers").pre_tokenizers.Metaspace(
        split=False)
    assert piece_cache.PieceCacheEncoder.for_tokenizer(hf) is None


def test_a_pattern_with_another_unicode_property_keeps_the_regex_module():
    assert piece_cache._ascii_pattern(r" ?\p{Lu}+| ?\p{N}+") is None
    assert piece_cache._ascii_pattern(r"[^\S\p{L}]") is None  # \S inside a class
    assert piece_cache._ascii_pattern(r"\p{N}{1,3}|\s+") == r"[0-9]{1,3}|[\t\n\x0b\x0c\r ]+"


def test_a_wrong_cached_piece_is_caught_and_the_batch_reencoded():
    hf = _fast_tokenizer("gpt2")
    encoder = piece_cache.PieceCacheEncoder.for_tokenizer(hf)
    texts = [f"the router {i}" for i in range(2 * piece_cache.CHECK_EVERY)]
    encoder.cache[" router"] = [0]  # as a wrong split or model call would leave it
    assert encoder.encode(texts) == _reference(hf, texts)
    assert (encoder.mismatches, encoder.enabled, encoder.fast_documents) == (1, False, 0)
    assert encoder.encode(texts[:3]) == _reference(hf, texts[:3])  # the tokenizer from now on
