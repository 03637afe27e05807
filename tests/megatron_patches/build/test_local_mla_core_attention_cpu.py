"""Patch local-mla-core-attention (Megatron-LM #1589): multi-latent attention builds and trains on
megatron's local spec. Without the patch megatron's local core attention refuses MLA's head widths
and the model does not build (the launcher refuses it in one line instead); with it the core
attention equals torch's scaled_dot_product_attention (the reference) for q/k heads wider than
v's. Whole models: tests/moe_launcher/test_convert_hf.py (DeepSeek imports give transformers'
logits, and train at TP2 x SP x EP2 as transformers' model does), the flag matrix (one rank),
the DeepSeek-V2-Lite CPU twin (Megatron-FSDP, 4 ranks, saved).
"""

from __future__ import annotations

import pytest
import torch

import _megatron_cpu as cpu
from _launch import TINY_MODEL, launch

NAME = "local-mla-core-attention"
MLA = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16",
       "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12"]
MLA_CONFIG = dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16,
                  qk_pos_emb_head_dim=8, v_head_dim=12, normalization="RMSNorm")


def test_unpatched_megatron_builds_no_mla_model_on_the_local_spec(monkeypatch):
    from megatron.core.transformer import multi_latent_attention

    from _unpatched import leave_out

    config = cpu.tiny_config(**MLA_CONFIG)
    assert cpu.build_gpt(config, seq_length=16) is not None  # (applies the patches)
    leave_out(monkeypatch, NAME, multi_latent_attention, "build_module")
    with pytest.raises(TypeError, match="k_channels"):
        cpu.build_gpt(config, seq_length=16)


@pytest.mark.parametrize("softmax_scale", [None, 0.3], ids=["default-scale", "mla-scale"])
def test_core_attention_of_mla_head_widths_equals_torch_sdpa(softmax_scale):
    """Reference: torch.nn.functional.scaled_dot_product_attention, causal, whose scale defaults
    to 1/sqrt(q/k width) as megatron's does; q/k heads 24 wide, v heads 12 (a slice of a wider
    tensor, as MLA splits its k/v projection)."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    cpu.build_gpt(cpu.tiny_config(**MLA_CONFIG), seq_length=16)  # the world and the patches
    heads, seq, batch, k_width, v_width = 4, 10, 3, 24, 12
    # as MLA builds its core attention (megatron's build_module where its module calls it)
    attention = multi_latent_attention.build_module(
        DotProductAttention, config=cpu.tiny_config(num_attention_heads=heads), layer_number=1,
        attn_mask_type=AttnMaskType.causal, attention_type="self", softmax_scale=softmax_scale,
        k_channels=k_width, v_channels=v_width)
    assert isinstance(attention, DotProductAttention)
    generator = torch.Generator().manual_seed(0)
    query, key = (torch.randn(seq, batch, heads, k_width, generator=generator) for _ in "qk")
    value = torch.randn(seq, batch, heads, k_width + v_width, generator=generator)[..., k_width:]
    causal = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)
    context = attention(query, key, value, causal, attn_mask_type=AttnMaskType.causal)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (query, key, value)), is_causal=True,
        scale=softmax_scale).permute(2, 0, 1, 3).reshape(seq, batch, heads * v_width)
    assert context.shape == expected.shape
    torch.testing.assert_close(context, expected, rtol=1e-5, atol=1e-6)


def test_unpatched_mla_on_the_local_spec_is_refused_in_one_line(tmp_path):
    run = launch(1, [*TINY_MODEL, *MLA, "--train-iters", "1", "--save", str(tmp_path / "ckpt"),
                     "--save-interval", "1"], env={"MEGATRON_PATCHES_DISABLE": NAME}, timeout=180)
    errors = [line for line in run.log.splitlines() if "error:" in line]
    assert run.exit_codes == [2], run.log[-3000:]
    assert len(errors) == 1 and errors[0].startswith("pretrain_moe: error: --multi-latent-attention")
    assert "Traceback" not in run.log and not (tmp_path / "ckpt").exists()


def test_preflights_probes_say_nothing_of_their_own_configs(capsys):
    """Preflight asks this patch's probe (and mla-yarn-flags') whether megatron now builds MLA on
    the local spec (and takes the YaRN flags); the probes build megatron configs of their own,
    whose warnings (a deprecated CUDA-graph scope, rope fusion) and prints are not about the run:
    dropped (registry.probe_output_dropped), the verdicts kept (no refusal: both patches are
    applied)."""
    import argparse
    import warnings

    from moe_launcher import preflight

    cpu.build_gpt(cpu.tiny_config(**MLA_CONFIG), seq_length=16)  # the world and the patches
    capsys.readouterr()
    args = argparse.Namespace(multi_latent_attention=True, transformer_impl="local",
                              rope_type=None, yarn_beta_fast=1.0, yarn_beta_slow=None,
                              yarn_original_max_position_embeddings=None)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        preflight.check_multi_latent_attention_spec(args)
        preflight.check_mla_yarn_flags(args)
    assert [str(w.message) for w in said] == [] and capsys.readouterr().out == ""
