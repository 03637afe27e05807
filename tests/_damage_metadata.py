"""Rewrites a good ETP>1 torch_dist checkpoint's `.metadata` into the Megatron-LM #1836 layout.

For every expert tensor (weights and their optimizer states) the ETP-sharded axis shrinks to
one ETP shard, only ETP rank 0's chunks stay listed (re-offset into the smaller shape) and the
other ranks' chunks are dropped, exactly what the buggy save declared. The payload files are
left alone; the dropped chunks' bytes just become unreferenced.
"""

from __future__ import annotations

import dataclasses
import os
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from moe_launcher.checkpoint_files.metadata import resolve_iteration_dir
from moe_launcher.checkpoint_files.shape_rules import is_expert_key


def damage_like_1836(ckpt_dir: str, etp: int, shrink: bool = True) -> list[str]:
    """Rewrites the metadata in place; returns the keys it damaged.

    shrink=False keeps the true global shape and only drops the other ETP ranks' chunks: a
    checkpoint that megatron-core 0.19.2 itself loads without complaint, leaving the missing
    regions of the expert weights at their initial values.
    """
    path = resolve_iteration_dir(ckpt_dir)
    metadata = FileSystemReader(path).read_metadata()
    shrunk = []
    for key, meta in list(metadata.state_dict_metadata.items()):
        if not (isinstance(meta, TensorStorageMetadata) and is_expert_key(key)):
            continue
        split = [d for d in range(len(meta.size)) if meta.chunks[0].sizes[d] * etp <= meta.size[d]
                 and d >= len(meta.size) - 2]
        if not split:
            continue
        axis = split[0]
        size = list(meta.size)
        size[axis] //= etp if shrink else 1
        kept = []
        for chunk in meta.chunks:
            step = chunk.sizes[axis]
            etp_rank = (chunk.offsets[axis] // step) % etp
            old_index = MetadataIndex(key, chunk.offsets)
            storage = metadata.storage_data.pop(old_index)
            if etp_rank:
                continue  # this ETP replica was never written under #1836
            offsets = list(chunk.offsets)
            offsets[axis] //= etp if shrink else 1
            kept.append(ChunkStorageMetadata(torch.Size(offsets), chunk.sizes))
            metadata.storage_data[MetadataIndex(key, torch.Size(offsets))] = storage
        metadata.state_dict_metadata[key] = dataclasses.replace(
            meta, size=torch.Size(size), chunks=kept)
        shrunk.append(key)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    return shrunk
