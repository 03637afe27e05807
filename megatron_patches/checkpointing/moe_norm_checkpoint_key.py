"""The local spec's MoE pre-MLP norm saved under the key Transformer Engine's spec saves it.

megatron's local GPT layer spec (`get_gpt_layer_local_submodules`) keeps its norms in separate
modules and maps them, in `sharded_state_dict_keys_map`, onto the keys of the TE spec, where the
norm is fused into the following linear (TELayerNormColumnParallelLinear):
`input_layernorm.` -> `self_attention.linear_qkv.layer_norm_` and `pre_mlp_layernorm.` ->
`mlp.linear_fc1.layer_norm_`. The second holds for dense MLPs only. In a MoE layer the TE spec
keeps the pre-MLP norm a module of its own (`pre_mlp_layernorm=TENorm`, no map: the MLP is a
MoELayer with no linear_fc1 to fuse it into), saved as `pre_mlp_layernorm.weight`. The local
spec maps it anyway, so every checkpoint of a local-spec MoE (a CPU run, an import-hf, which
builds on the local spec) names a key the GPU recipes' TE model does not ask for, and a TE
checkpoint lacks the key the local model asks for: neither loads into the other, and export-hf
could not read a GPU run.

Fix: for MoE layers (num_experts set), the local submodules keep every other entry of their map
and drop the pre-MLP norm's. Dense layers are unchanged (their TE norm is fused).

Upstream: the incompatibility is reported in NVIDIA/Megatron-LM PR #6270 (open; the local/TE
MoE norm checkpoint mismatch found on reloading a CPU-made GPT-OSS checkpoint under TE).
Targets megatron-core 0.19.x, whose local spec is built by get_gpt_layer_local_submodules
(0.15.x's get_gpt_layer_local_spec maps the same way; this patch is not written for it).
"""

from megatron.core.models.gpt import gpt_layer_specs

from megatron_patches.checkpointing.local_spec_keys_map import wrap_keys_map
from megatron_patches.registry import Patch, register

PATCH_NAME = "moe-norm-checkpoint-key"
MLP_NORM_PREFIX = "pre_mlp_layernorm."


def _not_needed_because(context):
    build = getattr(gpt_layer_specs, "get_gpt_layer_local_submodules", None)
    if build is None:
        return "megatron-core has no get_gpt_layer_local_submodules"
    if MLP_NORM_PREFIX not in (build(num_experts=2).sharded_state_dict_keys_map or {}):
        return "the local spec's MoE layers keep the pre-MLP norm's own key"
    return None


def _without_moe_mlp_norm(arguments: dict, keys_map: dict) -> dict:
    if not arguments.get("num_experts"):
        return keys_map
    return {prefix: key for prefix, key in keys_map.items() if prefix != MLP_NORM_PREFIX}


def _apply():
    wrap_keys_map(PATCH_NAME, _without_moe_mlp_norm)


PATCH = register(Patch(
    name=PATCH_NAME,
    upstream="NVIDIA/Megatron-LM PR #6270 (local/TE MoE norm checkpoint keys)",
    versions=">=0.19,<0.20",
    summary="the local spec's MoE layers save the pre-MLP norm as pre_mlp_layernorm.weight, the "
            "key Transformer Engine's spec saves and loads (megatron maps it onto "
            "mlp.linear_fc1.layer_norm_weight, a key only dense TE layers have)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
