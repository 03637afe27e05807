"""Patches to what megatron-core reports about the model it built: layers, FLOPs, MFU, parameters."""
