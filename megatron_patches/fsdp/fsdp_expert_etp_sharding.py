"""Megatron-FSDP with expert tensor parallelism: expert weights carry their ETP sharding.

Upstream: NVIDIA/Megatron-LM#1836 (fix proposed in PR #1770, not merged; megatron-core 0.16.0
gave Megatron-FSDP its own expert device mesh).

In megatron-core 0.15.x, Megatron-FSDP (megatron/core/distributed/fsdp/) knows one device mesh,
(dp_cp, tp), built from the dense groups (mcore_fsdp_adapter.py `_init_dist_index`). With
expert parallelism 1 the expert weights keep `allreduce=True`, so Megatron-FSDP files them with
the dense weights, and `make_fsdp_dtensor` (param_and_grad_buffer.py) describes each of them on
the dense mesh: TP placement from the dense TP group, data-parallel placement over dp_cp. When
the expert tensor-parallel group is not the dense TP group (ETP > 1 with TP = 1, say), an
expert weight's DTensor then claims that this rank's ETP slice *is* the whole weight, replicated
(no_shard) or sharded over dp_cp, which here spans the ETP ranks. torch.distributed.checkpoint
(the fsdp_dtensor checkpoint format) believes it: the saved global shape is 1/ETP of the true
one, one ETP rank's slice is written, and on load every ETP rank reads that slice.

The fix, for Megatron-FSDP models built with ETP > 1, EP = 1 and a plain (non-hybrid) FSDP
group whose expert TP group differs from the dense TP group:

* the wrapped model's expert weights (".experts." in the name, as 0.16+ Megatron-FSDP
  decides) are marked expert-parallel (`allreduce=False`), so Megatron-FSDP keeps them in
  expert buffers;
* the distributed index gets an expert view: a second FSDPDistributedIndex on an
  (expt_dp, etp) device mesh built from megatron's expert data-parallel and expert
  tensor-parallel groups. Expert buffers shard and reduce over expert data parallelism, and
  `make_fsdp_dtensor` describes expert weights on that mesh, so their DTensors (and the
  optimizer states torch creates like them) carry the ETP sharding and the true global shape.

Whether it is needed is decided from the installed Megatron-FSDP: a `FSDPDistributedIndex` that
takes an expert device mesh (`expt_device_mesh`, 0.16+) does this itself.
"""

from __future__ import annotations

import functools
import inspect

from megatron_patches.registry import Patch, PatchContext, register

NAME = "fsdp-expert-etp-sharding"


def _megatron_fsdp():
    """(adapter module, param_and_grad_buffer module, FSDPDistributedIndex) or None."""
    try:
        from megatron.core.distributed.fsdp import mcore_fsdp_adapter
        from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer
        from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex
    except ImportError:
        return None
    if not getattr(mcore_fsdp_adapter, "HAVE_MEGATRON_FSDP", False):
        return None
    return mcore_fsdp_adapter, param_and_grad_buffer, FSDPDistributedIndex


def _not_needed_because(context: PatchContext) -> str | None:
    found = _megatron_fsdp()
    if found is None:
        return "this megatron-core has no Megatron-FSDP"
    _, buffers, index_cls = found
    if "expt_device_mesh" in inspect.signature(index_cls.__init__).parameters:
        return "Megatron-FSDP builds its own expert device mesh (FSDPDistributedIndex.expt_device_mesh)"
    if "is_expert_param" in inspect.signature(buffers._get_fsdp_tensor_spec).parameters:
        return "Megatron-FSDP already places expert DTensors on an expert mesh"
    return None


