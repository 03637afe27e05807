"""CPU backend for the legacy track (megatron-core 0.15.x).

`cpu_backend` presents one virtual CUDA device that is really the CPU; its torch-level stand-ins
work unchanged on 0.15.x. Only its megatron hooks differ: the 0.15.x wheel ships `megatron.core`
without `megatron.training`, so there is no `pretrain()` to relax. This module swaps in the
legacy hooks and then runs `cpu_backend.activate()` (which stays the single switch: `active()`
answers for both). Like `cpu_backend.activate()`, call it before megatron is imported.

megatron-core 0.15.x also compiles a CUDA extension (a managed-memory allocator for inference)
when `megatron.core` is imported; without a GPU torch's builder fails with an IndexError megatron
does not catch, so CUDA extension builds raise the RuntimeError megatron expects instead.

Megatron-FSDP additionally builds its DeviceMesh with `device_type="cuda"`; DTensor would then
look for a real CUDA device, so meshes asked for on "cuda" are built on "cpu".
"""

from __future__ import annotations

import functools

import torch

from megatron_patches import cpu_backend


def _patch_megatron_legacy() -> None:
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import token_dispatcher

    tp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    tp_random._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: (
        torch.set_rng_state(state)
    )
    token_dispatcher.maybe_move_tensor_to_cpu = cpu_backend._move_to_cpu
    _meshes_on_cpu()


def _meshes_on_cpu() -> None:
    from torch.distributed.device_mesh import DeviceMesh

    if getattr(DeviceMesh.from_group, "_cpu_backend_legacy", False):
        return
    from_group = DeviceMesh.from_group  # a staticmethod in torch 2.x

    @functools.wraps(from_group)
    def from_group_on_cpu(group, device_type, *args, **kwargs):
        if device_type == "cuda":
            device_type = "cpu"
        return from_group(group, device_type, *args, **kwargs)

    from_group_on_cpu._cpu_backend_legacy = True
    DeviceMesh.from_group = staticmethod(from_group_on_cpu)


def _no_cuda_extensions() -> None:
    from torch.utils import cpp_extension

    if getattr(cpp_extension.load_inline, "_cpu_backend_legacy", False):
        return
    load_inline = cpp_extension.load_inline

    @functools.wraps(load_inline)
    def load_inline_without_cuda(*args, **kwargs):
        if kwargs.get("with_cuda") or kwargs.get("cuda_sources"):
            raise RuntimeError("CPU backend: CUDA extensions are not built")
        return load_inline(*args, **kwargs)

    load_inline_without_cuda._cpu_backend_legacy = True
    cpp_extension.load_inline = load_inline_without_cuda


def activate() -> None:
    """Installs the CPU backend for megatron-core 0.15.x (idempotent)."""
    if cpu_backend.active():
        return
    _no_cuda_extensions()
    cpu_backend._patch_megatron = _patch_megatron_legacy
    cpu_backend.activate()
