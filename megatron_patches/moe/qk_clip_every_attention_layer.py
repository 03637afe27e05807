"""QK-clip (`--qk-clip`, MuonClip: Kimi K2) and `--log-max-attention-logit` reach every attention
layer of the model: multi-token-prediction layers too.

After each optimizer step megatron-core 0.19.2's train_step calls `clip_qk`
(megatron/core/optimizer/qk_clip.py), which takes the largest attention logits of each layer in
`model_chunk.module.module.decoder.layers`, the maximum over the data-parallel ranks, and asks
the layer to clip. A multi-token-prediction layer (`mtp.layers.k`: DeepSeek-V3's, GLM-4.5's) is
not among them: its attention is never clipped and its logits are left out of the logged
maximum, so they grow unchecked while the run clips and logs the rest, without a word. The walk
also assumes each chunk is DDP(Float16Module(model)): an fp32 run's chunk (DDP(model)) fails at
the first step.

The patch gives train_step's call a function of the same contract that walks every module of
each chunk: each attention module that can clip and holds this step's logits (those Transformer
Engine's attention reports) gets them reduced to their maximum over the data-parallel (and
context-parallel) ranks, counted in the logged maximum, and is clipped (with
`--log-max-attention-logit` alone, its logits are cleared, as megatron clears them). Needed
where megatron's clip_qk walks the decoder's layers only. Targets 0.19.x; GPU runs only
(megatron takes the flags with Transformer Engine >= 2.9).
"""

from __future__ import annotations

import functools
import inspect

import torch

from megatron_patches.registry import Patch, register

NAME = "qk-clip-every-attention-layer"


def _not_needed_because(context):
    from megatron.core.optimizer import qk_clip

    if ".decoder.layers" not in inspect.getsource(qk_clip.clip_qk):
        return "megatron's clip_qk does not walk the decoder's layers alone"
    return None


def _attention_with_logits(chunk):
    """The attention modules of a model chunk that can clip and hold this step's logits."""
    for module in chunk.modules():
        core = getattr(module, "core_attention", None)
        logits = getattr(core, "current_max_attn_logits", None)
        if hasattr(module, "clip_qk") and logits is not None:
            yield module


def _every_attention_layer(megatron_clip_qk):
    @functools.wraps(megatron_clip_qk)
    def clip_qk(model, log_max_only=False) -> float:
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        largest = 0.0
        with torch.no_grad():
            for chunk in model:
                for attention in list(_attention_with_logits(chunk)):
                    logits = attention.core_attention.current_max_attn_logits
                    torch.distributed.all_reduce(logits, op=torch.distributed.ReduceOp.MAX,
                                                 group=group)
                    largest = max(largest, logits.max().item())
                    if log_max_only:
                        attention.core_attention.current_max_attn_logits = None
                    else:
                        attention.clip_qk()
        return largest

    clip_qk.__wrapped_by__ = NAME
    return clip_qk


def _apply():
    from megatron.training import training

    training.clip_qk = _every_attention_layer(training.clip_qk)


PATCH = register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 qk_clip.clip_qk; cf. Megatron-LM PR #7382)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="--qk-clip and --log-max-attention-logit clip and count every attention layer, "
            "MTP layers too (megatron walked the decoder's layers only, and failed on an fp32 "
            "run's model)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
