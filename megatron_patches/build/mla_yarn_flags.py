"""Multi-latent attention with YaRN takes `--yarn-beta-fast`, `--yarn-beta-slow` and
`--yarn-original-max-position-embeddings`.

megatron-core 0.19.2 builds an MLA model's config (`MLATransformerConfig`) from the args by field
name (`core_transformer_config_from_args`). MLA's YaRN fields are named `beta_fast`, `beta_slow`
and `original_max_position_embeddings`, the flags' args `yarn_beta_fast`, ...; the function that
copies those args onto a config (`_apply_yarn_config_from_args`) returns early for MLA, saying its
config declares the fields itself. So with `--multi-latent-attention --rope-type yarn` the three
flags are dropped without a word and MLA's rope keeps 32, 1 and 4096: a model whose published
YaRN differs (Kimi K2's beta_fast 1) computes another rope from the first step, silently.
Megatron-LM #1418 (open) is the neighbouring report on MLA YaRN's original context length.

The patch sets the three MLA fields from the flags that were given, where megatron builds the
config for the GPT and HybridModel builders (`argument_utils.core_transformer_config_from_args`,
which both call). Needed where that function leaves an MLA config's `beta_fast` at its default
with `--yarn-beta-fast` set. Targets 0.19.x.
"""

from __future__ import annotations

import functools

from megatron_patches.registry import Patch, register

NAME = "mla-yarn-flags"
# the flags' args -> MLATransformerConfig's fields
YARN_FIELDS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow",
               "yarn_original_max_position_embeddings": "original_max_position_embeddings"}


def _config_of(flags: list[str]):
    """megatron's config of a tiny MLA model with YaRN and `flags`, from megatron's own parser."""
    import argparse

    import torch
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    args = parser.parse_args([
        "--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2",
        "--multi-latent-attention", "--kv-lora-rank", "4", "--qk-head-dim", "2",
        "--qk-pos-emb-head-dim", "2", "--v-head-dim", "2", "--rope-type", "yarn",
        "--transformer-impl", "local", *flags])
    args.params_dtype = torch.float32  # (validate_args' derivation)
    return core_transformer_config_from_args(args)


def mla_config_takes_yarn_flags() -> bool:
    """Whether the config megatron builds for MLA takes --yarn-beta-fast (as it does once the
    patch is applied)."""
    return _config_of(["--yarn-beta-fast", "2.0"]).beta_fast == 2.0


def _not_needed_because(context):
    if mla_config_takes_yarn_flags():
        return "megatron's MLA config takes the --yarn-* flags"
    return None


def _with_mla_yarn_flags(config_from_args):
    @functools.wraps(config_from_args)
    def config_with_mla_yarn_flags(args, *rest, **kwargs):
        config = config_from_args(args, *rest, **kwargs)
        if getattr(args, "multi_latent_attention", False):
            for arg, field in YARN_FIELDS.items():
                if getattr(args, arg, None) is not None and hasattr(config, field):
                    setattr(config, field, getattr(args, arg))
        return config

    config_with_mla_yarn_flags.__wrapped_by__ = NAME
    return config_with_mla_yarn_flags


def _apply():
    from megatron.training import argument_utils

    argument_utils.core_transformer_config_from_args = _with_mla_yarn_flags(
        argument_utils.core_transformer_config_from_args)


PATCH = register(Patch(
    name=NAME,
    upstream="local (megatron-core's args-to-MLA-config mapping; cf. Megatron-LM #1418)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="--yarn-beta-fast, --yarn-beta-slow and --yarn-original-max-position-embeddings "
            "set multi-latent attention's YaRN (megatron dropped them for MLA, silently, keeping "
            "32, 1 and 4096)",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
