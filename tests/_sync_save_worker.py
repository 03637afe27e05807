"""One rank of a training loop of the user's own that saves with megatron-core's dist_checkpointing
(the legacy track, megatron-core 0.15.x, has no megatron.training and so no pretrain_moe.py):

    python -m torch.distributed.run --nproc-per-node=2 tests/_sync_save_worker.py CKPT_DIR

Applies this project's patches through the registry (MEGATRON_PATCHES_DISABLE leaves one out),
then saves a sharded state dict twice, into CKPT_DIR/iter_1 and CKPT_DIR/iter_2, with
`dist_checkpointing.save` and megatron's default strategy (torch_dist, synchronous): each rank
holds its rows of a [4 x ranks, 8] weight drawn from a seed of its own. Prints the patches' status
lines (rank 0) and, on every rank after the saves, the child processes it has left running
(tests/_save_children_entry.py's `save-children` line).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_launcher import cpu_backend  # noqa: E402

cpu_backend.activate()

import torch.distributed as dist  # noqa: E402

from _save_children_entry import print_children  # noqa: E402
from megatron_patches import registry  # noqa: E402

ROWS, COLUMNS = 4, 8  # each rank's piece of the weight


def main(ckpt_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    registry.load_patches()
    for status in registry.apply_patches(registry.current_context(cpu_backend=True)):
        if rank == 0:
            print(status.line(), flush=True)

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    generator = torch.Generator().manual_seed(rank)
    for iteration in (1, 2):
        weight = torch.randn(ROWS, COLUMNS, generator=generator)
        state = {"weight": ShardedTensor.from_rank_offsets("weight", weight, (0, rank, world))}
        directory = os.path.join(ckpt_dir, f"iter_{iteration}")
        if rank == 0:
            os.makedirs(directory)
        dist.barrier()
        dist_checkpointing.save(state, directory)
    print_children()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
