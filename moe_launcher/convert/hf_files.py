"""A Hugging Face model folder on disk: config.json and safetensors, single or sharded with
`model.safetensors.index.json`. Read tensor by tensor (each shard checked by safetensors'
`safe_open`, each tensor then read from the byte range its header gives); written tensor by
tensor: the shards are planned from the
tensors' names, shapes and dtypes, so each shard's safetensors header is written first and each
tensor's bytes go to disk as it comes, none kept.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil

import torch

from .errors import ConvertError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# What a tokenizer folder may hold that AutoTokenizer reads (the tokenizer and its chat
# template); its config.json and weights, if any, are not copied.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")


def read_config_json(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConvertError(f"{path} does not exist (not a Hugging Face model folder)") from None
    except json.JSONDecodeError as error:
        raise ConvertError(f"{path} is not JSON: {error}") from None


def _weight_map(hf_dir: str) -> dict[str, str]:
    """HF tensor name -> its file, from the index or the single file's header."""
    index = os.path.join(hf_dir, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    if os.path.isfile(os.path.join(hf_dir, SINGLE)):
        return {name: SINGLE for name in _open(hf_dir, SINGLE).keys()}
    raise ConvertError(f"{hf_dir} has neither {INDEX} nor {SINGLE} (only safetensors weights "
                       "are read)")


def _open(hf_dir: str, name: str):
    from safetensors import safe_open

    path = os.path.join(hf_dir, name)
    if not os.path.isfile(path):
        raise ConvertError(f"shard {path} is missing (named by {INDEX})")
    try:
        return safe_open(path, framework="pt")
    except Exception as error:  # noqa: BLE001 -- safetensors raises its own types for any damage
        raise ConvertError(f"shard {path} is truncated or not safetensors: {error}") from None


def _data_layout(path: str) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """Each tensor of a safetensors file (checked by safetensors first): name -> (dtype name,
    shape, first byte, end byte) in the file."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return {name: (entry["dtype"], tuple(entry["shape"]), 8 + length + entry["data_offsets"][0],
                   8 + length + entry["data_offsets"][1]) for name, entry in header.items()}


class HFTensors:
    """The tensors of a HF folder, by name; every shard's header checked when opened. A tensor
    is read from its byte range with plain reads, not through a memory map (pages of a map
    stay in the process's resident memory until it is unmapped: a map of every shard grows it
    to the model's size)."""

    def __init__(self, hf_dir: str):
        self.weight_map = _weight_map(hf_dir)
        self.layout = {}  # tensor -> (file, dtype name, shape, first byte, end byte)
        for name in sorted(set(self.weight_map.values())):
            with _open(hf_dir, name):  # safetensors' own checks of the file
                pass
            path = os.path.join(hf_dir, name)
            for tensor, entry in _data_layout(path).items():
                self.layout[tensor] = (path, *entry)
        for tensor, name in self.weight_map.items():
            if tensor not in self.layout or self.layout[tensor][0] != os.path.join(hf_dir, name):
                raise ConvertError(f"{INDEX} puts {tensor} in {name}, which does not hold it")

    def _entry(self, name: str):
        if name not in self.weight_map:
            raise ConvertError(f"the checkpoint has no tensor {name}")
        return self.layout[name]

    def get(self, name: str) -> torch.Tensor:
        path, code, shape, first, end = self._entry(name)
        data = torch.empty(end - first, dtype=torch.uint8)
        with open(path, "rb", buffering=0) as f:
            f.seek(first)
            got = f.readinto(data.numpy())
        if got != end - first or code not in _DTYPE_OF_NAME:
            raise ConvertError(f"tensor {name} in {self.weight_map[name]} cannot be read: "
                               + (f"dtype {code}" if got == end - first else
                                  f"the file ends {end - first - got} bytes short"))
        return data.view(_DTYPE_OF_NAME[code]).reshape(shape)

    def header(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype name) of a tensor, from its shard's header (nothing read)."""
        _, code, shape, _, _ = self._entry(name)
        return shape, code

    def check_all_placed(self, placed: set[str]) -> None:
        """Every HF tensor has a place in the model: one left over is weight the mapping drops."""
        if left := sorted(set(self.weight_map) - placed):
            raise ConvertError(f"{len(left)} tensors have no place in the megatron model, e.g. "
                               f"{', '.join(left[:3])} (a config feature this mapping ignores)")


# safetensors' dtype names (its format: an 8-byte little-endian header length, a JSON header
# naming each tensor's dtype, shape and [begin, end) byte offsets in the data that follows).
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                      torch.float8_e4m3fn: "F8_E4M3"}
_DTYPE_OF_NAME = {**{name: dtype for dtype, name in SAFETENSORS_DTYPES.items()},
                  "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
                  "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
                  "F8_E5M2": torch.float8_e5m2}


class ShardWriter:
    """Writes the `planned` tensors ((name, shape, dtype), in the order they will be added) into
    `model-0000k-of-0000n.safetensors` shards of at most `max_bytes` (a tensor larger than that
    gets a shard of its own) and the index, streaming each tensor's bytes to disk."""

    def __init__(self, out_dir: str, max_bytes: int, planned: list[tuple[str, tuple, torch.dtype]]):
        self.out_dir, self.planned = out_dir, planned
        self.shards: list[list[int]] = []  # indices into planned
        self.shard_of: list[int] = []  # each planned tensor's shard
        size = 0
        for index, (_, shape, dtype) in enumerate(planned):
            nbytes = _nbytes(shape, dtype)
            if not self.shards or (self.shards[-1] and size + nbytes > max_bytes):
                self.shards.append([])
                size = 0
            self.shards[-1].append(index)
            self.shard_of.append(len(self.shards) - 1)
            size += nbytes
        self.next = 0  # index of the next tensor to add
        self.file = None

    def _shard_name(self, k: int) -> str:
        return f"model-{k + 1:05d}-of-{len(self.shards):05d}.safetensors"

    def _open_shard(self, k: int) -> None:
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for index in self.shards[k]:
            name, shape, dtype = self.planned[index]
            nbytes = _nbytes(shape, dtype)
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        self.file = open(os.path.join(self.out_dir, self._shard_name(k)), "wb")
        self.file.write(len(encoded).to_bytes(8, "little") + encoded)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        expected, shape, dtype = self.planned[self.next]
        if (name, tuple(tensor.shape), tensor.dtype) != (expected, tuple(shape), dtype):
            raise RuntimeError(f"the export wrote {name} {tuple(tensor.shape)} {tensor.dtype} "
                               f"where it planned {expected} {tuple(shape)} {dtype}")
        shard = self.shard_of[self.next]
        if self.next == self.shards[shard][0]:
            self._open_shard(shard)
        self.file.write(tensor.detach().contiguous().view(torch.uint8).numpy().data)
        if self.next == self.shards[shard][-1]:
            self.file.close()
        self.next += 1

    def finish(self) -> None:
        if self.next != len(self.planned):
            raise RuntimeError(f"the export wrote {self.next} of {len(self.planned)} tensors")
        weight_map = {self.planned[index][0]: self._shard_name(k)
                      for k, indices in enumerate(self.shards) for index in indices}
        total = sum(_nbytes(shape, dtype) for _, shape, dtype in self.planned)
        with open(os.path.join(self.out_dir, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total},
                       "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def progress_bar(total_bytes: int, what: str):
    """tqdm on stderr for a conversion that runs past a few seconds (none before)."""
    from tqdm import tqdm

    return tqdm(total=total_bytes, desc=f"convert: {what}", unit="B", unit_scale=True,
                delay=3, leave=False)


@contextlib.contextmanager
def read_with_progress(read, model, what: str):
    """`read` (name -> parameter) counted in a progress bar of the model's weight bytes."""
    sizes = {name: tensor.nbytes for name, tensor in model.state_dict().items()
             if isinstance(tensor, torch.Tensor)}
    with progress_bar(sum(sizes.values()), what) as bar:
        def counted(name: str) -> torch.Tensor:
            weight = read(name)
            bar.update(sizes[name])
            return weight

        yield counted


# The vocabulary files of tokenizers that are code of their folder's own, which name them as
# they like: tiktoken's ranks (Moonlight's and Kimi's tiktoken.model, Qwen-7B's qwen.tiktoken),
# SentencePiece models.
_OWN_CODE_VOCABULARY_SUFFIXES = (".model", ".tiktoken")


def copy_tokenizer(tokenizer_dir: str, out_dir: str) -> list[str]:
    """Copies the tokenizer's files; for a tokenizer that is code of the folder's own, that code
    and the vocabulary files such code reads too. Returns the names copied."""
    from moe_launcher.tokenizer_folder import own_code_files

    if not os.path.isdir(tokenizer_dir):
        raise ConvertError(f"--tokenizer {tokenizer_dir} is not a folder")
    found = [name for name in TOKENIZER_FILES
             if os.path.isfile(os.path.join(tokenizer_dir, name))]
    if not any(name.startswith("tokenizer") or name == "vocab.json" for name in found):
        raise ConvertError(f"--tokenizer {tokenizer_dir} holds no tokenizer files "
                           f"({', '.join(TOKENIZER_FILES[:5])}, ...)")
    if code := own_code_files(tokenizer_dir):
        found += code + sorted(
            name for name in os.listdir(tokenizer_dir)
            if name.endswith(_OWN_CODE_VOCABULARY_SUFFIXES) and name not in found
            and os.path.isfile(os.path.join(tokenizer_dir, name)))
    for name in found:
        shutil.copy2(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
    return found
