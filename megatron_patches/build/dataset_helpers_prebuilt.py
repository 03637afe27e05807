"""Skip megatron's run-time `make` of the dataset helpers when the compiled helper is present.

megatron.training.initialize calls `megatron.core.datasets.utils.compile_helpers()`, which runs
`make` in the installed package folder. The PyPI wheel ships the compiled `helpers_cpp` module but
no Makefile, so that `make` fails on every fresh install (GPU too) and the job exits.
Targets: megatron-core wheels 0.15.x - 0.19.x.
"""

import importlib.util
import os

from megatron.core.datasets import utils as dataset_utils

from megatron_patches.registry import Patch, register


def _makefile_present() -> bool:
    return os.path.exists(os.path.join(os.path.dirname(dataset_utils.__file__), "Makefile"))


def _helpers_prebuilt() -> bool:
    return importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None


def _not_needed_because(context):
    if _makefile_present():
        return "megatron-core ships its Makefile: compile_helpers can build"
    if not _helpers_prebuilt():
        return "no prebuilt helpers_cpp either: megatron's own build must run"
    return None


def _apply():
    build = dataset_utils.compile_helpers

    def compile_helpers():
        if not _helpers_prebuilt():
            build()

    dataset_utils.compile_helpers = compile_helpers


PATCH = register(Patch(
    name="dataset-helpers-prebuilt",
    upstream="wheel packaging: compile_helpers runs make without a Makefile",
    versions=">=0.15,<0.20",
    summary="use the compiled helpers_cpp the wheel ships instead of running make",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
