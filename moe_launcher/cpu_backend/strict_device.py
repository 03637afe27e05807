"""Strict device mode (`MEGATRON_PATCHES_STRICT_DEVICE=1`, which the test suite sets for itself and
every process it launches): on a GPU cluster megatron's default process group, and every group
created without `backend="gloo"`, is NCCL, which refuses a host tensor; gloo accepts one, so such
a bug passes every CPU run and kills every GPU run. In strict mode tensors known to live on the
host (see `StrictCudaToCpu`) are refused by the tensor collectives on those groups, with an
error naming the collective.

"""

from __future__ import annotations

import functools
import inspect
import os

import torch
import torch.distributed as dist

from moe_launcher.cpu_backend.cuda_emulation import CudaToCpu, is_cuda_device


STRICT_DEVICE_ENV = "MEGATRON_PATCHES_STRICT_DEVICE"


_HOST = "_cpu_backend_host"  # attribute set on a tensor known to be a host tensor on a GPU


# Factories that, given no device, allocate on the host (torch's default device) on a GPU too.
_HOST_FACTORIES = frozenset({
    torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy, torch.frombuffer,
    torch.scalar_tensor, torch.zeros, torch.ones, torch.empty, torch.empty_strided, torch.full,
    torch.arange, torch.linspace, torch.logspace, torch.eye, torch.rand, torch.randn,
    torch.randint, torch.randperm,
})


_TO_HOST = frozenset({torch.Tensor.cpu, torch.Tensor.pin_memory})


def _is_host_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and getattr(value, _HOST, False)


def _mark_host(result) -> None:
    for tensor in result if isinstance(result, (tuple, list)) else (result,):
        if isinstance(tensor, torch.Tensor):
            setattr(tensor, _HOST, True)


def _forget_host(tensor) -> None:
    if getattr(tensor, _HOST, False):
        delattr(tensor, _HOST)


def _inputs_all_host(args, kwargs) -> bool:
    """True when every tensor input (shallow, and one level into lists) is a host tensor."""
    seen = False
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            if not getattr(value, _HOST, False):
                return False
            seen = True
        elif type(value) in (list, tuple):
            for item in value:
                if isinstance(item, torch.Tensor):
                    if not getattr(item, _HOST, False):
                        return False
                    seen = True
    return seen


def _placement(device) -> str:
    """'cuda' or 'unknown'. A device named "cpu" is not known to mean the host: under this
    backend a device tensor's `.device` is torch.device('cpu') too, and megatron writes
    `torch.cuda.current_device() if torch.cuda.is_available() else "cpu"` (e.g. its MoE
    metrics tracker), which is a CUDA device on a GPU. Only tensors made without any device,
    or moved by .cpu(), are known host tensors."""
    if is_cuda_device(device):
        return "cuda"
    return "unknown"


def _requested_placement(func, args, kwargs) -> str | None:
    """Where the call asks its result to be, or None where it names no device."""
    if kwargs and kwargs.get("device") is not None:
        return _placement(kwargs["device"])
    if func is torch.Tensor.to:
        for value in args[1:]:
            if isinstance(value, (str, torch.device, int)) and not isinstance(value, bool):
                return _placement(value)
        return None
    if func in _TO_HOST:
        return "host"
    if func in _HOST_FACTORIES and not any(isinstance(a, torch.Tensor) for a in args):
        return "host"
    return None


class StrictCudaToCpu(CudaToCpu):
    """Also tags the tensors that would be host tensors on a GPU, for the collectives to refuse.

    A tensor is tagged when a factory makes it without a device, by .cpu()/.pin_memory(), or
    by an op all of whose tensor inputs are tagged and that names no device; .cuda()/.to("cuda")
    clear the tag. Anything else is not known to be on
    the host and is never refused: a false refusal would stop a run that works on a GPU.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            _forget_host(args[0])
            return args[0]
        result = super().__torch_function__(func, types, args, kwargs)
        if not isinstance(result, torch.Tensor) and not (
                type(result) in (tuple, list) and result and isinstance(result[0], torch.Tensor)):
            return result  # sizes, dtypes, numbers: the common case, kept cheap
        placement = _requested_placement(func, args, kwargs)
        if placement == "host" or (placement is None and _inputs_all_host(args, kwargs)):
            _mark_host(result)
        elif placement == "cuda" and func is torch.Tensor.to:
            _forget_host(result)  # .to("cuda") of a tensor already "there" returns the tensor
        return result


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
            if _is_host_tensor(item):
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
