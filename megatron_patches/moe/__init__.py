"""Patches to megatron-core's MoE routing, auxiliary losses and their logs."""
