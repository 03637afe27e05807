"""QK-clip (`--qk-clip`, MuonClip's attention-logit clipping: Kimi K2) under the distributed
optimizer rescales the fp32 master weights.

After each optimizer step megatron's `clip_qk` asks every attention layer whose largest attention
logit passed `--qk-clip-threshold` to scale its query and key rows, per head (per query group for
GQA), in the model weight and in the optimizer's fp32 master (`param.main_param`). Under
`--use-distributed-optimizer` with bf16/fp16 weights megatron-core 0.19.2 keeps that master as a
flat shard of this rank's range of the weight (`main_param_sharded`), or None where the rank owns
none of it; `MLASelfAttention.clip_qk` and `SelfAttention.clip_qk` reshape it as the whole weight.
The run trains until the first step whose logits pass the threshold, possibly hours in, and then
dies on every rank (`'NoneType' object has no attribute 'data'` where the rank owns no part of
the weight, a size mismatch where it owns one), and again after each resume. Megatron-LM PR #7382
(closed) reports it with the hybrid-model crash.

The patch records, when megatron's distributed optimizer makes its masters, where each master's
shard starts in its weight; when a layer is about to clip, megatron's own clip_qk runs on whole
fp32 masters assembled from the shards (zeros outside this rank's range), and each rank keeps its
range of the result: the same per-head scales as megatron's, on the elements the rank owns.
Layers that do not clip run megatron's function untouched. Needed where megatron's clip_qk
reshapes a sharded master as the whole weight. Targets 0.19.x; GPU runs only (megatron takes
`--qk-clip` with Transformer Engine >= 2.9, whose attention returns the logits).
"""

from __future__ import annotations

import functools
import inspect

import torch

from megatron_patches.registry import Patch, register

NAME = "qk-clip-distributed-optimizer"
# Set on a model weight whose master is a distributed-optimizer shard: where the shard starts in
# the flattened weight (megatron's `main_param_sharded` says only that it is one).
SHARD_START = "qk_clip_master_shard_start"


def clipping_attention_classes() -> list:
    """megatron's attention classes with a clip_qk (the QK-clip patches wrap both)."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    return [SelfAttention, MLASelfAttention]


def _distributed_optimizer():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DistributedOptimizer


def _not_needed_because(context):
    # (read from megatron's own code: the crash needs logits above the threshold, which only
    # Transformer Engine's attention reports)
    if all("main_param_sharded" in inspect.getsource(cls.clip_qk)
           for cls in clipping_attention_classes()):
        return "megatron's clip_qk handles sharded fp32 masters"
    return None


def _recording_shard_starts(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        # (Megatron-FSDP's use of the class keeps its masters otherwise and has no such groups)
        for group in getattr(self, "model_float16_groups", ()):
            for param in group:
                if getattr(param, "main_param", None) is not None:
                    shard = self._get_model_param_range_map(param)["param"]
                    setattr(param, SHARD_START, shard.start)

    __init__.__wrapped_by__ = NAME
    return __init__


def _will_clip(attention) -> bool:
    """megatron's condition for a layer to rescale its weights (any head past the threshold;
    GQA's group maximum passes it exactly when one of its heads does)."""
    logits = getattr(attention.core_attention, "current_max_attn_logits", None)
    return logits is not None and bool(torch.any(logits > attention.config.qk_clip_threshold))


def _on_whole_masters(clip_qk):
    @functools.wraps(clip_qk)
    def clip_qk_on_whole_masters(self):
        if not _will_clip(self):
            return clip_qk(self)
        sharded = [param for param in self.parameters()
                   if getattr(param, "main_param_sharded", False) and hasattr(param, "main_param")]
        shards = {param: param.main_param for param in sharded}
        try:
            for param in sharded:
                whole = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
                if shards[param] is not None:
                    start = getattr(param, SHARD_START)
                    whole.view(-1)[start:start + shards[param].numel()] = shards[param]
                param.main_param = whole
            clip_qk(self)
            for param in sharded:
                if shards[param] is not None:
                    start = getattr(param, SHARD_START)
                    shards[param].copy_(
                        param.main_param.view(-1)[start:start + shards[param].numel()])
        finally:
            for param in sharded:
                param.main_param = shards[param]

    clip_qk_on_whole_masters.__wrapped_by__ = NAME
    return clip_qk_on_whole_masters


def _apply():
    optimizer = _distributed_optimizer()
    optimizer.__init__ = _recording_shard_starts(optimizer.__init__)
    for cls in clipping_attention_classes():
        cls.clip_qk = _on_whole_masters(cls.clip_qk)


PATCH = register(Patch(
    name=NAME,
    upstream="Megatron-LM PR #7382 (closed; megatron-core 0.19.2 clip_qk)",
    versions=">=0.19,<0.20",
    summary="--qk-clip with the distributed optimizer rescales each rank's range of the fp32 "
            "masters (megatron reshaped the flat shard as the whole weight and every rank died "
            "at the first step past --qk-clip-threshold)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
