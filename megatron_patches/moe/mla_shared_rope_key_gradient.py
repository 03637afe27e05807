"""Multi-latent attention at TP > 1 on megatron's local spec: the rope key's gradient summed over
the TP group.

MLA computes one rope key per token (the last `qk_pos_emb_head_dim` columns of the kv
down-projection) and every attention head uses it. Where that down-projection is a
ColumnParallelLinear (the local spec's), megatron-core 0.19.2 gathers its column shards
(`gather_from_tensor_model_parallel_region`, whose backward keeps each rank's own columns of the
gradient) and gives each rank's heads the whole, replicated rope key. Each rank's gradient of the
rope key then holds its own heads' share alone, and the rank that owns the rope columns keeps
only that: the kv down-projection's rope rows get 1/TP of their gradient's terms, silently
(Megatron-LM #1699, open; PR #6839, open). An imported DeepSeek-V3-like model trained at TP2 x SP
logged a first gradient norm of 8.705 where transformers' model has 8.799 (TP1: equal).
Transformer Engine's spec projects down with a duplicated linear and sums the rope key's
gradient in its sequence-parallel gather; it is not touched.

The patch sums the rope key's gradient over the TP group right after megatron's gather (megatron's
own `copy_to_tensor_model_parallel_region`: identity forward, all-reduce backward); the
compressed kv's columns, whose gradient the up-projection already completes, are left as they
are. Needed where megatron's MLA gathers a column-parallel kv down-projection without summing the
rope key's gradient. Targets 0.19.x.
"""

from __future__ import annotations

import functools
import inspect

import torch

from megatron_patches.registry import Patch, register

NAME = "mla-shared-rope-key-gradient"
# A gathered kv down-projection output carries (rope key width, TP group) under this attribute.
_SHARED_ROPE = "_mla_shared_rope_key"


def _mla():
    from megatron.core.transformer import multi_latent_attention

    return multi_latent_attention


def _not_needed_because(context):
    # (read from megatron's own code: the gradient shows only at TP > 1, which a process
    # deciding its patches alone cannot run)
    mla = _mla()
    source = inspect.getsource(mla.MLASelfAttention.get_query_key_value_tensors)
    if "gather_from_tensor_model_parallel_region(kv_combined" not in source:
        return "megatron's MLA gathers no column-parallel kv down-projection"
    if "copy_to_tensor_model_parallel_region(k_pos_emb" in source:
        return "megatron's MLA sums the rope key's gradient over TP"
    return None


def _tagging_column_parallel_kv(down_projection):
    @functools.wraps(down_projection)
    def qkv_down_projection(self, *args, **kwargs):
        q_compressed, kv_combined = down_projection(self, *args, **kwargs)
        config = self.config
        # megatron's own test for a column-parallel kv down-projection (its gather follows)
        if kv_combined.size(-1) != config.kv_lora_rank + config.qk_pos_emb_head_dim:
            setattr(kv_combined, _SHARED_ROPE, (config.qk_pos_emb_head_dim, self.tp_group))
        return q_compressed, kv_combined

    qkv_down_projection.__wrapped_by__ = NAME
    return qkv_down_projection


def _summing_rope_key_gradient(gather):
    @functools.wraps(gather)
    def gather_from_tensor_model_parallel_region(input_, *args, **kwargs):
        output = gather(input_, *args, **kwargs)
        shared = getattr(input_, _SHARED_ROPE, None)
        if shared is None:
            return output
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        rope_width, tp_group = shared
        compressed, rope_key = output.split([output.size(-1) - rope_width, rope_width], dim=-1)
        rope_key = copy_to_tensor_model_parallel_region(rope_key, group=tp_group)
        return torch.cat([compressed, rope_key], dim=-1)

    gather_from_tensor_model_parallel_region.__wrapped_by__ = NAME
    return gather_from_tensor_model_parallel_region


def _apply():
    mla = _mla()
    mla.MLASelfAttention._qkv_down_projection = _tagging_column_parallel_kv(
        mla.MLASelfAttention._qkv_down_projection)
    mla.gather_from_tensor_model_parallel_region = _summing_rope_key_gradient(
        mla.gather_from_tensor_model_parallel_region)


PATCH = register(Patch(
    name=NAME,
    upstream="NVIDIA/Megatron-LM#1699 (PR #6839)",
    versions=">=0.19,<0.20",
    summary="MLA with a column-parallel kv down-projection (the local spec) at TP > 1 sums the "
            "rope key's gradient over TP, which each rank's heads share",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
