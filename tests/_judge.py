"""The launcher's checks before any work, judged in the test process: what pretrain_moe.main
runs on a command line before it initialises anything (environment defaults, the GPU-request
check, the platform, model and logging defaults, then moe_launcher.megatron_validation.
checked_command_line: megatron's parser, this project's preflight checks, megatron's
validation, tokenizer and config), as rank 0 of a world of the given size on a machine without
CUDA.

A launch costs seconds (and 5 more for every refused world of several ranks, whose other ranks
linger for torchrun); this costs milliseconds, so each refusal rule is judged here, and the
every-rank contract (exit status 2 on every rank, one line, no traceback) is proven by the few
real launches in tests/moe_launcher/test_preflight.py and test_flag_matrix.py.
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys


@functools.cache
def launcher_checks():
    """checked_command_line, with the patches main applies (the layer-layout patch wraps
    megatron's validate_args)."""
    from megatron_patches import registry

    registry.load_patches()
    registry.apply_patches(registry.current_context(cpu_backend=True))
    from moe_launcher.megatron_validation import checked_command_line

    return checked_command_line


def judge(world: int, argv: list[str], monkeypatch) -> str | None:
    """None when every check before work passes; else the refusal line."""
    from moe_launcher.runtime.refusals import PreflightError

    try:
        checked_args(world, argv, monkeypatch)
        return None
    except PreflightError as error:
        return error.line()


def checked_args(world: int, argv: list[str], monkeypatch):
    """megatron's arguments for `argv` as rank 0 of `world` gets them after every check before
    work (what its load then reads); raises PreflightError where a check refuses."""
    from moe_launcher.platform_defaults import set_environment_defaults
    from moe_launcher.preflight import check_gpu_request

    entry = launcher_checks()
    environ = {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0"}
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    set_environment_defaults(argv, environ)  # as pretrain_moe.main does, into monkeypatch's care
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the entry sets megatron's argv
    check_gpu_request(argv, cuda_available=False)
    with contextlib.redirect_stdout(io.StringIO()):  # megatron prints every argument
        return entry(with_launcher_defaults(argv))[0]


def with_launcher_defaults(argv: list[str]) -> list[str]:
    """argv with the defaults pretrain_moe.main adds on a machine without CUDA."""
    from moe_launcher.platform_defaults import (
        with_logging_defaults, with_model_defaults, with_platform_defaults)

    argv, _ = with_platform_defaults(argv, on_cpu=True)
    argv, _ = with_model_defaults(argv)
    argv, _ = with_logging_defaults(argv)
    return argv
