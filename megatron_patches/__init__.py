"""Named, documented fixes to megatron-core, applied by pretrain_moe.py at startup.

Each patch module registers a `registry.Patch` naming the upstream issue it fixes and the
megatron-core versions it targets. See README.md ("Patches") for the list.
"""
