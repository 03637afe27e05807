"""A Hugging Face model folder on disk: config.json and safetensors, single or sharded with
`model.safetensors.index.json`. Read tensor by tensor (safetensors' `safe_open` maps the file
and reads one tensor per call); written shard by shard, each shard on disk before the next is
collected.
"""

from __future__ import annotations

import json
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


class HFTensors:
    """The tensors of a HF folder, by name; every shard's header checked when opened."""

    def __init__(self, hf_dir: str):
        self.weight_map = _weight_map(hf_dir)
        self.files = {name: _open(hf_dir, name) for name in sorted(set(self.weight_map.values()))}
        for tensor, name in self.weight_map.items():
            if tensor not in self.files[name].keys():
                raise ConvertError(f"{INDEX} puts {tensor} in {name}, which does not hold it")
        self.unread = set(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ConvertError(f"the checkpoint has no tensor {name}")
        self.unread.discard(name)
        try:
            return self.files[self.weight_map[name]].get_tensor(name)
        except Exception as error:  # noqa: BLE001 -- a read past a truncated file's end
            raise ConvertError(f"tensor {name} in {self.weight_map[name]} cannot be read: "
                               f"{error}") from None

    def check_all_read(self) -> None:
        """Every HF tensor went into the model: one left over is weight the mapping dropped."""
        if self.unread:
            left = sorted(self.unread)
            raise ConvertError(f"{len(left)} tensors have no place in the megatron model, e.g. "
                               f"{', '.join(left[:3])} (a config feature this mapping ignores)")


class ShardWriter:
    """Writes tensors into `model-0000k-of-0000n.safetensors` shards of at most `max_bytes`
    (a tensor larger than that gets a shard of its own) and the index."""

    def __init__(self, out_dir: str, max_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.pending, os.path.join(self.out_dir, f"shard-{len(self.shards)}.partial"),
                  metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        if self.pending:
            self._flush()
        count, weight_map = len(self.shards), {}
        for k, names in enumerate(self.shards):
            final = f"model-{k + 1:05d}-of-{count:05d}.safetensors"
            os.rename(os.path.join(self.out_dir, f"shard-{k}.partial"),
                      os.path.join(self.out_dir, final))
            weight_map.update(dict.fromkeys(names, final))
        with open(os.path.join(self.out_dir, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": self.total_bytes},
                       "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)


def copy_tokenizer(tokenizer_dir: str, out_dir: str) -> list[str]:
    if not os.path.isdir(tokenizer_dir):
        raise ConvertError(f"--tokenizer {tokenizer_dir} is not a folder")
    found = [name for name in TOKENIZER_FILES
             if os.path.isfile(os.path.join(tokenizer_dir, name))]
    if not any(name.startswith("tokenizer") or name == "vocab.json" for name in found):
        raise ConvertError(f"--tokenizer {tokenizer_dir} holds no tokenizer files "
                           f"({', '.join(TOKENIZER_FILES[:5])}, ...)")
    for name in found:
        shutil.copy2(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
    return found
