"""A faster exact path for BPE tokenizers whose pre-tokenizer splits text into independent
pieces: byte-level ones (GPT-2's, Llama 3's, Qwen's) and SentencePiece-like Metaspace ones. The
text is split the tokenizer's own way (its regex, run by Python's `re` where rewritten for
ASCII, else by `regex`; or Metaspace's replace-and-split), and each piece's ids come from a
per-worker cache, filled on a miss by the tokenizer's own BPE model on the piece (in its
byte-level form for a byte-level tokenizer). Per document that is one split and dictionary
lookups instead of the tokenizer's full encoding (offsets, word ids, masks, ...).

Used only where it is exact:
* the configuration is recognised in tokenizer.json: a normalizer that leaves ASCII alone (none,
  NFC, NFD, NFKC, NFKD); the ByteLevel pre-tokenizer with its built-in regex, a Split by a regex
  followed by ByteLevel without one (no prefix space either way), or a splitting Metaspace; a
  BPE model without dropout, byte fallback or subword affixes;
* only ASCII documents without an added token's text in them take it (any other document goes
  to the tokenizer): on ASCII a regex's split depends only on which of its character classes
  each character is in, and every ASCII character's encoding in a set of contexts, with 500
  random ASCII strings, is checked against the tokenizer's own when the encoder is made (one
  difference and the path is not used);
* the special tokens the tokenizer's post-processor adds (a BOS) are taken from its own output.
A worker also encodes every `CHECK_EVERY`-th fast document with the tokenizer and compares:
a difference turns the path off for the rest of that worker's run and re-encodes the chunk
(counted: `mismatches`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import re
import string

# The ByteLevel pre-tokenizer's own regex when `use_regex` is true (GPT-2's).
_BYTE_LEVEL_REGEX = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
                     r"|\s+")
_ASCII_SAFE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD"}
CHECK_EVERY = 64
# Pieces kept per worker before the cache starts over: a web corpus has millions of distinct
# words, each entry ~150 bytes; frequent pieces come back within a few documents.
CACHE_LIMIT = 500_000


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer applies (on
    ASCII text each character is its own byte: a `str.translate` table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


# What the Unicode letter and number classes are on ASCII text: (inside a [...] class, alone).
_ON_ASCII = {"L": ("A-Za-z", "[A-Za-z]"), "N": ("0-9", "[0-9]")}
# Unicode's White_Space on ASCII (`re`'s \s also takes \x1c-\x1f, the tokenizers' does not).
_SPACE = "\\t\\n\\x0b\\x0c\\r "


def _ascii_pattern(pattern: str) -> str | None:
    """`pattern` with \\p{L}, \\p{N}, \\s and \\S written as the ASCII characters they match on
    ASCII text, for the standard library's `re` (about twice as fast as `regex` here); None where
    it uses another Unicode property."""
    out, inside, i = [], False, 0
    while i < len(pattern):
        if pattern.startswith("\\p{", i):
            end = pattern.find("}", i)
            name = pattern[i + 3:end]
            if name not in _ON_ASCII:
                return None
            out.append(_ON_ASCII[name][0 if inside else 1])
            i = end + 1
            continue
        if pattern.startswith("\\s", i):
            out.append(_SPACE if inside else f"[{_SPACE}]")
            i += 2
            continue
        if pattern.startswith("\\S", i):
            if inside:
                return None
            out.append(f"[^{_SPACE}]")
            i += 2
            continue
        if pattern[i] == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if pattern[i] == "[" and not inside:
            inside = True
        elif pattern[i] == "]" and inside:
            inside = False
        out.append(pattern[i])
        i += 1
    return "".join(out)


def _split_regex(pre_tokenizer: dict | None) -> str | None:
    """The regex that splits text into pieces, where the pre-tokenizer is one this path
    reproduces; else None."""
    if not pre_tokenizer:
        return None
    if pre_tokenizer.get("type") == "ByteLevel":
        if pre_tokenizer.get("use_regex", True) and not pre_tokenizer.get("add_prefix_space"):
            return _BYTE_LEVEL_REGEX
        return None
    if pre_tokenizer.get("type") != "Sequence" or len(pre_tokenizer.get("pretokenizers", [])) != 2:
        return None
    split, byte_level = pre_tokenizer["pretokenizers"]
    if (split.get("type") == "Split" and "Regex" in split.get("pattern", {})
            and split.get("behavior") == "Isolated" and not split.get("invert")
            and byte_level.get("type") == "ByteLevel" and not byte_level.get("use_regex", True)
            and not byte_level.get("add_prefix_space")):
        return split["pattern"]["Regex"]
    return None


def _metaspace_split(pre_tokenizer: dict | None):
    """text -> its pieces, for a Metaspace pre-tokenizer that splits (SentencePiece's way: spaces
    become its replacement character, which starts each piece; one is prepended unless the
    scheme is "never"); else None. (For one text without added tokens "first" is "always".)"""
    if not pre_tokenizer or pre_tokenizer.get("type") != "Metaspace" \
            or not pre_tokenizer.get("split", True):
        return None
    mark = pre_tokenizer.get("replacement", "\u2581")
    scheme = pre_tokenizer.get("prepend_scheme", "always")
    if len(mark) != 1 or mark.isascii() or scheme not in ("always", "first", "never"):
        return None
    pieces = re.compile(f"{re.escape(mark)}[^{re.escape(mark)}]*|[^{re.escape(mark)}]+")

    def split(text: str) -> list[str]:
        text = text.replace(" ", mark)
        if scheme != "never" and not text.startswith(mark):
            text = mark + text
        return pieces.findall(text)

    return split


class PieceCacheEncoder:
    def __init__(self, hf, split, byte_level: bool):
        self.hf = hf  # transformers' fast tokenizer: the reference and the fallback
        self.backend = hf.backend_tokenizer
        self.split = split  # text -> pieces
        # what the model is given for a piece: its byte-level form, or the piece itself
        self.form = str.maketrans(_byte_level_alphabet()) if byte_level else {}
        self.cache: dict[str, list[int]] = {}
        added = [token.content for token in hf.added_tokens_decoder.values()]
        ascii_added = [content for content in added if content.isascii() and content]
        self.added = re.compile("|".join(map(re.escape, ascii_added))) if ascii_added \
            else None
        probe = "a"
        whole = self._reference([probe])[0]
        pieces = self.split(probe)
        self._add(set(pieces))
        body = [i for piece in pieces for i in self.cache[piece]]
        at = next((i for i in range(len(whole) - len(body) + 1)
                   if whole[i:i + len(body)] == body), None)
        if at is None:
            raise ValueError("the post-processor's tokens around a text cannot be told apart")
        self.prefix, self.suffix = whole[:at], whole[at + len(body):]
        self.fast_documents = self.mismatches = 0
        self.enabled = True
        self._since_check = 0

    @classmethod
    def for_tokenizer(cls, hf) -> "PieceCacheEncoder | None":
        """The encoder where the tokenizer's configuration is one it reproduces and it agrees
        with the tokenizer on every check; else None."""
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            return None
        config = json.loads(backend.to_str())
        normalizer = config.get("normalizer")
        model = config.get("model") or {}
        if normalizer and normalizer.get("type") not in _ASCII_SAFE_NORMALIZERS:
            return None
        if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback") \
                or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            return None
        pre_tokenizer = config.get("pre_tokenizer")
        candidates = []  # (split, byte-level): the first that agrees with the tokenizer wins
        if metaspace := _metaspace_split(pre_tokenizer):
            candidates.append((metaspace, False))
        elif (pattern := _split_regex(pre_tokenizer)) is not None:
            import regex

            with contextlib.suppress(re.error, TypeError):  # (None: another Unicode property)
                candidates.append((re.compile(_ascii_pattern(pattern)).findall, True))
            candidates.append((regex.compile(pattern).findall, True))
        for split, byte_level in candidates:
            try:
                encoder = cls(hf, split, byte_level)
            except ValueError:
                return None
            if encoder._agrees():
                return encoder
        return None

    def _reference(self, texts: list[str]) -> list[list[int]]:
        return self.hf(texts, return_attention_mask=False, return_token_type_ids=False)["input_ids"]

    def _add(self, pieces) -> None:
        """Each piece's ids from the tokenizer's BPE model on its form (byte-level, or itself)."""
        if len(self.cache) + len(pieces) > CACHE_LIMIT:
            self.cache.clear()
        for piece in pieces:
            formed = piece.translate(self.form)
            self.cache[piece] = [token.id for token in self.backend.model.tokenize(formed)]

    def _fast(self, text: str) -> list[int]:
        pieces = self.split(text)
        try:  # lookups only, no Python call per piece
            return [*self.prefix, *itertools.chain.from_iterable(
                map(self.cache.__getitem__, pieces)), *self.suffix]
        except KeyError:
            self._add(set(pieces).difference(self.cache))
            return [*self.prefix, *itertools.chain.from_iterable(
                map(self.cache.__getitem__, pieces)), *self.suffix]

    def _agrees(self) -> bool:
        """Every ASCII character in the contexts a split regex tells apart (after a letter, a
        digit, a space, itself, a contraction), and random ASCII strings, encode the same both
        ways."""
        draw = random.Random(0)
        probes = [f"ab{c}cd 12{c}3 {c}{c} {c}'s x{c}\n" for c in map(chr, range(128))]
        alphabet = string.printable + "".join(map(chr, range(32)))
        probes += ["".join(draw.choice(alphabet) for _ in range(draw.randint(1, 60)))
                   for _ in range(500)]
        probes += ["I'm here, it's 12345 o'clock;  we'll   see\t\tyou\n\n  ", "x" * 300]
        probes = [p for p in probes if p and not (self.added and self.added.search(p))]
        return [self._fast(p) for p in probes] == self._reference(probes)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """The tokenizer's ids for each text (what `hf(texts).input_ids` gives)."""
        fast, slow = {}, []
        for i, text in enumerate(texts):
            # (an empty text is the tokenizer's: its post-processor may add nothing to it)
            if self.enabled and text and text.isascii() \
                    and not (self.added and self.added.search(text)):
                fast[i] = self._fast(text)
            else:
                slow.append(i)
        checked = [i for i in fast if self._count_for_check()]
        if checked and self._reference([texts[i] for i in checked]) != [fast[i] for i in checked]:
            self.mismatches += 1
            self.enabled = False
            return self._reference(texts)
        self.fast_documents += len(fast)
        ids = dict(zip(slow, self._reference([texts[i] for i in slow]) if slow else []))
        ids.update(fast)
        return [ids[i] for i in range(len(texts))]

    def _count_for_check(self) -> bool:
        self._since_check += 1
        if self._since_check >= CHECK_EVERY:
            self._since_check = 0
            return True
        return False
