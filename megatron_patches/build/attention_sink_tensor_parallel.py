"""Learnable attention sinks (`--softmax-type learnable`) marked tensor-parallel.

megatron-core 0.19.2's core attention (`DotProductAttention`, and Transformer Engine's behind
`TEDotProductAttention`) keeps one sink logit per attention head of its rank, `softmax_offset`,
and declares it sharded by heads over the TP group in `sharded_state_dict`, but never marks the
parameter tensor-parallel. Every reader of the mark then takes TP rank 1's offsets for a copy of
rank 0's: the grad-norm clip leaves their gradients out (Megatron-LM #7452, finding 8; PR #7530,
open), and the checkpoint completeness guard, which trusts the mark, refuses the first save of
such a model at TP > 1 (issue 43), losing a save interval's work.

The patch marks the built parameter (`tensor_model_parallel`, dim 0, stride 1) right after
megatron's constructor, as megatron's own tensor-parallel layers do: the declared sharding, the
mark and the clip then agree. Needed where a core attention built with a learnable offset comes
back unmarked. Targets 0.15.x - 0.19.x.
"""

from __future__ import annotations

import functools
import types

import torch

from megatron_patches.registry import Patch, register

NAME = "attention-sink-tensor-parallel"


def _core_attentions() -> list[type]:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    classes = [DotProductAttention]
    try:
        from megatron.core.extensions import transformer_engine
    except ImportError:
        return classes
    # Without Transformer Engine megatron's module holds placeholders there, not classes.
    if getattr(transformer_engine, "HAVE_TE", False) and isinstance(
            getattr(transformer_engine, "TEDotProductAttention", None), type):
        classes.append(transformer_engine.TEDotProductAttention)
    return classes


def _not_needed_because(context):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                                   softmax_type="learnable", use_cpu_initialization=True,
                                   perform_initialization=False)
    except TypeError:
        return "this megatron-core has no learnable softmax offset"
    one_rank = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1, rank=lambda: 0))
    probe = DotProductAttention(config, 1, AttnMaskType.causal, "self", pg_collection=one_rank)
    if getattr(probe.softmax_offset, "tensor_model_parallel", False):
        return "DotProductAttention marks its softmax_offset tensor-parallel"
    return None


def _mark(attention) -> None:
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    offset = getattr(attention, "softmax_offset", None)
    if isinstance(offset, torch.nn.Parameter) and not getattr(offset, "tensor_model_parallel",
                                                               False):
        set_tensor_model_parallel_attributes(offset, is_parallel=True, dim=0, stride=1)


def _marking(build):
    @functools.wraps(build)
    def __init__(self, *args, **kwargs):
        build(self, *args, **kwargs)
        _mark(self)

    __init__.__wrapped_by__ = NAME
    return __init__


def _apply():
    for cls in _core_attentions():
        cls.__init__ = _marking(cls.__init__)


PATCH = register(Patch(
    name=NAME,
    upstream="NVIDIA/Megatron-LM#7452 (finding 8), PR #7530",
    versions=">=0.15,<0.20",
    summary="learnable attention sinks (softmax_offset) marked tensor-parallel, as their "
            "declared sharding says: grad-norm clip and checkpoint guard count every TP rank's",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
