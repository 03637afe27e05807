"""An output folder that appears complete or not at all: everything is written into a temporary
sibling, renamed to the final name at the end (one rename on the same filesystem), and removed
when anything fails."""

from __future__ import annotations

import contextlib
import os
import shutil

from .errors import ConvertError


def check_target(out_dir: str) -> None:
    """`out_dir` may not exist or must be an empty folder; checked before any work and again
    when the output is staged."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ConvertError(f"{out_dir} already exists and is not an empty folder")
    if not os.path.isdir(os.path.dirname(out_dir)):
        raise ConvertError(f"the folder {os.path.dirname(out_dir)} for {out_dir} does not exist")


@contextlib.contextmanager
def staged_folder(out_dir: str):
    """Yields the temporary folder to write into."""
    check_target(out_dir)
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    staging = os.path.join(parent, f".{os.path.basename(out_dir)}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)  # this pid's own leftover, never another run's
    os.mkdir(staging)
    try:
        yield staging
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty, checked above
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
