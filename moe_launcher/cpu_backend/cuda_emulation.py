"""One virtual CUDA device that is really the CPU.

megatron-core assumes CUDA in about 80 places on the training and checkpoint path
(`torch.cuda.current_device()`, `device='cuda'`, `.cuda()`, streams, events, RNG). Patching them
one by one is not maintainable, so this module presents one virtual CUDA device that is really
the CPU:

* a TorchFunctionMode rewrites every CUDA device argument (and `.cuda()`) to the CPU, and tags
  the tensors that would be host tensors on a GPU;
* the virtual device has a generator of its own (`CUDA_GENERATOR`): a random op draws from it
  unless it would run on the host on a GPU, so the CPU generator moves only where a GPU's CPU
  generator would (e.g. `--use-cpu-initialization`), and a restore of one state cannot pass
  for a restore of the other;
* the `torch.cuda` runtime calls megatron makes get CPU stand-ins (one device, no-op streams,
  events that time with the wall clock, `CUDA_GENERATOR` as the device's generator).
"""

from __future__ import annotations

import contextlib
import os
import time
import types

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # megatron passes torch.cuda.current_device() (an int) as a device.
    return isinstance(device, int) and not isinstance(device, bool)


# Where a tensor would be on a GPU. Every tensor here is a CPU tensor, so the ones known to be
# host tensors on a GPU carry this attribute; the rest would be on the device (or unknown).
_HOST = "_cpu_backend_host"


# Factories that, given no device, allocate on the host (torch's default device) on a GPU too.
_HOST_FACTORIES = frozenset({
    torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy, torch.frombuffer,
    torch.scalar_tensor, torch.zeros, torch.ones, torch.empty, torch.empty_strided, torch.full,
    torch.arange, torch.linspace, torch.logspace, torch.eye, torch.rand, torch.randn,
    torch.randint, torch.randperm, torch.normal,
})


_TO_HOST = frozenset({torch.Tensor.cpu, torch.Tensor.pin_memory})


def is_host_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and getattr(value, _HOST, False)


def _mark_host(result) -> None:
    for tensor in result if isinstance(result, (tuple, list)) else (result,):
        if isinstance(tensor, torch.Tensor):
            setattr(tensor, _HOST, True)


def _forget_host(tensor) -> None:
    if getattr(tensor, _HOST, False):
        delattr(tensor, _HOST)


_SET_DATA = torch.Tensor.data.__set__  # a new method-wrapper at each lookup: compare with ==


def parameters_keep_placement() -> None:
    """torch.nn.Parameter(t) makes a new tensor object without any torch call a mode sees, so
    a parameter made of a host tensor (megatron's router weight, whatever the init flags; a
    torch.nn.Linear) would lose the tag its initialisation draws by: it keeps it here."""
    make = torch.nn.Parameter.__new__

    def new_parameter(cls, data=None, requires_grad=True):
        parameter = make(cls, data, requires_grad)
        if data is None or is_host_tensor(data):  # None: torch.empty(0), made on the host
            setattr(parameter, _HOST, True)
        return parameter

    torch.nn.Parameter.__new__ = staticmethod(new_parameter)


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


def _on_host(placement: str | None, args, kwargs) -> bool:
    """Whether a call's result is a host tensor on a GPU (`placement`: what it asks for)."""
    return placement == "host" or (placement is None and _inputs_all_host(args, kwargs))


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


# The virtual device's generator: torch.cuda's RNG calls (and megatron's RNG trackers, through
# them) read and set it; random ops that would run on the device draw from it.
CUDA_GENERATOR = torch.Generator()


