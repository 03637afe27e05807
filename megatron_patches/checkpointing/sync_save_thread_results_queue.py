"""A synchronous torch_dist save hands its write results over a queue inside the process, instead
of a multiprocessing Manager that megatron starts, with 'spawn', at every process's first save.

Upstream: local (megatron-core 0.19.2
`megatron/core/dist_checkpointing/strategies/filesystem_async.py`: `FileSystemWriterAsync.
prepare_write_data` calls `get_write_results_queue()`, whose default is
`mp.get_context('spawn').Manager().Queue()`; 0.15.3 calls the same function
`_get_write_results_queue`). Targets megatron-core 0.15-0.19.

Every torch_dist save, synchronous ones included (`TorchDistSaveShardedStrategy.save` runs the
asynchronous machinery with `execute_sync`), collects what its writer threads wrote through that
queue. The queue is a process-wide cache, so the first save of every rank starts a Manager server:
a fresh interpreter that imports the rank's `__main__` (pretrain_moe.py: torch and the launcher)
before it serves. It then stays for the whole job. Measured on the tiny CPU recipe (4 ranks on 2
cores): the first save 4.9-8.7 s where the later ones take 0.4-0.8 s (0.4-0.5 s patched), and
each Manager holds 460-565 MB resident, one per rank (at that size, 8 ranks per node hold about
4 GB of the node's memory).

A synchronous save writes and reads its results in the rank's own process: the writer threads
put them, the same thread that started them reads them after joining them. (0.15 writes from
forked processes, which return their results through a fork queue of their own; the rank's
process then puts them into megatron's queue and reads them back itself.) So during
`TorchDistSaveShardedStrategy.save` megatron's cache holds a `queue.Queue` of that save's own,
and is empty again after it. Where the cache already holds a Manager's queue (megatron's
persistent async-save worker makes one at start), the save uses that one, as before; an
asynchronous save (`async_save`, whose writer runs in another process) is not touched and makes
its Manager as before.
"""

from __future__ import annotations

import queue

from megatron_patches.checkpointing.sync_save_scope import hold_during_sync_save, strategy_module
from megatron_patches.registry import Patch, PatchContext, register, unwrapped

NAME = "sync-save-thread-results-queue"
# The writer's queue getter: its name from 0.17 on, and in 0.15.
QUEUE_GETTERS = ("get_write_results_queue", "_get_write_results_queue")


def _writer_module():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return filesystem_async


def _apply() -> None:
    # A queue of the save's own, read by get_write_results_queue() when the writer prepares the
    # save's buckets; a Manager queue megatron already made is used as before.
    hold_during_sync_save(NAME, _writer_module(), "_results_queue", None, queue.Queue)


def _not_needed_because(context: PatchContext) -> str | None:
    # What megatron's code calls tells whether a save starts a Manager: the writer takes its
    # queue from get_write_results_queue, which makes a Manager's queue once per process.
    filesystem_async, torch_strategy = _writer_module(), strategy_module()
    writer = unwrapped(filesystem_async.FileSystemWriterAsync.prepare_write_data)
    getter = next((name for name in QUEUE_GETTERS if name in writer.__code__.co_names), None)
    if getter is None:
        return "FileSystemWriterAsync.prepare_write_data takes no get_write_results_queue()"
    if "Manager" not in unwrapped(getattr(filesystem_async, getter)).__code__.co_names:
        return f"{getter}() starts no multiprocessing Manager"
    if "_results_queue" not in vars(filesystem_async):
        return "filesystem_async keeps no _results_queue cache to hand a queue through"
    save = unwrapped(torch_strategy.TorchDistSaveShardedStrategy.save)
    if "execute_sync" not in save.__code__.co_names:
        return "TorchDistSaveShardedStrategy.save does not run its request in this process"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 dist_checkpointing/strategies/filesystem_async.py)",
    versions=">=0.15,<0.20",
    summary="a synchronous torch_dist save collects its write results in the rank's own process "
            "(megatron spawned a multiprocessing Manager, an interpreter importing the "
            "entrypoint, at each rank's first save and kept it for the whole job)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
