"""pretrain_moe.py with one test-only stop inside atomic-checkpoint-commit, so that a test puts a
run into a chosen state of a save deterministically (a crash there, or a save left in flight).
Run under torchrun like pretrain_moe.py.

COMMIT_HOOK=<point>:<dirname>:<action>
  point   commit         megatron's save has returned, the staged directory is not renamed yet
          write_tracker  the staged directory is renamed into place, the tracker is not written
          remove_retired the tracker names the new iteration; the older one megatron's
                         --save-retain-interval drops is moved aside, not yet removed
          megatron_tracker_write
                         megatron's own in-place tracker write (`open(tracker, "w")` in
                         save_checkpoint): the file is truncated, the iteration not yet
                         written. Hooked at megatron's call site, so it is there with the
                         patch left out too; with the patch that file is a scratch copy
  dirname the iteration directory the hooked call is about (the one saved, or the one dropped)
  action  kill           SIGKILL this process: from the main thread a second later, as a crash
                         would come (threads megatron started, such as its retention deletion,
                         get to run); from another thread (remove_retired runs in megatron's
                         deletion thread) at once, or training would go on for that second and
                         could commit one or two more iterations first
          wait=<file>    create <file>.reached, then wait until <file> exists
          raise=<ERRNO>  raise OSError(errno.<ERRNO>) there, as the filesystem would (ESTALE:
                         an NFS handle gone stale; ENOSPC: a full disk)

The run goes through pretrain_moe.run, so a refused save ends as users see it: one line per rank.
"""

import errno
import functools
import os
import signal
import sys
import threading
import time

import torch

import pretrain_moe
from moe_launcher.checkpoint_files import commit_protocol, retention

# Which iteration directory each hooked call is about.
_SUBJECT = {
    "commit": lambda save_dir, dirname, *_: dirname,
    "write_tracker": lambda save_dir, value: (
        value if value == "release" else commit_protocol.iteration_dirname(int(value))),
    "remove_retired": lambda path: commit_protocol.public_name(
        os.path.basename(path), commit_protocol.RETIRED_PREFIX),
}


def _act(action: str) -> None:
    if action == "kill":
        if threading.current_thread() is threading.main_thread():
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    if action.startswith("raise="):
        code = getattr(errno, action.removeprefix("raise="))
        raise OSError(code, os.strerror(code))
    gate = action.removeprefix("wait=")
    open(gate + ".reached", "w").close()
    while not os.path.exists(gate):
        time.sleep(0.1)


class _TrackerWriteStop:
    """megatron.training.checkpointing's `maybe_msc` for one run: a file opened for writing
    under the tracker's name acts on the write of `dirname`'s iteration, after the truncation."""

    def __init__(self, client, dirname: str, action: str):
        self._client, self._dirname, self._action = client, dirname, action

    def __getattr__(self, name):
        return getattr(self._client, name)

    def open(self, path, mode="r", *args, **kwargs):
        handle = self._client.open(path, mode, *args, **kwargs)
        if "w" not in mode or not str(path).endswith(commit_protocol.TRACKER):
            return handle
        write, stop = handle.write, self

        def write_then_act(text):
            if text != "release" and commit_protocol.iteration_dirname(int(text)) == stop._dirname:
                handle.flush()
                _act(stop._action)
            return write(text)

        handle.write = write_then_act
        return handle


def _install(spec: str) -> None:
    point, dirname, action = spec.split(":", 2)
    if point == "megatron_tracker_write":
        from megatron.training import checkpointing

        checkpointing.maybe_msc = _TrackerWriteStop(checkpointing.maybe_msc, dirname, action)
        return
    # Where each point is looked up when called: commit() calls write_tracker() in the same module.
    module = retention if point == "remove_retired" else commit_protocol
    original = getattr(module, point)

    @functools.wraps(original)
    def hooked(*args, **kwargs):
        if _SUBJECT[point](*args, **kwargs) == dirname:
            _act(action)
        return original(*args, **kwargs)

    setattr(module, point, hooked)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        from moe_launcher import cpu_backend

        cpu_backend.activate()
    if os.environ.get("COMMIT_HOOK"):
        _install(os.environ["COMMIT_HOOK"])
    pretrain_moe.run(sys.argv[1:])