# The calls that draw from torch's default generator, as a TorchFunctionMode sees them: the
# outermost call only (nn.init and functional ops reach the mode before their inner ops).
RANDOM_OPS = frozenset({
    torch.rand, torch.rand_like, torch.randn, torch.randn_like, torch.randint,
    torch.randint_like, torch.randperm, torch.normal, torch.bernoulli, torch.multinomial,
    torch.poisson, torch.binomial, torch.dropout, torch.alpha_dropout, torch.feature_dropout,
    torch.feature_alpha_dropout, torch.native_dropout, torch.rrelu, torch.rrelu_,
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli, torch.Tensor.bernoulli_,
    torch.Tensor.random_, torch.Tensor.exponential_, torch.Tensor.geometric_,
    torch.Tensor.log_normal_, torch.Tensor.cauchy_, torch.Tensor.multinomial,
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
    F.rrelu, F.gumbel_softmax, F.scaled_dot_product_attention,
    torch.nn.init.uniform_, torch.nn.init.normal_, torch.nn.init.trunc_normal_,
    torch.nn.init.xavier_uniform_, torch.nn.init.xavier_normal_, torch.nn.init.kaiming_uniform_,
    torch.nn.init.kaiming_normal_, torch.nn.init.orthogonal_, torch.nn.init.sparse_,
})


@contextlib.contextmanager
def _drawing_from(generator: torch.Generator):
    """Runs a random op on `generator`'s stream: its state is lent to the default generator
    for the call, and the default generator's own state is put back afterwards."""
    host_state = torch.default_generator.get_state()
    torch.default_generator.set_state(generator.get_state())
    try:
        yield
    finally:
        generator.set_state(torch.default_generator.get_state())
        torch.default_generator.set_state(host_state)


