"""CPU backend: runs megatron-core's training loop, MoE dispatchers and torch_dist checkpointing
on CPU processes joined by gloo, for machines without a GPU (tests, smoke runs).

megatron-core assumes CUDA in about 80 places on the training and checkpoint path
(`torch.cuda.current_device()`, `device='cuda'`, `.cuda()`, streams, events, RNG). Patching them
one by one is not maintainable, so this package presents one virtual CUDA device that is really
the CPU:

* a TorchFunctionMode rewrites every CUDA device argument (and `.cuda()`) to the CPU;
* the `torch.cuda` runtime calls megatron makes get CPU stand-ins (one device, no-op streams,
  events that time with the wall clock, a generator of the device's own that the random ops
  meant for the device draw from);
* a few megatron helpers and gloo gaps are bridged, each explained where it is set.

It is never activated when CUDA is available: `activate()` refuses.

Strict device mode (`MEGATRON_PATCHES_STRICT_DEVICE=1`, which the test suite sets for itself and
every process it launches): on a GPU cluster megatron's default process group, and every group
created without `backend="gloo"`, is NCCL, which refuses a host tensor; gloo accepts one, so such
a bug passes every CPU run and kills every GPU run. In strict mode tensors known to live on the
host (see `cuda_emulation.CudaToCpu`) are refused by the tensor collectives on those groups, with an
error naming the collective.
"""

from __future__ import annotations

import functools
import importlib.util
import sys

import torch
import torch.distributed as dist

from moe_launcher.cpu_backend.cuda_emulation import (
    CUDA_GENERATOR,
    CUDA_RUNTIME,
    NVTX,
    CudaToCpu,
    eager_compile,
    parameters_keep_placement,
)
from moe_launcher.cpu_backend.fallback_warnings import fallback_warnings_from_rank_0_only
from moe_launcher.cpu_backend.gloo_bridges import (
    all_gather_uneven,
    meshes_on_cpu,
    move_to_cpu,
    patch_megatron_fsdp,
    reduce_scatter_uneven,
)
from moe_launcher.cpu_backend.strict_device import (
    STRICT_DEVICE_ENV,
    strict_collectives,
    strict_device,
)


__all__ = ["STRICT_DEVICE_ENV", "activate", "fallback_warnings_from_rank_0_only",
           "strict_device"]

_MODE: CudaToCpu | None = None


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
    torch.compile = eager_compile
    for name, stand_in in CUDA_RUNTIME.items():
        setattr(torch.cuda, name, stand_in)
    torch.cuda.random.get_rng_state = CUDA_RUNTIME["get_rng_state"]
    torch.cuda.random.set_rng_state = CUDA_RUNTIME["set_rng_state"]
    for name, stand_in in NVTX.items():
        setattr(torch.cuda.nvtx, name, stand_in)
    # The bridges hold torch's own functions; strict mode wraps them from outside.
    dist.all_gather = all_gather_uneven(dist.all_gather)
    dist.reduce_scatter = reduce_scatter_uneven(dist.reduce_scatter, dist.all_reduce)
    strict = strict_device()
    if strict:
        strict_collectives()
    _refuse_cuda_extensions()
    meshes_on_cpu()
    _patch_megatron()
    parameters_keep_placement()
    _MODE = CudaToCpu()
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


def _patch_megatron() -> None:
    from megatron.core.distributed.fsdp.src.megatron_fsdp import utils as fsdp_utils
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import token_dispatcher

    patch_megatron_fsdp()

    # The RNG trackers set the device generator's state through this (they read it through
    # torch.cuda.random.get_rng_state, replaced above); megatron's own goes through
    # torch.cuda._lazy_call, which without CUDA queues the call and never runs it.
    for rng_module in (tp_random, fsdp_utils):
        rng_module._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: (
            CUDA_GENERATOR.set_state(state))
    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu
    if importlib.util.find_spec("megatron.training") is None:
        return  # megatron-core 0.15.x wheels ship no megatron.training (no pretrain())
    from megatron.training import training

    # pretrain() asserts CUDA unless initialize_megatron is told that no CUDA is fine.
    training.initialize_megatron = functools.partial(training.initialize_megatron,
                                                     allow_no_cuda=True)
