"""Patches to how megatron-core builds and installs: its dataset helpers and the local spec's norms."""
