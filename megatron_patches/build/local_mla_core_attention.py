"""Multi-latent attention (`--multi-latent-attention`, DeepSeek-V2/V3) on megatron's local spec.

megatron-core 0.19.2's MLA builds its core attention with the head widths MLA has, `k_channels`
(q/k: the no-rope plus the rope dims) and `v_channels` (v), while the local spec's
`DotProductAttention` takes neither: the model fails to build with "unexpected keyword argument
'k_channels'" (Megatron-LM #1589; PR #6564, open), so MLA ran only with Transformer Engine and
every CPU run, the HF converter's model included, could not build it.

The patch lets the local core attention take both: scores over `k_channels`-wide heads (the
default softmax scale 1/sqrt(k_channels); MLA passes its own, yarn's mscale included) and a
context of `v_channels`-wide heads, `v_channels` x heads / TP wide on each rank. Built without
them (every non-MLA attention) it is megatron's own, unchanged. Needed where the local core
attention refuses the two arguments. Targets 0.15.x - 0.19.x.
"""

from __future__ import annotations

import functools
import math
import types

from megatron_patches.registry import Patch, register

NAME = "local-mla-core-attention"


def _probe(k_channels: int, v_channels: int):
    """A local core attention of a 2-head, 8-wide config on one TP rank, built as MLA builds it."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                               use_cpu_initialization=True, perform_initialization=False)
    one_rank = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1, rank=lambda: 0))
    return DotProductAttention(config, 1, AttnMaskType.causal, "self", k_channels=k_channels,
                               v_channels=v_channels, pg_collection=one_rank)


def local_core_attention_builds_mla() -> bool:
    """Whether megatron's local core attention, as it stands now, takes MLA's head widths and
    lays its context out by v's (preflight asks too: with this patch left out, MLA on the local
    spec is refused in one line instead of failing in the model build)."""
    try:
        probe = _probe(k_channels=6, v_channels=3)
    except TypeError:
        return False
    return probe.hidden_size_per_partition == 2 * 3


def _not_needed_because(context):
    if local_core_attention_builds_mla():
        return "the local DotProductAttention takes MLA's k_channels and v_channels"
    return None


def _with_head_widths(build):
    @functools.wraps(build)
    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        build(self, *args, **kwargs)
        if k_channels is None and v_channels is None:
            return
        from megatron.core.utils import divide

        config = self.config
        k_channels = config.kv_channels if k_channels is None else k_channels
        v_channels = k_channels if v_channels is None else v_channels
        self.hidden_size_per_attention_head = k_channels
        self.hidden_size_per_partition = divide(v_channels * config.num_attention_heads,
                                                self.pg_collection.tp.size())
        softmax_scale = kwargs.get("softmax_scale", args[5] if len(args) > 5 else None)
        if softmax_scale is None:  # megatron's default, over the q/k width
            self.softmax_scale = 1.0 / math.sqrt(k_channels)
            if config.apply_query_key_layer_scaling:
                self.softmax_scale /= self.layer_number

    __init__.__wrapped_by__ = NAME
    return __init__


def _apply():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    DotProductAttention.__init__ = _with_head_widths(DotProductAttention.__init__)


PATCH = register(Patch(
    name=NAME,
    upstream="NVIDIA/Megatron-LM#1589, PR #6564",
    versions=">=0.15,<0.20",
    summary="the local spec's core attention takes MLA's q/k and v head widths "
            "(--multi-latent-attention builds without Transformer Engine)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
