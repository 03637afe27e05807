"""Reads a torch_dist / fsdp_dtensor checkpoint's metadata without reading its tensors.

Only the `.metadata` file is parsed, plus the small pickled training args (common.pt, or the one
`common_state`/`args` object inside the checkpoint); .distcp files are only stat()ed. Inside a
load (`checkpoint_reads.reading_once`) both reads are the ones megatron's load then reuses.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from moe_launcher.checkpoint_files import reads as checkpoint_reads

TRACKER_FILE = "latest_checkpointed_iteration.txt"
# megatron-core >=0.17 keeps the common (non-tensor) state as this one object inside the checkpoint.
COMMON_STATE_KEY = "common_state/shard_0_1"
# megatron's key for the content metadata in that common state (dist_checkpointing.serialization).
CONTENT_METADATA_KEY = "content_metadata"


class UnreadableCheckpoint(Exception):
    """The directory is not a checkpoint that can be read."""


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    key: str
    global_shape: tuple[int, ...]
    itemsize: int
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (offsets, sizes)


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    path: str
    format: str  # "torch_dist" or "fsdp_dtensor"
    tensors: Mapping[str, SavedTensor]
    args: Any  # the saved training args Namespace, None if the checkpoint has none
    payload_bytes: int  # sum of the .distcp file sizes
    # megatron's `content_metadata` of a torch_dist save (how its state dict was cut: the
    # distributed optimizer's sharding type, ...), None where none was saved or read.
    content: Mapping[str, Any] | None = None


class _SavedTensors(Mapping):
    """The checkpoint's tensors by key, each converted from torch's metadata when first looked
    up: a rank's load guard looks up only the keys it holds, not every chunk of the checkpoint."""

    def __init__(self, state: dict):
        self._metadata = {k: m for k, m in state.items() if isinstance(m, TensorStorageMetadata)}
        self._converted: dict[str, SavedTensor] = {}

    def __getitem__(self, key: str) -> SavedTensor:
        if key not in self._converted:
            meta = self._metadata[key]
            self._converted[key] = SavedTensor(
                key, tuple(meta.size), meta.properties.dtype.itemsize,
                tuple((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks))
        return self._converted[key]

    def __contains__(self, key: object) -> bool:
        return key in self._metadata

    def __iter__(self):
        return iter(self._metadata)

    def __len__(self) -> int:
        return len(self._metadata)


def resolve_iteration_dir(path: str) -> str:
    """A save root resolves to its latest iteration directory; an iteration dir to itself."""
    tracker = os.path.join(path, TRACKER_FILE)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}"
        return os.path.join(path, name)
    return path


def read_checkpoint_metadata(path: str, with_args: bool = True,
                             with_payload: bool = True) -> CheckpointMetadata:
    """Reads `.metadata` once (and, with_args, the saved args) of a torch_dist/fsdp_dtensor
    checkpoint; with_payload also stats every .distcp file (payload_bytes, else 0)."""
    try:
        path = resolve_iteration_dir(path)
    except (OSError, ValueError) as e:
        raise UnreadableCheckpoint(f"{path}: bad {TRACKER_FILE}: {e}") from e
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise UnreadableCheckpoint(f"{path}: no .metadata file, not a torch_dist/fsdp_dtensor checkpoint")
    with checkpoint_reads.reading_once():
        return _read(path, with_args, with_payload)


def _read(path: str, with_args: bool, with_payload: bool) -> CheckpointMetadata:
    try:
        metadata = checkpoint_reads.read_metadata(path)
    except Exception as e:  # a truncated or garbled pickle raises anything
        raise UnreadableCheckpoint(f"{path}/.metadata is unreadable: {type(e).__name__}: {e}") from e
    state = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(state, dict):
        raise UnreadableCheckpoint(f"{path}/.metadata holds no state_dict_metadata")

    fmt = saved_backend(path)
    if fmt is None:
        # fsdp_dtensor checkpoints are written by torch.distributed.checkpoint.save directly:
        # no metadata.json, model tensors under `model.`.
        fmt = "fsdp_dtensor" if any(k.startswith("model.") for k in state) else "torch_dist"

    tensors = _SavedTensors(state)
    args, content = _read_saved(path, state) if with_args else (None, None)
    payload = sum(os.stat(os.path.join(path, f)).st_size
                  for f in os.listdir(path) if f.endswith(".distcp")) if with_payload else 0
    return CheckpointMetadata(path, fmt, tensors, args, payload, content)


def saved_backend(iteration_dir: str) -> str | None:
    """The `sharded_backend` megatron's metadata.json names ("torch_dist"); None without a
    readable one (fsdp_dtensor and the torch format write none)."""
    return (_read_json(os.path.join(iteration_dir, "metadata.json")) or {}).get(
        "sharded_backend")


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _read_saved(path: str, state: dict) -> tuple[Any, Mapping[str, Any] | None]:
    """(training args, content metadata) from the common state: common.pt (legacy) or the one
    megatron-core >=0.17 keeps in the checkpoint; fsdp_dtensor keeps only its `args` object."""
    common_pt = os.path.join(path, "common.pt")
    if os.path.isfile(common_pt):
        common = torch.load(common_pt, map_location="cpu", weights_only=False)
    elif isinstance(state.get(COMMON_STATE_KEY), BytesStorageMetadata):
        try:
            common = checkpoint_reads.common_state(
                path, lambda directory: _read_object(directory, COMMON_STATE_KEY)[0])
        except Exception as e:  # megatron's own load of it would fail the same way
            raise UnreadableCheckpoint(f"{path}: the common state (saved args) is unreadable: "
                                       f"{type(e).__name__}: {e}") from e
    elif isinstance(state.get("args"), BytesStorageMetadata):
        return _read_object(path, "args"), None
    else:
        return None, None
    if not isinstance(common, dict):
        return None, None
    content = common.get(CONTENT_METADATA_KEY)
    return common.get("args"), content if isinstance(content, Mapping) else None


def _read_object(path: str, key: str) -> Any:
    """One pickled object of the checkpoint: just its byte range of the .distcp files."""
    buffer = {key: io.BytesIO()}
    with warnings.catch_warnings():  # "assuming ... a single process": yes, deliberately
        warnings.simplefilter("ignore", UserWarning)
        torch.distributed.checkpoint.load(buffer, storage_reader=checkpoint_reads.reader(path),
                                          no_dist=True)
    value = buffer[key]
    if isinstance(value, io.BytesIO):
        value.seek(0)
        value = torch.load(value, map_location="cpu", weights_only=False)
    return value
