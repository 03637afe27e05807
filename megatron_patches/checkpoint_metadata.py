"""Reads a torch_dist / fsdp_dtensor checkpoint's metadata without reading its tensors.

Only the `.metadata` file is parsed, plus the small pickled training args (common.pt, or the one
`common_state`/`args` object inside the checkpoint); .distcp files are only stat()ed.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

TRACKER_FILE = "latest_checkpointed_iteration.txt"
# megatron-core >=0.17 keeps the common (non-tensor) state as this one object inside the checkpoint.
COMMON_STATE_KEY = "common_state/shard_0_1"


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
    tensors: dict[str, SavedTensor]
    args: Any  # the saved training args Namespace, None if the checkpoint has none
    payload_bytes: int  # sum of the .distcp file sizes


def resolve_iteration_dir(path: str) -> str:
    """A save root resolves to its latest iteration directory; an iteration dir to itself."""
    tracker = os.path.join(path, TRACKER_FILE)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}"
        return os.path.join(path, name)
    return path


class _MetadataReadOnce(FileSystemReader):
    """A reader that hands torch the `.metadata` already read instead of reading it again."""

    def __init__(self, path: str, metadata: Any):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self):
        return self._metadata


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
    reader = FileSystemReader(path)
    try:
        metadata = reader.read_metadata()
    except Exception as e:  # a truncated or garbled pickle raises anything
        raise UnreadableCheckpoint(f"{path}/.metadata is unreadable: {type(e).__name__}: {e}") from e
    state = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(state, dict):
        raise UnreadableCheckpoint(f"{path}/.metadata holds no state_dict_metadata")

    megatron_meta = _read_json(os.path.join(path, "metadata.json"))
    fmt = (megatron_meta or {}).get("sharded_backend")
    if fmt is None:
        # fsdp_dtensor checkpoints are written by torch.distributed.checkpoint.save directly:
        # no metadata.json, model tensors under `model.`.
        fmt = "fsdp_dtensor" if any(k.startswith("model.") for k in state) else "torch_dist"

    tensors = {}
    for key, meta in state.items():
        if isinstance(meta, TensorStorageMetadata):
            tensors[key] = SavedTensor(
                key, tuple(meta.size), meta.properties.dtype.itemsize,
                tuple((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks))
    args = _read_args(path, _MetadataReadOnce(path, metadata), state) if with_args else None
    payload = sum(os.stat(os.path.join(path, f)).st_size
                  for f in os.listdir(path) if f.endswith(".distcp")) if with_payload else 0
    return CheckpointMetadata(path, fmt, tensors, args, payload)


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _read_args(path: str, reader: FileSystemReader, state: dict) -> Any:
    """The training args: from common.pt (legacy) or the one small object stored in the checkpoint."""
    common_pt = os.path.join(path, "common.pt")
    if os.path.isfile(common_pt):
        return torch.load(common_pt, map_location="cpu", weights_only=False).get("args")
    key = COMMON_STATE_KEY if COMMON_STATE_KEY in state else "args" if "args" in state else None
    if key is None or not isinstance(state[key], BytesStorageMetadata):
        return None
    # Reads just this object's byte range out of the .distcp files, never the tensors.
    buffer = {key: io.BytesIO()}
    with warnings.catch_warnings():  # "assuming ... a single process": yes, deliberately
        warnings.simplefilter("ignore", UserWarning)
        torch.distributed.checkpoint.load(buffer, storage_reader=reader, no_dist=True)
    value = buffer[key]
    if isinstance(value, io.BytesIO):
        value.seek(0)
        value = torch.load(value, map_location="cpu", weights_only=False)
    if key == COMMON_STATE_KEY:
        value = value[0] if isinstance(value, (list, tuple)) else value
        return value.get("args") if isinstance(value, dict) else None
    return value

