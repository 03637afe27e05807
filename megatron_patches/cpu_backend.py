"""CPU backend: runs megatron-core's training loop, MoE dispatchers and torch_dist checkpointing
on CPU processes joined by gloo, for machines without a GPU (tests, smoke runs).

megatron-core assumes CUDA in about 80 places on the training and checkpoint path
(`torch.cuda.current_device()`, `device='cuda'`, `.cuda()`, streams, events, RNG). Patching them
one by one is not maintainable, so this module presents one virtual CUDA device that is really
the CPU:

* a TorchFunctionMode rewrites every CUDA device argument (and `.cuda()`) to the CPU;
* the `torch.cuda` runtime calls megatron makes get CPU stand-ins (one device, no-op streams,
  events that time with the wall clock, the CPU generator standing in for the CUDA generator);
* a few megatron helpers and gloo gaps are bridged, each explained where it is set.

It is never activated when CUDA is available: `activate()` refuses.

Strict device mode (`MEGATRON_PATCHES_STRICT_DEVICE=1`, which the test suite sets for itself and
every process it launches): on a GPU cluster megatron's default process group, and every group
created without `backend="gloo"`, is NCCL, which refuses a host tensor; gloo accepts one, so such
a bug passes every CPU run and kills every GPU run. In strict mode tensors known to live on the
host (see `_StrictCudaToCpu`) are refused by the tensor collectives on those groups, with an
error naming the collective.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import os
import sys
import time
import types

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # megatron passes torch.cuda.current_device() (an int) as a device.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA placements to the CPU for every torch call made while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron asserts fp32 grads by comparing type names to 'torch.cuda.FloatTensor'.
            return _CUDA_TYPE_NAMES.get(args[0].dtype, func(*args))
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:  # .to("cuda") / .to(0): the device is positional
            args = tuple("cpu" if _is_cuda_device(a) else a for a in args)
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Strict device mode: which tensors are on the host, and which collectives refuse them.
# ---------------------------------------------------------------------------------------------

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
    if _is_cuda_device(device):
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


class _StrictCudaToCpu(_CudaToCpu):
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
                    "Create the tensor on torch.cuda.current_device() (megatron_patches/"
                    "collectives.py) or use a gloo group.")


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


def _strict_collectives() -> None:
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


class _Stream:
    """A CUDA stream stand-in: CPU work is already ordered, so every method is a no-op."""

    def __init__(self, *args, **kwargs):
        self.device = torch.device("cpu")

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _Stream)

    def __hash__(self):
        return 0


class _Event:
    """A CUDA event stand-in that times with the wall clock (used by megatron's timers)."""

    def __init__(self, *args, **kwargs):
        self._time = None

    def record(self, stream=None):
        self._time = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, end: "_Event") -> float:
        return (end._time - self._time) * 1000.0


def _device_properties(device=None):
    return types.SimpleNamespace(
        name="cpu", major=0, minor=0, total_memory=0, multi_processor_count=os.cpu_count() or 1
    )


def _eager_compile(model=None, **options):
    return model if model is not None else (lambda fn: fn)


def _returns(value):
    # A distinct function per stand-in: torch._dynamo indexes torch.cuda's functions by identity
    # and rejects one object registered under two names.
    return lambda *args, **kwargs: value


# Stand-ins for the torch.cuda runtime: one virtual device (process groups and model-parallel
# seeds are only set up by megatron when a device is counted), the CPU generator as its RNG.
_CUDA_RUNTIME = {
    "device_count": _returns(1),
    "current_device": _returns(0),
    "set_device": _returns(None),
    "synchronize": _returns(None),
    "empty_cache": _returns(None),
    "is_current_stream_capturing": _returns(False),
    "current_stream": lambda device=None: _Stream(),
    "default_stream": lambda device=None: _Stream(),
    "Stream": _Stream,
    "Event": _Event,
    "stream": lambda stream=None: contextlib.nullcontext(),
    "set_stream": _returns(None),
    "memory_allocated": _returns(0),
    "memory_reserved": _returns(0),
    "max_memory_allocated": _returns(0),
    "max_memory_reserved": _returns(0),
    "reset_peak_memory_stats": _returns(None),
    "memory_stats": lambda device=None: {},
    "get_device_properties": _device_properties,
    "get_device_name": _returns("cpu"),
    "get_device_capability": _returns((0, 0)),
    "get_rng_state": lambda device="cuda": torch.get_rng_state(),
    "set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
    "manual_seed": lambda seed: torch.default_generator.manual_seed(seed),
    # torch.manual_seed calls this after seeding the CPU generator, which is all there is.
    "manual_seed_all": _returns(None),
}
_NVTX = {"range_push": _returns(None), "range_pop": _returns(None), "mark": _returns(None)}


def _move_to_cpu(tensor, as_numpy=False, record_stream=False):
    # moe_utils.maybe_move_tensor_to_cpu only converts CUDA tensors; on CPU the token
    # dispatcher would then pass tensors as all_to_all split sizes, which gloo rejects.
    if torch.is_tensor(tensor):
        return tensor.numpy() if as_numpy else tensor
    return tensor


def _all_gather_uneven(all_gather):
    """gloo's all_gather needs equal shapes; pad uneven MoE token chunks to the largest."""

    @functools.wraps(all_gather)
    def gather(tensor_list, tensor, group=None, async_op=False):
        sizes = [t.shape[0] for t in tensor_list]
        if len(set(sizes)) == 1 and tensor.shape[0] == sizes[0]:
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(sizes)
        padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype)
        padded[: tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in tensor_list]
        all_gather(gathered, padded, group=group)
        for out, full, size in zip(tensor_list, gathered, sizes):
            out.copy_(full[:size])
        return None

    return gather


