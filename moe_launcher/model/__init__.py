"""The model megatron built: its record, the layer layout, true parameter shapes, the hybrid spec."""
