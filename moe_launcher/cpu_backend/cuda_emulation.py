"""One virtual CUDA device that is really the CPU.

megatron-core assumes CUDA in about 80 places on the training and checkpoint path
(`torch.cuda.current_device()`, `device='cuda'`, `.cuda()`, streams, events, RNG). Patching them
one by one is not maintainable, so this module presents one virtual CUDA device that is really
the CPU:

* a TorchFunctionMode rewrites every CUDA device argument (and `.cuda()`) to the CPU;
* the `torch.cuda` runtime calls megatron makes get CPU stand-ins (one device, no-op streams,
  events that time with the wall clock, the CPU generator standing in for the CUDA generator);
"""

from __future__ import annotations

import contextlib
import os
import time
import types

import torch
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


class CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA placements to the CPU for every torch call made while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron asserts fp32 grads by comparing type names to 'torch.cuda.FloatTensor'.
            return _CUDA_TYPE_NAMES.get(args[0].dtype, func(*args))
        if is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:  # .to("cuda") / .to(0): the device is positional
            args = tuple("cpu" if is_cuda_device(a) else a for a in args)
        return func(*args, **kwargs)


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


def _returns(value):
    # A distinct function per stand-in: torch._dynamo indexes torch.cuda's functions by identity
    # and rejects one object registered under two names.
    return lambda *args, **kwargs: value


# Stand-ins for the torch.cuda runtime: one virtual device (process groups and model-parallel
# seeds are only set up by megatron when a device is counted), the CPU generator as its RNG.
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


NVTX = {"range_push": _returns(None), "range_pop": _returns(None), "mark": _returns(None)}
