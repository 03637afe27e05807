"""Strict device mode (`MEGATRON_PATCHES_STRICT_DEVICE=1`, which the test suite sets for itself and
every process it launches): on a GPU cluster megatron's default process group, and every group
created without `backend="gloo"`, is NCCL, which refuses a host tensor; gloo accepts one, so such
a bug passes every CPU run and kills every GPU run. In strict mode tensors known to live on the
host (tagged by `cuda_emulation.CudaToCpu`) are refused by the tensor collectives on those
groups, with an error naming the collective.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
import torch.distributed as dist

from moe_launcher.cpu_backend.cuda_emulation import is_host_tensor


STRICT_DEVICE_ENV = "MEGATRON_PATCHES_STRICT_DEVICE"


_GLOO_GROUPS: set = set()  # process groups created with backend "gloo": host tensors are fine


_TENSOR_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "all_to_all",
    "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
)


def _recording_gloo_groups(new_group):
    signature = inspect.signature(new_group)

    @functools.wraps(new_group)
    def new_group_recording_gloo(*args, **kwargs):
        group = new_group(*args, **kwargs)
        backend = signature.bind(*args, **kwargs).arguments.get("backend")
        if backend is not None and "gloo" in str(backend).lower():
            _GLOO_GROUPS.add(group)
        return group

    return new_group_recording_gloo


def _refuse_host_tensor(collective: str, tensors, group) -> None:
    if group is not None and group is not dist.GroupMember.WORLD and group in _GLOO_GROUPS:
        return
    for value in tensors:
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if is_host_tensor(item):
                where = ("the default process group" if group is None
                         or group is dist.GroupMember.WORLD
                         else "a process group created without backend='gloo'")
                raise RuntimeError(
                    f"torch.distributed.{collective} got a host tensor on {where}: on a GPU that "
                    f"group is NCCL, and NCCL would refuse a host tensor ({STRICT_DEVICE_ENV}=1). "
                    "Create the tensor on torch.cuda.current_device() (moe_launcher/"
                    "runtime/collectives.py) or use a gloo group.")


def _refusing_host_tensors(collective: str, function):
    signature = inspect.signature(function)

    @functools.wraps(function)
    def checked(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        tensors = [v for k, v in bound.items() if k != "group" and not k.endswith("split_sizes")]
        _refuse_host_tensor(collective, tensors, bound.get("group"))
        return function(*args, **kwargs)

    return checked


def _refusing_host_p2p(batch_isend_irecv):
    @functools.wraps(batch_isend_irecv)
    def checked(p2p_op_list):
        for op in p2p_op_list:
            _refuse_host_tensor("batch_isend_irecv", [op.tensor], op.group)
        return batch_isend_irecv(p2p_op_list)

    return checked


def strict_collectives() -> None:
    """Wraps the collectives as megatron looks them up (torch.distributed.<name>).

    torch's own object collectives call distributed_c10d's unwrapped functions on the device
    the group needs, so they pass. isend/irecv are also replaced in distributed_c10d, whose
    P2POp accepts only the functions named there.
    """
    from torch.distributed import distributed_c10d as c10d

    recording = _recording_gloo_groups(c10d.new_group)
    dist.new_group = c10d.new_group = recording
    for name in _TENSOR_COLLECTIVES:
        checked = _refusing_host_tensors(name, getattr(dist, name))
        setattr(dist, name, checked)
        if name in ("isend", "irecv"):
            setattr(c10d, name, checked)
    dist.batch_isend_irecv = _refusing_host_p2p(dist.batch_isend_irecv)


def strict_device() -> bool:
    return os.environ.get(STRICT_DEVICE_ENV, "0") == "1"
