"""Multi-latent attention (`--multi-latent-attention`, DeepSeek-V2/V3) on megatron's local spec.

megatron-core 0.19.2's MLA builds its core attention with the head widths MLA has, `k_channels`
(q/k: the no-rope plus the rope dims) and `v_channels` (v), while the local spec's
`DotProductAttention` takes neither: the model fails to build with "unexpected keyword argument
'k_channels'" (Megatron-LM #1589; PR #6564, open), so MLA ran only with Transformer Engine and
every CPU run, the HF converter's model included, could not build it.

The patch builds MLA's core attention, where the spec names the local one, as a subclass of it
that takes both: scores over `k_channels`-wide heads (the default softmax scale 1/sqrt(k_channels);
MLA passes its own, yarn's mscale included) and a context of `v_channels`-wide heads,
`v_channels` x heads / TP wide on each rank. It is hooked where MLA builds its core attention
(`build_module` in megatron's multi_latent_attention module), so every other attention is
megatron's own `DotProductAttention`, unchanged. Needed where the local core attention refuses the
two arguments. Targets 0.15.x - 0.19.x.
"""

from __future__ import annotations

import functools
import math
import types

from megatron_patches.registry import Patch, register

NAME = "local-mla-core-attention"


def _mla():
    from megatron.core.transformer import multi_latent_attention

    return multi_latent_attention


def _probe(build, k_channels: int, v_channels: int):
    """A local core attention of a 2-head, 8-wide config on one TP rank, built by `build` with
    MLA's head widths, as MLA builds it."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                               use_cpu_initialization=True, perform_initialization=False)
    one_rank = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1, rank=lambda: 0))
    return build(DotProductAttention, config=config, layer_number=1,
                 attn_mask_type=AttnMaskType.causal, attention_type="self",
                 k_channels=k_channels, v_channels=v_channels, pg_collection=one_rank)


def local_core_attention_builds_mla() -> bool:
    """Whether MLA, as megatron builds its core attention now, gets a local core attention that
    takes its head widths and lays its context out by v's (preflight asks too: with this patch
    left out, MLA on the local spec is refused in one line instead of failing in the model
    build)."""
    try:
        probe = _probe(_mla().build_module, k_channels=6, v_channels=3)
    except TypeError:
        return False
    return probe.hidden_size_per_partition == 2 * 3


def _not_needed_because(context):
    if local_core_attention_builds_mla():
        return "MLA's local core attention takes its k_channels and v_channels"
    return None


def _with_head_widths():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    class DotProductAttentionWithHeadWidths(DotProductAttention):
        """megatron's local core attention, with MLA's q/k and v head widths."""

        def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(config, *args, **kwargs)
            k_channels = config.kv_channels if k_channels is None else k_channels
            v_channels = k_channels if v_channels is None else v_channels
            self.hidden_size_per_attention_head = k_channels
            self.hidden_size_per_partition = divide(v_channels * config.num_attention_heads,
                                                    self.pg_collection.tp.size())
            if kwargs.get("softmax_scale") is None:  # megatron's default, over the q/k width
                self.softmax_scale = 1.0 / math.sqrt(k_channels)
                if config.apply_query_key_layer_scaling:
                    self.softmax_scale /= self.layer_number

    return DotProductAttention, DotProductAttentionWithHeadWidths


def _building_with_head_widths(build):
    local, with_head_widths = _with_head_widths()

    @functools.wraps(build)
    def build_module(spec_or_module, *args, **kwargs):
        if spec_or_module is local and ("k_channels" in kwargs or "v_channels" in kwargs):
            spec_or_module = with_head_widths
        return build(spec_or_module, *args, **kwargs)

    build_module.__wrapped_by__ = NAME
    return build_module


def _apply():
    mla = _mla()
    mla.build_module = _building_with_head_widths(mla.build_module)


PATCH = register(Patch(
    name=NAME,
    upstream="NVIDIA/Megatron-LM#1589, PR #6564",
    versions=">=0.15,<0.20",
    summary="the local spec's core attention takes MLA's q/k and v head widths "
            "(--multi-latent-attention builds without Transformer Engine)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
