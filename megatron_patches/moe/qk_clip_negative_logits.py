"""QK-clip (`--qk-clip`, MuonClip's: Kimi K2) leaves a head whose largest attention logit is
under the threshold as it is, a negative one too.

When any head of a layer passes `--qk-clip-threshold`, megatron-core 0.19.2's `clip_qk`
(`MLASelfAttention` and, per query group, `SelfAttention`) scales every head of the layer by
eta = min(1, threshold / largest logit). A head whose largest logit is negative gets a negative
eta: its query and key rows are multiplied by a negative number's fractional power, NaN (the
run's NaN check then stops it, at that step and again after each resume from a checkpoint
before it), and MLA's rope query rows by eta itself, a sign flip. The Kimi K2 report clips only
the heads past the threshold; a head under it is left as it is (eta 1), whatever the sign of
its logits.

The patch hands megatron's clip_qk each head's largest logit raised to at least the threshold
(eta 1 for every head under it, the same scaling for those past it), in a tensor of its own:
what megatron logs is the logits as they were. Needed where megatron's clip_qk divides the
threshold by the logits unguarded. Targets 0.19.x; GPU runs only (megatron takes `--qk-clip`
with Transformer Engine >= 2.9, whose attention returns the logits).
"""

from __future__ import annotations

import functools
import inspect

import torch

from megatron_patches.moe.qk_clip_distributed_optimizer import clipping_attention_classes
from megatron_patches.registry import Patch, register, unwrapped

NAME = "qk-clip-negative-logits"


def _unguarded(clip_qk) -> bool:
    """megatron's eta `clamp(threshold / logits, max=1.0)`, with no lower bound (a guard would
    clamp from below too, or pick the heads past the threshold)."""
    source = inspect.getsource(unwrapped(clip_qk))
    return "qk_clip_threshold /" in source and "max=1.0" in source and "min=" not in source


def _not_needed_because(context):
    if not any(_unguarded(cls.clip_qk) for cls in clipping_attention_classes()):
        return "megatron's clip_qk guards its scale of heads under the threshold"
    return None


def _heads_under_the_threshold_unscaled(clip_qk):
    @functools.wraps(clip_qk)
    def clip_qk_past_the_threshold_only(self):
        core = self.core_attention
        logits = getattr(core, "current_max_attn_logits", None)
        if logits is not None:
            core.current_max_attn_logits = torch.clamp(logits, min=self.config.qk_clip_threshold)
        return clip_qk(self)

    clip_qk_past_the_threshold_only.__wrapped_by__ = NAME
    return clip_qk_past_the_threshold_only


def _apply():
    for cls in clipping_attention_classes():
        cls.clip_qk = _heads_under_the_threshold_unscaled(cls.clip_qk)


PATCH = register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 SelfAttention/MLASelfAttention.clip_qk)",
    versions=">=0.19,<0.20",
    summary="--qk-clip scales only the heads past --qk-clip-threshold (megatron gave a head "
            "whose largest logit is negative a negative scale: NaN weights, a sign-flipped "
            "rope query)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
