"""Warnings a CPU run prints on every rank alike, said by rank 0 only.

Without Transformer Engine, Apex or a GPU, megatron and torch warn about their fallbacks (the
local norm and optimizer kernels, pinned memory without an accelerator, this backend's
emulation touching a non-leaf `.grad`) and about deprecated APIs megatron calls: the same
lines from each rank, over a hundred of a 4-rank run's log. Rank 0 still prints each one;
the other ranks drop exactly these messages, so a warning that only some rank has, or any
other, is printed as before.
"""

from __future__ import annotations

import logging
import os
import warnings

# Message starts (warnings' `message` regex, matched at the start, case-insensitively).
SAME_ON_EVERY_RANK = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"Only transformer-engine>=",
    r"'pin_memory' argument is set as true but no accelerator is found",
    r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
    r"`torch\.distributed\.[a-z_]+` is deprecated",
    r"MimoModelConfig is experimental",
    r"full scope is deprecated",
)
# torch's "No CUDA runtime is found, using CUDA_HOME=..." when torch.utils.cpp_extension is
# imported on a machine with a CUDA toolkit and no GPU.
_IMPORT_LOGGERS = ("torch.utils.cpp_extension",)


def fallback_warnings_from_rank_0_only(environ=os.environ) -> None:
    """On ranks other than 0, drops the warnings every rank of a CPU run prints alike."""
    if environ.get("RANK", "0") == "0":
        return
    for message in SAME_ON_EVERY_RANK:
        warnings.filterwarnings("ignore", message=message)
    for name in _IMPORT_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
