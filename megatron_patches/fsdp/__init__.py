"""Patches to Megatron-FSDP (expert tensor parallelism, fsdp_dtensor checkpoints, gradients)."""
