"""One read per rank and load of a checkpoint's `.metadata` and common state (issue 14).

megatron-core 0.19.2 reads a torch_dist checkpoint's `.metadata` on every rank at least twice per
load: for the common state (`load_common_state_dict`, which also unpickles the saved args) and
again for the tensors (`TorchDistLoadShardedStrategy.load`), a third time for a strict load. The
load checks need the same two things: checkpoint-load-guard on every rank (`.metadata` and the
saved args), checkpoint-load-integrity on rank 0 (`.metadata`). Read separately, that is two more
unpickles per rank of a file that lists every saved chunk (~250k for DeepSeek-V3 at 1,024 ranks:
seconds each) and two more opens of one file by every rank of a shared filesystem.

While `reading_once()` is open (the patches open it for one `load_checkpoint`, or one load), a
`LoadReads` record keeps:

* the first read of each directory's `.metadata`; every later reader gets it: the checks, and the
  readers megatron takes from `_get_filesystem_reader` (the call site of its common-state read and
  its tensor load), each a copy carrying its own `load_id`;
* the common state the guard reads for the saved args, read by megatron's own
  `load_common_state_dict` and handed to megatron's next call of that function, once (megatron
  merges the loaded tensors into it).

checkpoint-load-guard and checkpoint-load-integrity hook those two megatron call sites when they
apply (`install`). Readers megatron caches itself (`CachedMetadataFileSystemReader`,
--ckpt-assume-constant-structure), MSC readers, per-rank metadata files, every read outside a
scope, and the offline audit (which does not import megatron) read as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import sys
from typing import Any, Callable

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_MARK = "_megatron_patches_checkpoint_reads"


def _key(directory: Any) -> str:
    return os.path.normpath(os.path.abspath(os.fspath(directory)))


class LoadReads:
    """What one load has read of its checkpoint directories."""

    def __init__(self):
        self._metadata: dict[str, Metadata] = {}
        self._common_state: dict[str, Any] = {}  # read by a check, not yet taken by megatron

    def metadata(self, directory: Any) -> Metadata:
        key = _key(directory)
        if key not in self._metadata:
            self._metadata[key] = FileSystemReader(key).read_metadata()
        return self._metadata[key]

    def serve(self, reader: FileSystemReader, directory: Any, read: Callable, *args, **kwargs):
        """`reader.read_metadata` for a reader of `directory`: the kept metadata as a copy with
        the reader's own load_id (torch sets it on the object it returns)."""
        if args or kwargs.get("rank") is not None:  # a per-rank metadata file: not the one kept
            return read(*args, **kwargs)
        metadata = self.metadata(directory)
        storage_meta = dataclasses.replace(metadata.storage_meta or StorageMeta(),
                                           load_id=reader.load_id)
        return dataclasses.replace(metadata, storage_meta=storage_meta)

    def common_state(self, directory: Any, load: Callable) -> Any:
        key = _key(directory)
        if key not in self._common_state:
            self._common_state[key] = load(directory)
        return self._common_state[key]

    def take_common_state(self, directory: Any) -> Any | None:
        return self._common_state.pop(_key(directory), None)


_ACTIVE: contextvars.ContextVar[LoadReads | None] = contextvars.ContextVar(
    "megatron_patches_load_reads", default=None)


@contextlib.contextmanager
def reading_once():
    """The scope of one load: reads inside share one `LoadReads` (an enclosing scope's, if
    any); megatron's readers share it once `install` has hooked them."""
    if _ACTIVE.get() is not None:
        yield _ACTIVE.get()
        return
    token = _ACTIVE.set(LoadReads())
    try:
        yield _ACTIVE.get()
    finally:
        _ACTIVE.reset(token)


def read_metadata(directory: Any) -> Metadata:
    """`directory`'s `.metadata`: the load's kept read inside `reading_once`, else from disk."""
    reads = _ACTIVE.get()
    return reads.metadata(directory) if reads is not None else FileSystemReader(
        _key(directory)).read_metadata()


def reader(directory: Any) -> FileSystemReader:
    """A FileSystemReader of `directory` that reads `.metadata` as `read_metadata` does."""
    return _served(FileSystemReader(_key(directory)), directory)


def _served(one: FileSystemReader, directory: Any) -> FileSystemReader:
    """`one`, reading `.metadata` from the open load's kept read (unchanged outside a load)."""
    reads = _ACTIVE.get()
    if reads is not None:
        one.read_metadata = functools.partial(reads.serve, one, directory, one.read_metadata)
    return one


def common_state(directory: Any, read_offline: Callable[[Any], Any]) -> Any:
    """The common state of `directory` (args, iteration, ...). In a load where megatron's readers
    are hooked (`install`), it is read by megatron's own `load_common_state_dict` and then handed
    to megatron's next call of it; elsewhere (the offline audit, which does not import megatron)
    by `read_offline(directory)`."""
    reads, megatrons = _ACTIVE.get(), _megatron_load_common_state()
    if reads is None or megatrons is None:
        return read_offline(directory)
    return reads.common_state(directory, megatrons)


def _megatron_load_common_state() -> Callable | None:
    """megatron's own (unhooked) load_common_state_dict where `install` hooked it, else None;
    never imports megatron."""
    serialization = sys.modules.get("megatron.core.dist_checkpointing.serialization")
    hooked = getattr(serialization, "load_common_state_dict", None)
    return hooked.__wrapped__ if hasattr(hooked, _MARK) else None


# ---------------------------------------------------------------------------------------------
# megatron's call sites
# ---------------------------------------------------------------------------------------------
def _serving_reader(original: Callable) -> Callable:
    @functools.wraps(original)
    def _get_filesystem_reader(checkpoint_dir, *args, **kwargs):
        one = original(checkpoint_dir, *args, **kwargs)
        # Only plain readers: megatron's caching reader keeps its own cache, MSC reads elsewhere.
        if type(one).read_metadata is FileSystemReader.read_metadata:
            return _served(one, checkpoint_dir)
        return one

    setattr(_get_filesystem_reader, _MARK, True)
    return _get_filesystem_reader


def _handed_common_state(original: Callable) -> Callable:
    @functools.wraps(original)
    def load_common_state_dict(checkpoint_dir, *args, **kwargs):
        reads = _ACTIVE.get()
        kept = reads.take_common_state(checkpoint_dir) if reads is not None and not (
            args or kwargs) else None
        return kept if kept is not None else original(checkpoint_dir, *args, **kwargs)

    setattr(load_common_state_dict, _MARK, True)
    return load_common_state_dict


def install() -> None:
    """Hooks megatron's readers (idempotent); the load patches call it when they apply."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    hooks = ((torch_strategy, "_get_filesystem_reader", _serving_reader),
             (serialization, "_get_filesystem_reader", _serving_reader),
             (serialization, "load_common_state_dict", _handed_common_state),
             (dist_checkpointing, "load_common_state_dict", _handed_common_state))
    for module, name, hook in hooks:
        current = getattr(module, name, None)
        if current is not None and not hasattr(current, _MARK):
            setattr(module, name, hook(current))
