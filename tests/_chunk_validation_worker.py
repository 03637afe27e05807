"""Run by test_fsdp_dtensor_chunk_metadata_cpu.py under torchrun (2 gloo ranks): uneven DTensors
on a 2-rank mesh, some whose shards do not tile their tensor, judged by megatron-core's
`gather_and_compute_chunk_metadata` and `validate_uneven_dtensor` and by
fsdp-dtensor-batched-chunk-metadata's `place_chunks` and `validate_chunks` (all cases in one
batch, then each alone). Rank 0 prints one JSON line: case -> {"megatron": ..., "batched": ...}.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_launcher import cpu_backend  # noqa: E402

cpu_backend.activate()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402

# case -> (global shape, rank 0's rows, rank 1's rows, placement): shards of dim 0 or 1.
CASES = {
    "uneven": ((4, 3), 3, 1, Shard(0)),
    "one_rank_empty": ((4, 3), 4, 0, Shard(0)),
    "columns": ((2, 5), 2, 3, Shard(1)),
    "replicated": ((4, 3), 4, 4, Replicate()),
    "gap_at_the_end": ((4, 3), 1, 1, Shard(0)),
    "past_the_end": ((3, 3), 4, 0, Shard(0)),  # every rank out of bounds, as megatron refuses
}


def dtensor(mesh, shape, rows0, rows1, placement) -> DTensor:
    rows = (rows0, rows1)[dist.get_rank()]
    local_shape = list(shape)
    local_shape[placement.dim if isinstance(placement, Shard) else 0] = rows
    return DTensor.from_local(torch.zeros(local_shape), mesh, [placement], run_check=False,
                              shape=torch.Size(shape), stride=torch.empty(shape).stride())


def verdict(check) -> str:
    try:
        check()
    except AssertionError as refused:
        return "refused: " + ("boundary" if "boundary" in str(refused) else "bounds")
    return "valid"


def main() -> None:
    dist.init_process_group("gloo")
    from megatron.core.distributed.fsdp.src.megatron_fsdp import uneven_dtensor

    from megatron_patches.fsdp import fsdp_dtensor_batched_chunk_metadata as batched

    mesh = init_device_mesh("cpu", (2,))
    tensors = {name: dtensor(mesh, *case) for name, case in CASES.items()}
    results = {}
    chunks = batched.place_chunks(list(tensors.values()))
    for (name, t), chunk in zip(tensors.items(), chunks):
        megatron = uneven_dtensor.gather_and_compute_chunk_metadata(t)
        results[name] = {
            "chunk_equal": list(megatron.offsets) == chunk.offsets,
            "megatron": verdict(lambda: uneven_dtensor.validate_uneven_dtensor(t)),
            "batched": verdict(lambda: batched.validate_chunks(batched.place_chunks([t]))),
        }
    results["all_at_once"] = verdict(lambda: batched.validate_chunks(chunks))
    valid = [chunk for name, chunk in zip(tensors, chunks) if results[name]["megatron"] == "valid"]
    results["valid_ones_at_once"] = verdict(lambda: batched.validate_chunks(valid))
    everyone = [None, None]
    dist.all_gather_object(everyone, results)
    if dist.get_rank() == 0:
        print(json.dumps(everyone))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
