"""Megatron-FSDP's coalesced asynchronous all-gather on the CPU backend, 2 gloo ranks: rank 1
joins late, so a gather still running when the coalescing block returns is seen on rank 0.
Prints, on rank 0, one line per coalescing manager: whether its gathers were done when the block
returned, and whether what they gathered is every rank's shard (run by
test_fsdp_param_gathers_cpu.py)."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_launcher import cpu_backend  # noqa: E402

cpu_backend.activate()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core.distributed.fsdp.src.megatron_fsdp import (  # noqa: E402
    param_and_grad_buffer,
)

LATE_S = 1.0


def gather(coalescing_manager) -> tuple[bool, bool]:
    """(done when the block returned, gathered right) for one coalesced async all-gather."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = [torch.full((n,), float(rank + 1), dtype=torch.bfloat16, device="cuda")
              for n in (64, 4096)]
    buckets = [torch.empty(world * s.numel(), dtype=torch.bfloat16, device="cuda")
               for s in shards]
    dist.barrier()
    if rank == 1:
        time.sleep(LATE_S)
    with coalescing_manager(dist.group.WORLD, async_ops=True) as manager:
        for bucket, shard in zip(buckets, shards):
            dist.all_gather_into_tensor(bucket, shard, async_op=True)
    done = all(work.is_completed() for work in manager.works)
    manager.wait()
    right = all(torch.equal(bucket.view(world, -1)[r], torch.full_like(shard, r + 1))
                for bucket, shard in zip(buckets, shards) for r in range(world))
    return done, right


def main() -> None:
    dist.init_process_group("gloo")
    for name, coalescing_manager in (
            ("megatron_fsdp", param_and_grad_buffer._coalescing_manager),
            ("torch", dist._coalescing_manager)):
        done, right = gather(coalescing_manager)
        if dist.get_rank() == 0:
            print(f"gather {name}: done on return {done}, gathered right {right}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
