"""Patches to megatron-core's checkpoint save, load and resume paths."""