def _backward_in_mode(mode: TorchFunctionMode, tensors, grad_tensors=None, retain_graph=None,
                      create_graph=False, inputs=None) -> None:
    """torch.autograd.backward (or Tensor.backward) with `mode` active while the engine runs
    the backward functions.

    A torch function mode is off while its own handler runs, and both backward calls dispatch
    to it: the backward functions they run, and a backward started inside a backward
    (megatron's activation recompute, tensor_parallel.random.CheckpointFunction), would run
    without the CPU backend, so a backward op naming the CUDA device (the MoE all-to-all's
    `new_empty(device=current_device())`) fails and a recomputed dropout draws from the host
    generator. The mode is put back around the engine's run, past backward's own dispatch
    (which would hand the call to the mode again)."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    if inputs is not None:
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    with mode:
        grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)),
                            is_grads_batched=False)
        _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph,
                             create_graph, inputs or (), allow_unreachable=True,
                             accumulate_grad=True)


# The calls __torch_function__ treats otherwise than by its first branch, and the type of
# `_SET_DATA` (a method-wrapper, compared by ==).
_HANDLED = frozenset({torch.autograd.backward, torch.Tensor.backward, torch.Tensor.cuda,
                      torch.Tensor.type, torch.Tensor.to, *_TO_HOST, *_HOST_FACTORIES,
                      *RANDOM_OPS})
_METHOD_WRAPPER = type(_SET_DATA)


class CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA placements to the CPU for every torch call made while active; tags the
    tensors that would be host tensors on a GPU; draws the virtual device's random numbers
    from CUDA_GENERATOR.

    A tensor is tagged as a host tensor when a factory makes it without a device, by
    .cpu()/.pin_memory(), or by an op all of whose tensor inputs are tagged and that names no
    device; .cuda()/.to("cuda") clear the tag. Anything else is not known to be on the host,
    and counts as on the device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in _HANDLED and not (kwargs and "device" in kwargs) \
                and type(func) is not _METHOD_WRAPPER:
            # Most calls (megatron's and torch's own ops inside a step, thousands a step): they
            # name no device and draw no random numbers, so only the host tag can follow them.
            result = func(*args, **kwargs) if kwargs else func(*args)
            if (isinstance(result, torch.Tensor) or (type(result) in (tuple, list) and result
                                                     and isinstance(result[0], torch.Tensor))) \
                    and _inputs_all_host(args, kwargs):
                _mark_host(result)
            return result
        kwargs = dict(kwargs or {})
        if func is torch.autograd.backward:
            return _backward_in_mode(self, *args, **kwargs)
        if func is torch.Tensor.backward:  # (self, gradient, retain_graph, create_graph, inputs)
            if "gradient" in kwargs:
                kwargs["grad_tensors"] = kwargs.pop("gradient")
            return _backward_in_mode(self, *args, **kwargs)
        if func is torch.Tensor.cuda:
            _forget_host(args[0])
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron asserts fp32 grads by comparing type names to 'torch.cuda.FloatTensor'.
            return _CUDA_TYPE_NAMES.get(args[0].dtype, func(*args))
        if type(func) is _METHOD_WRAPPER and func == _SET_DATA:
            # `tensor.data = other`: the tensor is now where `other` is
            _forget_host(args[0])
            if is_host_tensor(args[1]):
                setattr(args[0], _HOST, True)
            return func(*args)
        placement = _requested_placement(func, args, kwargs)
        if is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:  # .to("cuda") / .to(0): the device is positional
            args = tuple("cpu" if is_cuda_device(a) else a for a in args)
        if func in RANDOM_OPS and kwargs.get("generator") is None \
                and not _on_host(placement, args, kwargs):
            with _drawing_from(CUDA_GENERATOR):
                result = func(*args, **kwargs)
        else:
            result = func(*args, **kwargs)
        if not isinstance(result, torch.Tensor) and not (
                type(result) in (tuple, list) and result and isinstance(result[0], torch.Tensor)):
            return result  # sizes, dtypes, numbers
        if _on_host(placement, args, kwargs):
            _mark_host(result)
        elif placement == "cuda" and func is torch.Tensor.to:
            _forget_host(result)  # .to("cuda") of a tensor already "there" returns the tensor
        return result


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


def eager_compile(model=None, **options):
    return model if model is not None else (lambda fn: fn)


def _seed_device_generator(seed: int) -> None:
    """Seeds CUDA_GENERATOR so that it does not draw what the CPU generator draws from the same
    seed (on a GPU the two are different algorithms; here both would be torch's CPU one)."""
    CUDA_GENERATOR.manual_seed((int(seed) ^ _DEVICE_SEED_MIX) & 0xFFFF_FFFF_FFFF_FFFF)


_DEVICE_SEED_MIX = 0x9E37_79B9_7F4A_7C15  # any fixed 64-bit pattern


def _memory_stats(device=None) -> dict:
    """torch.cuda.memory_stats' keys (the caching allocator's, as torch documents them), all 0,
    as memory_allocated() and its kin are here: megatron's --log-memory-to-tensorboard reads
    several by name."""
    pools = ("all", "large_pool", "small_pool")
    amounts = ("current", "peak", "allocated", "freed")
    families = ("allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
                "requested_bytes", "allocation", "segment", "active", "inactive_split")
    stats = {f"{family}.{pool}.{amount}": 0
             for family in families for pool in pools for amount in amounts}
    stats.update({f"{family}.{amount}": 0 for family in ("oversize_allocations",
                                                         "oversize_segments")
                  for amount in amounts})
    stats.update(dict.fromkeys(("num_alloc_retries", "num_ooms", "num_sync_all_streams",
                                "num_device_alloc", "num_device_free", "max_split_size"), 0))
    return stats


def _returns(value):
    # A distinct function per stand-in: torch._dynamo indexes torch.cuda's functions by identity
    # and rejects one object registered under two names.
    return lambda *args, **kwargs: value


# Stand-ins for the torch.cuda runtime: one virtual device (process groups and model-parallel
# seeds are only set up by megatron when a device is counted), CUDA_GENERATOR as its RNG.
CUDA_RUNTIME = {
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
    "memory_stats": _memory_stats,
    "get_device_properties": _device_properties,
    "get_device_name": _returns("cpu"),
    "get_device_capability": _returns((0, 0)),
    "get_rng_state": lambda device="cuda": CUDA_GENERATOR.get_state(),
    "set_rng_state": lambda state, device="cuda": CUDA_GENERATOR.set_state(state),
    "manual_seed": lambda seed: _seed_device_generator(seed),
    # torch.manual_seed seeds every device's generator through this, as on a GPU.
    "manual_seed_all": lambda seed: _seed_device_generator(seed),
    "default_generators": (CUDA_GENERATOR,),
}


NVTX = {"range_push": _returns(None), "range_pop": _returns(None), "mark": _returns(None)}
