"""The local spec's multi-latent attention norms saved under the keys Transformer Engine's spec
saves them.

megatron-core 0.19.2's Transformer Engine spec for MLA layers (`get_gpt_layer_with_transformer_
engine_submodules`, multi_latent_attention without down-projection fusion) fuses the norm of the
compressed query into its up-projection and the norm of the compressed key/value into theirs
(TELayerNormColumnParallelLinear), and a dense layer's pre-MLP norm into `mlp.linear_fc1`:
`self_attention.linear_q_up_proj.layer_norm_weight`, `self_attention.linear_kv_up_proj.layer_norm_
weight`, `mlp.linear_fc1.layer_norm_weight`. Its local spec keeps those norms as modules of their
own and, unlike its non-MLA branch, maps none of them onto TE's keys: a checkpoint of a local-spec
MLA model (a CPU run, a DeepSeek import, which builds on the local spec) holds
`self_attention.q_layernorm.weight`, `self_attention.kv_layernorm.weight` and a dense layer's
`pre_mlp_layernorm.weight`, which a GPU recipe's TE model does not ask for (and a TE checkpoint
lacks what the local model asks for): neither loads into the other.

Fix: the local MLA submodules map those three prefixes onto TE's keys, as the non-MLA branch maps
its fused norms (`sharded_state_dict_keys_map`; megatron applies it to every checkpoint format
that names tensors by their sharded keys, and the converter's fsdp_dtensor names follow it).
Upstream: the same class of mismatch as NVIDIA/Megatron-LM PR #6270 (the MoE pre-MLP norm, patch
moe-norm-checkpoint-key); the MLA norms are not reported there. Targets megatron-core 0.19.x.
"""

from megatron.core.models.gpt import gpt_layer_specs

from megatron_patches.checkpointing.local_spec_keys_map import wrap_keys_map
from megatron_patches.registry import Patch, register

PATCH_NAME = "mla-norm-checkpoint-keys"
# local-spec prefix -> Transformer Engine's, within a layer
ATTENTION_NORM_KEYS = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}
DENSE_MLP_NORM_KEY = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _wanted(num_experts) -> dict[str, str]:
    return {**ATTENTION_NORM_KEYS, **({} if num_experts else DENSE_MLP_NORM_KEY)}


def _not_needed_because(context):
    build = getattr(gpt_layer_specs, "get_gpt_layer_local_submodules", None)
    if build is None:
        return "megatron-core has no get_gpt_layer_local_submodules"
    keys_map = build(multi_latent_attention=True, qk_layernorm=True).sharded_state_dict_keys_map
    if (keys_map or {}).items() >= _wanted(None).items():
        return "the local spec's MLA layers save their norms under Transformer Engine's keys"
    return None


def _with_te_norm_keys(arguments: dict, keys_map: dict) -> dict:
    if not arguments.get("multi_latent_attention"):
        return keys_map
    return {**keys_map, **_wanted(arguments.get("num_experts"))}


def _apply():
    wrap_keys_map(PATCH_NAME, _with_te_norm_keys)


PATCH = register(Patch(
    name=PATCH_NAME,
    upstream="local (megatron-core 0.19.2 gpt_layer_specs: the local MLA branch has no keys map; "
             "cf. NVIDIA/Megatron-LM PR #6270)",
    versions=">=0.19,<0.20",
    summary="the local spec's MLA layers save the compressed q and kv norms (and a dense layer's "
            "pre-MLP norm) under the fused keys Transformer Engine's MLA spec saves and loads",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
