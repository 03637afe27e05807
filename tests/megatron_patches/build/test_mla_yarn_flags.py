"""Patch mla-yarn-flags: multi-latent attention with YaRN takes --yarn-beta-fast, --yarn-beta-slow
and --yarn-original-max-position-embeddings; megatron-core 0.19.2 drops them for MLA without a
word. The reference is transformers' DeepSeek-V3 rope with Kimi K2's yarn:
tests/moe_launcher/test_convert_hf.py (family `kimi_k2_yarn`) imports it, gets its logits, and
not with the patch left out. Here: the config megatron builds from the launcher's command line,
both ways, and the launcher's refusal where the patch is left out.
"""

from __future__ import annotations

import sys

import pytest

from _launch import TINY_MODEL
from _unpatched import apply_all, leave_out

NAME = "mla-yarn-flags"
MLA_YARN = [*TINY_MODEL, "--multi-latent-attention", "--q-lora-rank", "32",
            "--kv-lora-rank", "32", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
            "--v-head-dim", "16", "--qk-layernorm", "--rope-type", "yarn",
            "--rotary-scaling-factor", "2.0", "--mscale", "1.0", "--mscale-all-dim", "1.0",
            "--yarn-beta-fast", "1.0", "--yarn-beta-slow", "2.0",
            "--yarn-original-max-position-embeddings", "128", "--train-iters", "2"]


def _yarn(config) -> tuple:
    transformer = config.transformer
    return (transformer.beta_fast, transformer.beta_slow,
            transformer.original_max_position_embeddings)


def test_mla_takes_the_yarn_flags_and_megatron_alone_drops_them(monkeypatch):
    from megatron.training import argument_utils

    from moe_launcher import preflight
    from moe_launcher.megatron_validation import checked_command_line, model_config
    from moe_launcher.platform_defaults import with_platform_defaults
    from moe_launcher.runtime.refusals import PreflightError

    apply_all()
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # megatron's parser replaces it
    argv, _ = with_platform_defaults(MLA_YARN, on_cpu=True, have_te=False)
    args, config = checked_command_line(argv)
    assert _yarn(config.model) == (1.0, 2.0, 128)
    leave_out(monkeypatch, NAME, argument_utils, "core_transformer_config_from_args")
    assert _yarn(model_config(args)) == (32, 1, 4096)  # megatron's defaults, the flags dropped
    with pytest.raises(PreflightError, match="--yarn-beta-fast with --multi-latent-attention"):
        preflight.check_mla_yarn_flags(args)
