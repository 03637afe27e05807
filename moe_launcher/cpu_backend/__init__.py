"""CPU backend: runs megatron-core's training loop, MoE dispatchers and torch_dist checkpointing
on CPU processes joined by gloo, for machines without a GPU (tests, smoke runs).

megatron-core assumes CUDA in about 80 places on the training and checkpoint path
(`torch.cuda.current_device()`, `device='cuda'`, `.cuda()`, streams, events, RNG). Patching them
one by one is not maintainable, so this package presents one virtual CUDA device that is really
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
host (see `StrictCudaToCpu`) are refused by the tensor collectives on those groups, with an
error naming the collective.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys

import torch
import torch.distributed as dist

from moe_launcher.cpu_backend.cuda_emulation import CUDA_RUNTIME, NVTX, CudaToCpu, eager_compile
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
    StrictCudaToCpu,
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
    _MODE = StrictCudaToCpu() if strict else CudaToCpu()
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


# megatron's RNG trackers warn when the CPU generator's state changed inside a fork of the CUDA
# generator. Here the CUDA generator is the CPU one (see _patch_megatron), so every draw inside
# a fork changes it: the warning is this backend's doing, hundreds of lines a run. Dropped at
# these loggers, this one message only; said once (rank 0), the first time it is dropped.
RNG_CONTEXT_WARNING = "CPU RNG state changed within GPU RNG context"
RNG_CONTEXT_LOGGERS = ("megatron.core.tensor_parallel.random",
                       "megatron.core.distributed.fsdp.src.megatron_fsdp.utils",
                       "megatron_fsdp.utils")
RNG_CONTEXT_NOTE = (f"[cpu_backend] megatron's warning '{RNG_CONTEXT_WARNING}' is silenced: on "
                    "CPU the CUDA generator is the CPU generator, so every random draw inside "
                    "megatron's RNG tracker changes the CPU state")


class _RngContextWarningFilter(logging.Filter):
    def __init__(self):
        super().__init__()
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != RNG_CONTEXT_WARNING:
            return True
        if not self.said:
            self.said = True
            if os.environ.get("RANK", "0") == "0":
                print(RNG_CONTEXT_NOTE, flush=True)
        return False


def _silence_rng_context_warning() -> None:
    dropped = _RngContextWarningFilter()
    for name in RNG_CONTEXT_LOGGERS:
        logging.getLogger(name).addFilter(dropped)


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import token_dispatcher

    patch_megatron_fsdp()

    # The model-parallel RNG tracker swaps "CUDA" generator states; the CPU generator is ours.
    tp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    tp_random._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: (
        torch.set_rng_state(state)
    )
    _silence_rng_context_warning()
    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu
    if importlib.util.find_spec("megatron.training") is None:
        return  # megatron-core 0.15.x wheels ship no megatron.training (no pretrain())
    from megatron.training import training

    # pretrain() asserts CUDA unless initialize_megatron is told that no CUDA is fine.
    training.initialize_megatron = functools.partial(training.initialize_megatron,
                                                     allow_no_cuda=True)
    training.set_jit_fusion_options = _warmup_off_the_cpu_generator(
        training.set_jit_fusion_options)


def _warmup_off_the_cpu_generator(set_jit_fusion_options):
    """megatron's JIT warm-up (pretrain() calls it after seeding, before building the model)
    draws `torch.rand(..., device="cuda")` tensors sized by --micro-batch-size and runs dropout
    on them. On a GPU those draws move the CUDA generator only, and --use-cpu-initialization
    then draws the weights from the CPU generator where the seed put it. Here the two are one
    generator, so the warm-up would make the initial weights depend on --micro-batch-size: it
    runs on a fork of the generator instead, so the CPU side is as on a GPU (the stand-in CUDA
    generator is then not moved either, where a GPU's is)."""

    @functools.wraps(set_jit_fusion_options)
    def set_jit_fusion_options_on_a_fork(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return set_jit_fusion_options(*args, **kwargs)

    return set_jit_fusion_options_on_a_fork
