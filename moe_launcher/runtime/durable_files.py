"""Making a write durable: the fsync a crash-safe write needs, shared by the checkpoint commit
protocol and prepare_data's output. Plain os calls, no torch or megatron."""

from __future__ import annotations

import os


def fsync_path(path: str) -> None:
    """fsync of a file, or of a directory, which makes the renames and removals in it durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