def _reduce_scatter_uneven(reduce_scatter, all_reduce):
    """gloo has no reduce_scatter: all-reduce the whole input and keep this rank's slice."""

    @functools.wraps(reduce_scatter)
    def reduce_scatter_via_all_reduce(output, input_list, op=dist.ReduceOp.SUM, group=None,
                                      async_op=False):
        sizes = [t.shape[0] for t in input_list]
        full = torch.cat(input_list, dim=0).contiguous()
        all_reduce(full, op=op, group=group)
        start = sum(sizes[: dist.get_rank(group)])
        output.copy_(full[start : start + output.shape[0]])
        return None

    return reduce_scatter_via_all_reduce


_MODE: _CudaToCpu | None = None


def activate() -> None:
    """Installs the CPU backend for this process (idempotent). Refuses where CUDA exists."""
    global _MODE
    if _MODE is not None:
        return
    if torch.cuda.is_available():
        raise RuntimeError("the CPU backend must not run where CUDA is available")
    # megatron's jit_fuser is torch.compile, applied when megatron.core is imported: on CPU it
    # recompiles for every new MoE token count (seconds per iteration). Hence activate() must run
    # before megatron is imported, and torch.compile runs functions eagerly here.
    if "megatron.core" in sys.modules:
        raise RuntimeError("cpu_backend.activate() must run before megatron.core is imported")
    torch.compile = _eager_compile
    for name, stand_in in _CUDA_RUNTIME.items():
        setattr(torch.cuda, name, stand_in)
    torch.cuda.random.get_rng_state = _CUDA_RUNTIME["get_rng_state"]
    torch.cuda.random.set_rng_state = _CUDA_RUNTIME["set_rng_state"]
    for name, stand_in in _NVTX.items():
        setattr(torch.cuda.nvtx, name, stand_in)
    # The bridges hold torch's own functions; strict mode wraps them from outside.
    dist.all_gather = _all_gather_uneven(dist.all_gather)
    dist.reduce_scatter = _reduce_scatter_uneven(dist.reduce_scatter, dist.all_reduce)
    strict = strict_device()
    if strict:
        _strict_collectives()
    _refuse_cuda_extensions()
    _meshes_on_cpu()
    _patch_megatron()
    _MODE = _StrictCudaToCpu() if strict else _CudaToCpu()
    _MODE.__enter__()


def _refuse_cuda_extensions() -> None:
    """megatron-core 0.15.x compiles a CUDA extension on import and catches only RuntimeError;
    without CUDA torch's builder fails with an IndexError, so refuse CUDA builds cleanly."""
    from torch.utils import cpp_extension

    load_inline = cpp_extension.load_inline

    @functools.wraps(load_inline)
    def load_inline_without_cuda(*args, **kwargs):
        if kwargs.get("with_cuda") or kwargs.get("cuda_sources"):
            raise RuntimeError("CPU backend: CUDA extensions are not built")
        return load_inline(*args, **kwargs)

    cpp_extension.load_inline = load_inline_without_cuda


def _meshes_on_cpu() -> None:
    """Megatron-FSDP builds its DeviceMesh on "cuda"; DTensor would then look for a GPU."""
    from torch.distributed.device_mesh import DeviceMesh

    from_group = DeviceMesh.from_group

    @functools.wraps(from_group)
    def from_group_on_cpu(group, device_type, *args, **kwargs):
        return from_group(group, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    DeviceMesh.from_group = staticmethod(from_group_on_cpu)


def _scaling_without_premul_sum(gradient_reduce_preprocessing):
    """gloo has no PREMUL_SUM (Megatron-FSDP's fused gradient division for non-bf16 grads):
    scale the gradient first, then SUM, which is the arithmetic NCCL's PREMUL_SUM does."""

    @functools.wraps(gradient_reduce_preprocessing)
    def preprocess(grad_data, scaling_factor, ddp_config):
        reduce_op = gradient_reduce_preprocessing(grad_data, scaling_factor, ddp_config)
        if reduce_op == dist.ReduceOp.PREMUL_SUM:
            grad_data.mul_(scaling_factor)
            return dist.ReduceOp.SUM
        return reduce_op

    return preprocess


def _patch_megatron_fsdp() -> None:
    """Bridges between what Megatron-FSDP asks of its process groups and what gloo does."""
    try:
        from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer
    except ImportError:
        return  # no Megatron-FSDP in this megatron-core
    buffers = param_and_grad_buffer
    if hasattr(buffers, "gradient_reduce_preprocessing"):
        buffers.gradient_reduce_preprocessing = _scaling_without_premul_sum(
            buffers.gradient_reduce_preprocessing)


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import token_dispatcher

    _patch_megatron_fsdp()

    # The model-parallel RNG tracker swaps "CUDA" generator states; the CPU generator is ours.
    tp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    tp_random._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: (
        torch.set_rng_state(state)
    )
    token_dispatcher.maybe_move_tensor_to_cpu = _move_to_cpu
    if importlib.util.find_spec("megatron.training") is None:
        return  # megatron-core 0.15.x wheels ship no megatron.training (no pretrain())
    from megatron.training import training

    # pretrain() asserts CUDA unless initialize_megatron is told that no CUDA is fine.
    training.initialize_megatron = functools.partial(training.initialize_megatron,
                                                     allow_no_cuda=True)
