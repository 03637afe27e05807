"""pretrain_moe.py that counts, per rank, the checkpoint I/O and checks the project's patches
do (by hooking the module attributes they call). Run under torchrun like pretrain_moe.py; at exit
each rank writes $IO_COUNT_DIR/rank<R>.json:

  fsynced        basenames of the files the commit protocol fsynced
  staging_lists  listings (os.listdir/os.scandir, os.walk's too) of a staging directory
  file_checks    calls of file_checks.file_problems (the load-integrity file check)
  metadata_reads .metadata files read from disk in this process (the checks' and megatron's)
  gathers        all-rank metadata gathers the save guard ran itself
  tiling_checks  tiling checks the save guard ran on all ranks' metadata
  model_checks   model-shape judgements the save guard ran
"""

import atexit
import functools
import json
import os
import sys

import torch

if not torch.cuda.is_available():  # before anything imports megatron.core
    from moe_launcher import cpu_backend

    cpu_backend.activate()

import pretrain_moe  # noqa: E402
from torch.distributed.checkpoint import filesystem  # noqa: E402

from moe_launcher.checkpoint_files import commit_protocol, file_checks  # noqa: E402
from megatron_patches.checkpointing import checkpoint_completeness_guard as checkpoint_guard

COUNTS = {"fsynced": [], "staging_lists": 0, "file_checks": 0, "metadata_reads": 0, "gathers": 0,
          "tiling_checks": 0, "model_checks": 0}


def _counting(module, name, record):
    original = getattr(module, name)

    @functools.wraps(original)
    def counted(*args, **kwargs):
        record(*args)
        return original(*args, **kwargs)

    setattr(module, name, counted)


def _bump(key):
    def record(*_):
        COUNTS[key] += 1
    return record


def _write_counts():
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(
        os.environ.get("RANK", 0))
    with open(os.path.join(os.environ["IO_COUNT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump(COUNTS, f)


if __name__ == "__main__":
    _counting(commit_protocol, "_fsync_file",
              lambda path: COUNTS["fsynced"].append(os.path.basename(path)))
    def _listed(path="."):  # a path, or a directory's fd (not a staging one's here)
        if isinstance(path, (str, os.PathLike)) and os.path.basename(
                os.fspath(path)).startswith(commit_protocol.STAGING_PREFIX):
            COUNTS["staging_lists"] += 1

    _counting(os, "listdir", _listed)
    _counting(os, "scandir", _listed)
    _counting(file_checks, "file_problems", _bump("file_checks"))
    _counting(checkpoint_guard, "determine_global_metadata", _bump("gathers"))
    _counting(checkpoint_guard, "refuse_wrong_model_shapes", _bump("model_checks"))
    _counting(checkpoint_guard, "enforce_complete_layout", _bump("tiling_checks"))
    # torch's reader is the one every reader of .metadata (the checks', megatron's) ends in.
    _counting(filesystem.FileSystemReader, "read_metadata", _bump("metadata_reads"))
    atexit.register(_write_counts)
    pretrain_moe.main(sys.argv[1:])
