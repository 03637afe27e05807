"""torch DCP's FileSystemWriter writing a conversion's checkpoint as it is read: the planner
makes each tensor when the writer asks for it, and the tensors go into files of at most the
largest tensor's bytes. (torch 2.14's writer keeps every tensor of a file referenced until the
file is closed, for its safetensors format, so one file per rank would hold the whole model;
megatron's own writer collects every tensor before it writes one.) Readers, megatron's
included, find each tensor's file in the checkpoint's `.metadata`."""

from __future__ import annotations

import math
import queue

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import WriteItemType


def _nbytes(item) -> int:
    if item.type == WriteItemType.BYTE_IO:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


class BoundedFilesWriter(FileSystemWriter):
    def __init__(self, path: str):
        super().__init__(path, thread_count=1)

    def write_data(self, plan, planner):
        budget = max((_nbytes(item) for item in plan.items), default=0)
        files: list[list] = [[]]
        held = 0
        for item in plan.items:  # in the plan's order: a parameter's parts one after another
            if files[-1] and held + _nbytes(item) > budget:
                files.append([])
                held = 0
            files[-1].append(item)
            held += _nbytes(item)
        file_queue: queue.Queue = queue.Queue()
        for number, items in enumerate(files):
            name = f"{plan.storage_data.prefix}{number}{DEFAULT_SUFFIX}"
            file_queue.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, file_queue)
