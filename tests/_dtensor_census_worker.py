"""Run by test_built_model_cpu.py under torchrun (2 gloo ranks): built_model's parameter counts
of the same parameters as plain tensors and as DTensors on a 2-rank DeviceMesh, as
Megatron-FSDP (data-parallel shards) and tensor parallelism (TP2) make them. Rank 0 prints one
JSON line."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_launcher import cpu_backend  # noqa: E402

cpu_backend.activate()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

from moe_launcher.model import built_model, param_shapes  # noqa: E402
from moe_launcher.model.built_model import Parallelism  # noqa: E402

# name -> (global shape, expert, TP partition dim or None); dim 0 of "odd" splits 3 + 2.
PARAMETERS = {"dense": ((8, 6), False, 0), "expert": ((4, 6), True, 1), "odd": ((5, 3), False, None)}


def parameter(full: torch.Tensor, expert: bool, partition_dim, local=None, mesh=None,
              placement=None) -> torch.nn.Parameter:
    if mesh is None:
        param = torch.nn.Parameter(full if local is None else local)
    else:
        param = torch.nn.Parameter(DTensor.from_local(
            local, mesh, [placement], run_check=False, shape=full.shape, stride=full.stride()))
    param.allreduce = not expert  # megatron's marks: experts are not all-reduced over DP
    if partition_dim is not None:
        param.tensor_model_parallel, param.partition_dim = True, partition_dim
    return param


def counts(params, parallelism, tp_group=None):
    # The layer that owns the parameters: its tp_group is what partitions them (param_shapes).
    owner = torch.nn.Module()
    owner.tp_group = tp_group
    shardings = [built_model.sharding_of(name, 0, p, parallelism,
                                         param_shapes.param_truth(name, owner, p))
                 for name, p in params.items()]
    unique, held = built_model.count_parameters(shardings, parallelism)
    return {"unique": unique, "held": [h.total for h in held],
            "sharded": [h.sharded for h in held],
            "global_shapes": {s.name: list(s.global_shape) for s in shardings},
            "local_shapes": {s.name: list(s.local_shape) for s in shardings},
            "split_over": {s.name: s.split_over for s in shardings},
            "numel": sum(p.numel() for p in params.values())}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    full = {name: torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
            for name, (shape, _, _) in PARAMETERS.items()}

    # Megatron-FSDP: every parameter sharded on dim 0 over the 2 data-parallel ranks.
    fsdp = Parallelism(world=2, pipeline=1, tensor=1, expert=1, expert_tensor=1, data=2,
                       expert_data=2, first_stage=True)
    plain = {name: parameter(full[name], expert, dim)
             for name, (_, expert, dim) in PARAMETERS.items()}
    sharded = {name: parameter(full[name], expert, dim, full[name].tensor_split(2)[rank],
                               mesh, Shard(0))
               for name, (_, expert, dim) in PARAMETERS.items()}

    # Tensor parallelism over the same 2 ranks: split on each parameter's partition dim.
    tp = Parallelism(world=2, pipeline=1, tensor=2, expert=1, expert_tensor=2, data=1,
                     expert_data=1, first_stage=True)

    def tp_local(name, dim):
        return full[name] if dim is None else full[name].tensor_split(2, dim)[rank]

    tp_plain = {name: parameter(full[name], expert, dim, tp_local(name, dim))
                for name, (_, expert, dim) in PARAMETERS.items()}
    tp_dtensor = {name: parameter(full[name], expert, dim, tp_local(name, dim), mesh, Shard(dim))
                  for name, (_, expert, dim) in PARAMETERS.items() if dim is not None}

    report = {"total": sum(t.numel() for t in full.values()),
              "plain": counts(plain, fsdp), "fsdp": counts(sharded, fsdp),
              "tp_plain": counts(tp_plain, tp, dist.group.WORLD),
              "tp_dtensor": counts(tp_dtensor, tp, dist.group.WORLD),
              "tp_dtensor_total": sum(full[n].numel() for n, (_, _, d) in PARAMETERS.items()
                                      if d is not None)}
    if rank == 0:
        print("census " + json.dumps(report), flush=True)
    # The counts run no collective: without a barrier rank 0 could tear its gloo pairs down
    # while rank 1 is still connecting the mesh's group, which aborts rank 1 (seen once in CI:
    # "terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
