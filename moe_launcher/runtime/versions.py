"""The megatron-core versions this project supports, checked before anything else runs."""

from importlib.metadata import version as installed_version

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# 0.19.2 is the pinned default; 0.15.x is the legacy target where the ETP checkpoint bug lives.
SUPPORTED = {"default": SpecifierSet("==0.19.2"), "legacy": SpecifierSet("~=0.15.0")}


class UnsupportedMegatronVersion(RuntimeError):
    pass


def check_megatron_version(version: str | None = None) -> str:
    """Returns 'default' or 'legacy' for the installed megatron-core; raises for anything else.

    Reads the installed distribution's metadata, so it runs before megatron is imported.
    """
    found = Version(version or installed_version("megatron-core"))
    for track, spec in SUPPORTED.items():
        if found in spec:
            return track
    raise UnsupportedMegatronVersion(
        f"megatron-core {found} is not supported: this launcher supports megatron-core 0.19.2 "
        f"(default) and 0.15.x (legacy). Fix: run `bash scripts/setup.sh` (0.19.2) or "
        f"`MCORE=legacy bash scripts/setup.sh` (0.15.x)."
    )


def check_training_package() -> None:
    """pretrain() comes from megatron.training, which the 0.19.2 wheel ships and 0.15.x's lacks."""
    import importlib.util

    if importlib.util.find_spec("megatron.training") is None:
        raise UnsupportedMegatronVersion(
            f"megatron-core {installed_version('megatron-core')} is installed without "
            f"megatron.training, whose pretrain() pretrain_moe.py runs; the legacy track carries "
            f"the checkpoint fixes for megatron-core's own code. Fix: train with the default "
            f"track (`bash scripts/setup.sh`, megatron-core 0.19.2).")
