"""Patch mla-q-projection-without-norm (NVIDIA-NeMo/Megatron-Bridge#5261): multi-latent attention
without a query rank and with --qk-layernorm (DeepSeek-V2-Lite's attention) projects q from the
layer's input with no norm of its own. The reference is transformers' DeepseekV2ForCausalLM with
q_lora_rank None: tests/moe_launcher/test_convert_hf.py (family `deepseek_v2_lite`) imports it
and gets its logits. Here: megatron's own resolver on the local spec refuses the layer, and under
Transformer Engine (GPU only) fuses a norm into linear_q_proj that the patch leaves out.
"""

from __future__ import annotations

import pytest

import _megatron_cpu as cpu
from _required import transformer_engine_missing

NAME = "mla-q-projection-without-norm"
RANK_LESS_Q = dict(multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=16, qk_head_dim=16,
                   qk_pos_emb_head_dim=8, v_head_dim=12, qk_layernorm=True,
                   normalization="RMSNorm")


def _norms(model) -> list[str]:
    return sorted({name.split("layers.")[1].split(".", 1)[1] for name, _ in
                   model.named_parameters() if "norm" in name and "layers." in name})


def test_a_rank_less_q_has_no_norm_and_megatrons_resolver_refuses_it(monkeypatch):
    from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver

    config = cpu.tiny_config(**RANK_LESS_Q)
    assert _norms(cpu.build_gpt(config, seq_length=16)) == [
        "input_layernorm.weight", "pre_mlp_layernorm.weight", "self_attention.kv_layernorm.weight"]
    assert QKNormConfigResolver.resolve.__wrapped_by__ == NAME
    monkeypatch.setattr(QKNormConfigResolver, "resolve", QKNormConfigResolver.resolve.__wrapped__)
    with pytest.raises(ValueError, match="q_lora_rank is None"):
        cpu.build_gpt(config, seq_length=16)
    # (a query rank: the compressed q keeps its norm, patched or not)
    with_rank = cpu.tiny_config(**{**RANK_LESS_Q, "q_lora_rank": 24})
    assert "self_attention.q_layernorm.weight" in _norms(cpu.build_gpt(with_rank, seq_length=16))


@pytest.mark.gpu
@pytest.mark.skipif(transformer_engine_missing() is not None,
                    reason=transformer_engine_missing() or "")
def test_transformer_engine_rank_less_q_has_no_fused_norm(monkeypatch):
    """The silent half: megatron's TE spec builds linear_q_proj as a fused norm+linear (a
    `layer_norm_weight` DeepSeek-V2-Lite does not have); patched, a plain linear."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver

    cpu.init_world()
    config = cpu.tiny_config(**RANK_LESS_Q)

    def q_projection_params():
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True)
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=cpu.VOCAB,
                         max_sequence_length=16)
        return {name.split("linear_q_proj.")[1] for name, _ in model.named_parameters()
                if "linear_q_proj." in name}

    assert q_projection_params() == {"weight"}
    monkeypatch.setattr(QKNormConfigResolver, "resolve", QKNormConfigResolver.resolve.__wrapped__)
    assert q_projection_params() == {"weight", "layer_norm_weight"}
