"""--save-retain-interval deletions, carried out only after the commit that makes them safe.

megatron's retention deletes the previous iteration inside save_checkpoint, before this project's
commit; `DeferredRetention` stands in for its deletion and runs it once the tracker names the new
iteration. An iteration is renamed to `_retired_*` first (atomic), then removed.
"""

from __future__ import annotations

import os
import shutil
import threading

from moe_launcher.checkpoint_files.commit_protocol import (
    RETIRED_PREFIX,
    iteration_dirname,
    private_name,
    public_name,
)
from moe_launcher.runtime.durable_files import fsync_path


def remove_retired(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    print(f"[megatron_patches] atomic-checkpoint-commit: removed "
          f"{public_name(os.path.basename(path), RETIRED_PREFIX)} from {os.path.dirname(path)} "
          f"(--save-retain-interval), after the tracker moved past it", flush=True)


def drop_iteration(save_dir: str, iteration: int, claim_id: str) -> None:
    """Deletes an iteration the tracker no longer names: renamed aside first (atomic, to writer
    `claim_id`'s own name), so a crash during the removal leaves a `_retired_*` leftover, never a
    half-deleted `iter_*`."""
    dirname = iteration_dirname(iteration)
    source = os.path.join(save_dir, dirname)
    retired = os.path.join(save_dir, private_name(RETIRED_PREFIX, claim_id, dirname))
    try:
        os.rename(source, retired)
        fsync_path(save_dir)
        remove_retired(retired)
    except OSError as exc:  # as megatron's own deletion: not fatal to training
        print(f"[megatron_patches] atomic-checkpoint-commit: could not delete {source}: {exc}",
              flush=True)


class DeferredRetention:
    """The deletions megatron's retention asks for during one save, carried out once that save is
    committed (or never, when it fails). It stands in for megatron's
    `_async_delete_checkpoint_impl`, which megatron runs in a thread that may start late."""

    def __init__(self, claim_id: str):
        self._claim_id = claim_id
        self._lock = threading.Lock()
        self._requested: list[tuple[str, int]] = []
        self._state = "saving"

    def request(self, save_path: str, iteration_to_delete: int, *_, **__) -> None:
        with self._lock:
            state = self._state
            if state == "saving":
                self._requested.append((save_path, iteration_to_delete))
        if state == "committed":  # megatron's thread ran after the commit: delete now
            drop_iteration(save_path, iteration_to_delete, self._claim_id)

    def committed(self) -> None:
        with self._lock:
            self._state, requested, self._requested = "committed", self._requested, []
        for save_path, iteration in requested:  # in the background, as megatron does
            threading.Thread(target=drop_iteration,
                             args=(save_path, iteration, self._claim_id)).start()

    def abandoned(self) -> None:
        with self._lock:
            self._state, self._requested = "abandoned", []
