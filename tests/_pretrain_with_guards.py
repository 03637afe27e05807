"""pretrain_moe.py with this branch's checkpoint guards loaded, as the launcher will once
registry.PATCH_MODULES lists megatron_patches.checkpoint_guard (the lead owns that file)."""

import sys

from megatron_patches import registry

if "megatron_patches.checkpoint_guard" not in registry.PATCH_MODULES:
    registry.PATCH_MODULES = (*registry.PATCH_MODULES, "megatron_patches.checkpoint_guard")

import pretrain_moe  # noqa: E402  (after the module list is extended)

if __name__ == "__main__":
    pretrain_moe.main(sys.argv[1:])
