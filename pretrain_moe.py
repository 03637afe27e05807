"""Pretrain a Mixture-of-Experts GPT with megatron-core's own pretrain(), plus this project's fixes.

    torchrun --nproc-per-node=N pretrain_moe.py <Megatron-LM flags>

Every Megatron-LM flag passes through unchanged. On machines without CUDA the CPU backend is
activated and the CPU-only flags are supplied, so the command line is the same everywhere.
"""

import os
import sys

import torch

from megatron_patches.versions import (
    UnsupportedMegatronVersion, check_megatron_version, check_training_package)


def log0(line: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, flush=True)


def main(argv: list[str]) -> None:
    track = check_megatron_version()
    check_training_package()
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        from megatron_patches import cpu_backend

        cpu_backend.activate()

    from megatron_patches import registry
    from moe_launcher.platform_defaults import (
        set_environment_defaults, with_logging_defaults, with_platform_defaults)

    registry.load_patches()
    for status in registry.apply_patches(registry.current_context(cpu_backend=on_cpu)):
        log0(status.line())
    argv, platform_lines = with_platform_defaults(argv, on_cpu=on_cpu)
    argv, logging_lines = with_logging_defaults(argv)
    for line in platform_lines + logging_lines + set_environment_defaults(argv, os.environ):
        log0(line)

    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from moe_launcher.data import train_valid_test_datasets
    from moe_launcher.gpt_step import forward_step

    sys.argv = [sys.argv[0], *argv]
    args = parse_and_validate_args()
    log0(f"[pretrain_moe] megatron-core {track} track, "
         f"{'CPU backend (gloo)' if on_cpu else 'CUDA'}, transformer-impl {args.transformer_impl}")
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(config, train_valid_test_datasets, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UnsupportedMegatronVersion as error:
        sys.exit(f"pretrain_moe: error: {error}")
