"""`python -m megatron_patches.checkpoint_audit CKPT_DIR [--json]`: the documented name of the
offline checkpoint audit, kept as users' scripts call it. The audit lives in
moe_launcher/checkpoint_files/audit.py (it is a checkpoint reader, not a patch)."""

import sys

from moe_launcher.checkpoint_files.audit import main

if __name__ == "__main__":
    sys.exit(main())
