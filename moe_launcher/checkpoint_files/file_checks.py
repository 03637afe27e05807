"""What is missing or short in a checkpoint a load would read, judged from `.metadata` and file
sizes alone (no tensor data): the check behind checkpoint-load-integrity.

    python -m moe_launcher.checkpoint_files.file_checks DIR   # prints the problems, or "ok"
"""

from __future__ import annotations

import os
import sys

from moe_launcher.checkpoint_files import reads as checkpoint_reads
from moe_launcher.checkpoint_files import torch_format
from moe_launcher.checkpoint_files.commit_protocol import TRACKER, loaded_dirname
from moe_launcher.runtime.refusals import CheckpointLoadError


def file_problems(iteration_dir: str) -> list[str]:
    """What is missing or short in a torch_dist/fsdp_dtensor directory, judged from `.metadata`:
    each problem names the tensor (or file) and what is wrong. Reads no tensor data."""
    metadata_path = os.path.join(iteration_dir, ".metadata")
    if not os.path.isdir(iteration_dir):
        return [f"{iteration_dir} does not exist"]
    if not os.path.isfile(metadata_path):
        return [f".metadata is missing (the file that lists every tensor), so no tensor can "
                f"be located"]
    try:
        metadata = checkpoint_reads.read_metadata(iteration_dir)
    except Exception as exc:  # a truncated or garbled pickle raises anything
        return [f".metadata is unreadable ({type(exc).__name__}: {exc})"]
    storage = getattr(metadata, "storage_data", None) or {}
    needed: dict[str, tuple[int, str]] = {}  # file -> (bytes needed, a tensor stored there)
    for index, info in storage.items():
        end = info.offset + info.length
        if end > needed.get(info.relative_path, (-1, ""))[0]:
            needed[info.relative_path] = (end, index.fqn)
    problems = []
    for relative, (end, fqn) in sorted(needed.items()):
        path = os.path.join(iteration_dir, relative)
        if not os.path.isfile(path):
            problems.append(f"{fqn}: its file {relative} is missing")
            continue
        size = os.stat(path).st_size
        if size < end:
            problems.append(f"{fqn}: its file {relative} is truncated ({size} bytes, the "
                            f"metadata needs {end})")
    return problems


def _is_dist_checkpoint(iteration_dir: str, ckpt_format: str | None) -> bool:
    if ckpt_format in ("torch_dist", "fsdp_dtensor", "torch_dcp"):
        return True
    return os.path.isfile(os.path.join(iteration_dir, ".metadata")) or any(
        n.endswith(".distcp") for n in os.listdir(iteration_dir))


def load_problems(load_dir: str, ckpt_step: int | None, ckpt_format: str | None) -> list[str]:
    """This rank's view of what is wrong with the checkpoint a load would read; [] when fine or
    when there is nothing to load (megatron then starts from scratch, as it always did)."""
    try:
        dirname = loaded_dirname(load_dir, ckpt_step)
    except CheckpointLoadError as exc:
        return [str(exc)]
    if dirname is None:
        return []
    iteration_dir = os.path.join(load_dir, dirname)
    if not os.path.isdir(iteration_dir):
        return [f"refusing to load {iteration_dir}: the directory does not exist "
                f"({'--ckpt-step' if ckpt_step else TRACKER} names it)"]
    # megatron reads a torch-format checkpoint whatever --ckpt-format says: no .metadata to
    # judge it by (torch-format-shard-guard judges the layout it was saved at).
    if torch_format.is_torch_format(iteration_dir) or not _is_dist_checkpoint(
            iteration_dir, ckpt_format):
        return []
    problems = file_problems(iteration_dir)
    if not problems:
        return []
    shown = "; ".join(problems[:6]) + (f"; ... and {len(problems) - 6} more"
                                       if len(problems) > 6 else "")
    return [f"refusing to load {iteration_dir}: {shown}. The checkpoint is damaged; audit it "
            f"with `python -m megatron_patches.checkpoint_audit {iteration_dir}` and load an "
            f"earlier iteration with --ckpt-step"]


if __name__ == "__main__":
    problems = load_problems(sys.argv[1], None, None)
    print("\n".join(problems) or "ok")
    sys.exit(1 if problems else 0)
