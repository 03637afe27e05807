"""mla-norm-checkpoint-keys: a multi-latent-attention model built on megatron's local spec (CPU
runs, a DeepSeek import) saves the weight keys megatron's Transformer Engine spec saves and loads,
which the GPU recipes build.

Reference: megatron-core 0.19.2's `get_gpt_layer_with_transformer_engine_submodules`
(gpt_layer_specs.py, the multi_latent_attention branch without down-projection fusion, qk_layernorm
set), which cannot be built here (`TESpecProvider` is None without Transformer Engine).
TE_SPEC_MLA_KEYS is recorded from it, slot by slot, with the parameters each TE module has:
input_layernorm and a MoE layer's pre_mlp_layernorm are TENorm (`weight`), the q and kv
down-projections TELinear, their up-projections TELayerNormColumnParallelLinear (`weight` and the
fused norm's `layer_norm_weight`; q/kv_layernorm are IdentityOp), a dense layer's linear_fc1 is
TELayerNormColumnParallelLinear (its pre_mlp_layernorm IdentityOp), the experts TEGroupedMLP,
whose sharded state dict megatron makes interchangeable with SequentialMLP's; the branch has no
keys map. `_extra_state` entries are left out (TE's are not recorded here).
"""

from __future__ import annotations

import pytest

import _megatron_cpu as cpu

PATCH = "mla-norm-checkpoint-keys"
ATTENTION = ("input_layernorm.weight",
             "self_attention.linear_q_down_proj.weight",
             "self_attention.linear_q_up_proj.layer_norm_weight",
             "self_attention.linear_q_up_proj.weight",
             "self_attention.linear_kv_down_proj.weight",
             "self_attention.linear_kv_up_proj.layer_norm_weight",
             "self_attention.linear_kv_up_proj.weight",
             "self_attention.linear_proj.weight")
DENSE = "decoder.layers.0."  # (a model of dense and MoE layers keys each layer by its number)
MOE = "decoder.layers.1."
TE_SPEC_MLA_KEYS = {
    "embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
    *(DENSE + key for key in (*ATTENTION, "mlp.linear_fc1.layer_norm_weight",
                              "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")),
    *(MOE + key for key in (*ATTENTION, "pre_mlp_layernorm.weight", "mlp.router.weight",
                            "mlp.experts.experts.linear_fc1.weight",
                            "mlp.experts.experts.linear_fc2.weight")),
    "decoder.final_layernorm.weight",
    "output_layer.weight",
}
MLA_CONFIG = dict(num_moe_experts=4, moe_router_topk=2, moe_layer_freq=[0, 1],
                  multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16,
                  qk_pos_emb_head_dim=8, v_head_dim=12, qk_layernorm=True, normalization="RMSNorm",
                  ffn_hidden_size=96)


def _weight_keys(model) -> set[str]:
    found = set()

    def walk(node):
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)
        elif hasattr(node, "key") and "_extra_state" not in node.key:
            found.add(node.key)

    walk(model.sharded_state_dict())
    return found


def test_a_local_mla_model_holds_the_transformer_engine_specs_keys(monkeypatch):
    from megatron.core.models.gpt import gpt_layer_specs

    config = cpu.tiny_config(**MLA_CONFIG)
    patched = _weight_keys(cpu.build_gpt(config, seq_length=16))
    assert patched == TE_SPEC_MLA_KEYS, patched ^ TE_SPEC_MLA_KEYS
    # megatron's own local MLA layers (the patch's wrapper, the outermost, taken off)
    wrapper = gpt_layer_specs.get_gpt_layer_local_submodules
    assert wrapper.__wrapped_by__ == PATCH
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_local_submodules", wrapper.__wrapped__)
    unpatched = _weight_keys(cpu.build_gpt(config, seq_length=16))
    assert unpatched ^ TE_SPEC_MLA_KEYS == {
        *(layer + f"self_attention.{norm}" for layer in (DENSE, MOE) for norm in (
            "q_layernorm.weight", "kv_layernorm.weight", "linear_q_up_proj.layer_norm_weight",
            "linear_kv_up_proj.layer_norm_weight")),
        DENSE + "pre_mlp_layernorm.weight", DENSE + "mlp.linear_fc1.layer_norm_weight"}
