import os
import sys
from pathlib import Path

import torch

# Test helper modules (tests/_*.py) import as top-level modules.
sys.path.insert(0, str(Path(__file__).parent))

# In-process tests build real megatron models; without CUDA that needs the CPU backend, which
# must be active before anything imports megatron (collection included).
if not torch.cuda.is_available():
    from moe_launcher import cpu_backend

    # Strict device mode for this process and every process a test launches (they inherit the
    # environment): a host tensor on a group that is NCCL on a GPU is refused, as NCCL would.
    os.environ[cpu_backend.STRICT_DEVICE_ENV] = "1"
    cpu_backend.activate()