def _etp_setup_applies(ddp_config, pg_collection) -> bool:
    """ETP > 1, EP = 1, non-hybrid FSDP, and expert TP ranks differ from dense TP ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if pg_collection is not None or ddp_config.num_distributed_optimizer_instances > 1:
        return False
    if ps.get_expert_model_parallel_world_size() != 1:
        return False  # EP > 1 fails loudly in 0.15.x Megatron-FSDP (no get_expert_dp_group)
    if ps.get_expert_tensor_parallel_world_size() <= 1:
        return False
    etp_ranks = dist.get_process_group_ranks(ps.get_expert_tensor_parallel_group())
    tp_ranks = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
    return sorted(etp_ranks) != sorted(tp_ranks)


def _expert_index(dense_index, index_cls):
    """An FSDPDistributedIndex on the (expt_dp, etp) mesh of megatron's expert groups."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.distributed import DeviceMesh

    from moe_launcher.runtime import collectives

    expt_dp = ps.get_expert_data_parallel_group()
    etp = ps.get_expert_tensor_parallel_group()
    # Row i: the ETP group of expert-DP rank i (every rank of my expt_dp group tells its own).
    rows = collectives.gather_objects(dist.get_process_group_ranks(etp), group=expt_dp)
    mesh = DeviceMesh.from_group(
        [expt_dp, etp], device_type=dense_index.device_mesh.device_type,
        mesh=torch.tensor(rows, dtype=torch.int).tolist(), mesh_dim_names=("expt_dp", "etp"),
    )
    return index_cls(device_mesh=mesh, dp_shard_dim="expt_dp", tp_dim="etp")


def _attach_expert_index(dense_index, expert_index) -> None:
    """Expert queries on the dense index answer with the expert groups (instance-level only)."""
    get_dp_group, get_fsdp_group = dense_index.get_dp_group, dense_index.get_fsdp_group

    def dp_group(is_expert_parallel: bool = False):
        return expert_index.get_dp_group() if is_expert_parallel else get_dp_group()

    def fsdp_group(is_expert_parallel: bool = False):
        return expert_index.get_fsdp_group() if is_expert_parallel else get_fsdp_group()

    dense_index.get_dp_group = dp_group
    dense_index.get_fsdp_group = fsdp_group
    dense_index.get_expert_dp_group = expert_index.get_dp_group
    dense_index.etp_expert_index = expert_index


def _apply() -> None:
    adapter, buffers, index_cls = _megatron_fsdp()
    fsdp_cls = adapter.FullyShardedDataParallel
    init, init_dist_index = fsdp_cls.__init__, fsdp_cls._init_dist_index

    @functools.wraps(init)
    def __init__(self, config, ddp_config, module, *args, **kwargs):
        pg_collection = kwargs.get("pg_collection", args[4] if len(args) > 4 else None)
        self._etp_expert_mesh = _etp_setup_applies(ddp_config, pg_collection)
        if self._etp_expert_mesh:
            for name, param in module.named_parameters():
                if ".experts." in name:
                    param.allreduce = False
        init(self, config, ddp_config, module, *args, **kwargs)

    @functools.wraps(init_dist_index)
    def _init_dist_index(self, pg_collection):
        dist_index = init_dist_index(self, pg_collection)
        if getattr(self, "_etp_expert_mesh", False):
            _attach_expert_index(dist_index, _expert_index(dist_index, index_cls))
        return dist_index

    fsdp_cls.__init__ = __init__
    fsdp_cls._init_dist_index = _init_dist_index

    make_fsdp_dtensor = buffers.make_fsdp_dtensor

    @functools.wraps(make_fsdp_dtensor)
    def make_expert_aware_dtensor(local_tensor, param, dist_index, *args, **kwargs):
        is_expert = kwargs.get("is_expert_param", args[1] if len(args) > 1 else False)
        expert_index = getattr(dist_index, "etp_expert_index", None)
        if is_expert and expert_index is not None:
            dist_index = expert_index
        return make_fsdp_dtensor(local_tensor, param, dist_index, *args, **kwargs)

    buffers.make_fsdp_dtensor = make_expert_aware_dtensor
    try:
        from megatron.core.transformer import fsdp_dtensor_checkpoint
    except ImportError:
        return
    if getattr(fsdp_dtensor_checkpoint, "make_fsdp_dtensor", None) is make_fsdp_dtensor:
        fsdp_dtensor_checkpoint.make_fsdp_dtensor = make_expert_aware_dtensor


register(Patch(
    name=NAME,
    upstream="NVIDIA/Megatron-LM#1836 (PR #1770 not merged)",
    versions="~=0.15.0",
    summary="Megatron-FSDP expert weights sharded on an (expt_dp, etp) mesh, true global shapes",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
