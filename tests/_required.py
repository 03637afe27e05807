"""What a test needs from the machine: skipped where it is missing, except in CI.

`.ci/run` installs Slurm, munge and shellcheck and sets CI=true; there a missing tool means the
set-up broke, and a skip would hide every test behind it, so it fails instead.
"""

from __future__ import annotations

import os

import pytest


def require(present: bool, missing: str, *, enforced_by: str = "") -> None:
    """Skip the calling test when `present` is false; fail instead under CI=true, or when the
    environment variable `enforced_by` is 1 (a suite run for that tool alone)."""
    if present:
        return
    if os.environ.get("CI") == "true" or (enforced_by and os.environ.get(enforced_by) == "1"):
        pytest.fail(missing, pytrace=False)
    pytest.skip(missing)


def transformer_engine_missing() -> str | None:
    """Why a GPU test of Transformer Engine's spec cannot run here (None: it can)."""
    import torch

    if not torch.cuda.is_available():
        return "needs CUDA"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as error:  # a TE built for another torch fails in many ways
        return f"needs Transformer Engine ({type(error).__name__})"
    return None
