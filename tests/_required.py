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


def require_legacy_megatron() -> None:
    """Skip unless megatron-core 0.15.x (the legacy track) is installed. scripts/test.sh runs the
    legacy tests as their own suite (LEGACY_SUITE=1): there the wrong megatron-core in
    .venv-legacy is a broken set-up and fails, not a skip."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.specifiers import SpecifierSet

    try:
        installed = version("megatron-core") in SpecifierSet("~=0.15.0")
    except PackageNotFoundError:
        installed = False
    require(installed,
            "needs megatron-core 0.15.x (.venv-legacy: MCORE=legacy bash scripts/setup.sh)",
            enforced_by="LEGACY_SUITE")
