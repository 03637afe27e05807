"""Checkpoint conversion between Hugging Face MoE models and the launcher's torch_dist checkpoints.

    python -m moe_launcher.convert import-hf HF_DIR OUT_DIR
    python -m moe_launcher.convert export-hf CKPT_DIR OUT_DIR [--iteration N] [--tokenizer DIR]

Both directions run in one process at world size 1 on megatron's local spec (the launcher's CPU
build): torch_dist is reshardable, so what is written at TP1 loads at any TP/PP/EP/ETP, and any
layout's checkpoint loads at TP1. `families` holds the per-architecture mappings.
"""
