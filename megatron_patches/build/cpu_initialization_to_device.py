"""A model initialised on the CPU (`--use-cpu-initialization`) is moved to the GPU.

`--use-cpu-initialization` makes megatron draw the weights on the CPU, the whole matrix then the
rank's shard, so they do not depend on the tensor-parallel layout. megatron's `get_model` then
moves the model to the GPU (skipped only for Torch FSDP2, which places it itself). megatron-core
0.19.2 builds the model through its config-container builder
(`megatron.training.models.dist_utils.prepare_existing_model_chunks_for_distributed_training`,
what `pretrain()` takes when given a config container, as pretrain_moe.py gives it), which moves
it only when `use_cpu_initialization` is off: the parameters and buffers stay on the CPU. On a GPU
the first forward then fails on every rank (CUDA inputs, CPU weights), or with the distributed
optimizer, whose buffers take the parameters to the GPU, on the buffers left behind (the
router's expert bias). Under the CPU backend the parameters kept their host tag, which the
suite's strict-device check refused in Muon's tensor-parallel all-gather.

The patch moves each model chunk to the current device before megatron's builder goes on, as
`get_model` does (not for Torch FSDP2, nor for a model made on the meta device). Needed where
megatron's builder leaves a CPU-initialised chunk where it was. Targets 0.19.x.
"""

from __future__ import annotations

import functools
import inspect
import types

import torch

from megatron_patches.registry import Patch, register

NAME = "cpu-initialization-to-device"


class _MovedChunk(torch.nn.Module):
    """A model chunk that records whether it was moved to the GPU."""

    moved = False

    def cuda(self, device=None):
        self.moved = True
        return self


class _Rank:
    def __init__(self, rank: int):
        self._rank = rank

    def rank(self) -> int:
        return self._rank


def _not_needed_because(context):
    try:
        from megatron.training.models import dist_utils
    except ImportError:
        return "megatron builds models through get_model only, which moves them"
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                               use_cpu_initialization=True)
    chunk = _MovedChunk()
    # (a data-parallel rank other than 0: megatron's builder prints nothing for it)
    groups = types.SimpleNamespace(dp=_Rank(1), cp=_Rank(0), tp=_Rank(0), pp=_Rank(0),
                                   gtp_remat=None)
    dist_utils.prepare_existing_model_chunks_for_distributed_training(
        [chunk], config, groups, wrap_with_ddp=False, mixed_precision_wrapper=None)
    if chunk.moved:
        return "megatron's model builder moves a CPU-initialised model to the GPU"
    return None


def _apply():
    from megatron.training.models import dist_utils

    prepare = dist_utils.prepare_existing_model_chunks_for_distributed_training
    signature = inspect.signature(prepare)

    @functools.wraps(prepare)
    def prepare_existing_model_chunks_for_distributed_training(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        config = call.arguments["transformer_config"]
        if (config.use_cpu_initialization and not call.arguments["use_torch_fsdp2"]
                and not config.init_model_with_meta_device):
            for chunk in call.arguments["model_list"]:
                chunk.cuda(torch.cuda.current_device())
        return prepare(*call.args, **call.kwargs)

    prepare_existing_model_chunks_for_distributed_training.__wrapped_by__ = NAME
    dist_utils.prepare_existing_model_chunks_for_distributed_training = (
        prepare_existing_model_chunks_for_distributed_training)


PATCH = register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 training/models/dist_utils."
             "prepare_existing_model_chunks_for_distributed_training: no .cuda() with "
             "use_cpu_initialization, which training.get_model moves)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="a model made with --use-cpu-initialization is moved to the GPU, as megatron's "
            "get_model moves it, instead of training from the CPU (a device error at the first "
            "forward on every rank)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
