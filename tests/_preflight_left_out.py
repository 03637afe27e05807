"""pretrain_moe.py with one preflight check left out ($PREFLIGHT_LEFT_OUT names it): what
megatron does with a command line that check refuses. Run like pretrain_moe.py."""

import os
import sys

import pretrain_moe
from moe_launcher import checkpoint_paths, dependencies, preflight  # noqa: F401 (they register)

del preflight._CHECKS[os.environ["PREFLIGHT_LEFT_OUT"]]
pretrain_moe.main(sys.argv[1:])
