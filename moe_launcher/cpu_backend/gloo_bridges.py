"""What gloo and CPU tensors lack and megatron asks for: uneven all-gathers and reduce-scatters
(MoE token chunks), split sizes as host lists, DeviceMeshes on "cpu", PREMUL_SUM, and parameter
all-gathers that are done when they return. Each bridge gives the result NCCL would give on a GPU.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist


def move_to_cpu(tensor, as_numpy=False, record_stream=False):
    # moe_utils.maybe_move_tensor_to_cpu only converts CUDA tensors; on CPU the token
    # dispatcher would then pass tensors as all_to_all split sizes, which gloo rejects.
    if torch.is_tensor(tensor):
        return tensor.numpy() if as_numpy else tensor
    return tensor


def all_gather_uneven(all_gather):
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


def reduce_scatter_uneven(reduce_scatter, all_reduce):
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


def meshes_on_cpu() -> None:
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


def _gathers_done_on_return(coalescing_manager):
    """Megatron-FSDP's asynchronous parameter all-gathers, done before the call returns.

    Megatron-FSDP (megatron-core 0.19.2) issues each step's parameter all-gathers as one
    coalesced asynchronous collective and waits on it only when a module needs the weights, so
    that NCCL gathers the next module's weights while the GPU computes the current one. gloo runs
    such a collective's tensor work (flattening the shards, copying into the bucket) on its own
    worker threads, beside the rank's Python thread; bf16 Megatron-FSDP training on 2 CPU ranks
    then died of a corrupted heap (glibc: "malloc(): unaligned tcache chunk detected", "free():
    invalid pointer") anywhere in the step: 5 of 45 runs of 40 iterations, against 0 of 53 with
    the gathers done on return (this wait, or megatron's own async_param_gather=False). A probe
    that watched every main-thread op while a gather was pending found none touching its buckets
    or shards, so megatron waits where NCCL needs it to; what corrupts the heap is the overlap on
    gloo's threads, which the CPU has no use for. The gathers, buckets and waits stay megatron's:
    only the wait comes first."""

    @contextlib.contextmanager
    def coalesced_then_waited(group=None, device=None, async_ops=False):
        with coalescing_manager(group, device=device, async_ops=async_ops) as manager:
            yield manager
        if async_ops:
            manager.wait()

    return coalesced_then_waited


def patch_megatron_fsdp() -> None:
    """Bridges between what Megatron-FSDP asks of its process groups and what gloo does."""
    try:
        from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer
    except ImportError:
        return  # no Megatron-FSDP in this megatron-core
    buffers = param_and_grad_buffer
    buffers._coalescing_manager = _gathers_done_on_return(buffers._coalescing_manager)
    if hasattr(buffers, "gradient_reduce_preprocessing"):
        buffers.gradient_reduce_preprocessing = _scaling_without_premul_sum(
            buffers.gradient_reduce_preprocessing)
