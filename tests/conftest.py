import sys
from pathlib import Path

import torch

# Test helper modules (tests/_*.py) import as top-level modules.
sys.path.insert(0, str(Path(__file__).parent))

# In-process tests build real megatron models; without CUDA that needs the CPU backend, which
# must be active before anything imports megatron (collection included).
if not torch.cuda.is_available():
    from megatron_patches import cpu_backend

    cpu_backend.activate()
