"""megatron's log set-up holds when emerging-optimizers is installed.

megatron-core 0.19.2 configures Python logging when `megatron.training.training` is imported:
its own handler (`megatron.training.log_handler.CustomHandler`: to stdout, torch.distributed's
records left out) at level INFO, through `logging.basicConfig`, which does nothing once the root
logger has a handler. With emerging-optimizers installed (the lock has it, for
`--optimizer muon`), `megatron.core.optimizer`, imported before that line by
`megatron.training`'s own imports, builds emerging-optimizers' registry, which logs through absl;
absl's first log calls `logging.basicConfig()` itself when the root logger has no handler: a
stderr handler at WARNING. megatron's call then changes nothing, and every INFO record of
megatron is dropped (its gradient-bucket layout, distributed-optimizer and checkpoint records)
while torch.distributed's warnings pass.

The patch gives the root logger what megatron's line asks for, where it did not take: megatron's
handler in place of the bare stderr handler `logging.basicConfig()` made, and level INFO. A root
logger configured otherwise (a handler of the user's) is left alone. Needed where the root logger
lacks megatron's handler after megatron's training module is imported. Targets 0.19.x.
"""

from __future__ import annotations

import logging

from megatron_patches.registry import Patch, register

NAME = "megatron-logging-setup"


def _root_has_megatron_handler() -> bool:
    from megatron.training import training  # noqa: F401  (megatron's set-up runs at import)
    from megatron.training.log_handler import CustomHandler

    return any(isinstance(handler, CustomHandler) for handler in logging.getLogger().handlers)


def _bare_basic_config_handler(handler: logging.Handler) -> bool:
    """The handler a bare `logging.basicConfig()` makes (absl's first log): a plain
    StreamHandler of stderr with the default format."""
    import sys

    return (type(handler) is logging.StreamHandler and handler.stream is sys.stderr
            and handler.formatter is not None
            and handler.formatter._fmt == logging.BASIC_FORMAT)


def _not_needed_because(context):
    if _root_has_megatron_handler():
        return "megatron's logging set-up holds: its handler is the root logger's"
    if not all(_bare_basic_config_handler(handler) for handler in logging.getLogger().handlers):
        return "the root logger has a handler of another's, which stands"
    return None


def _apply():
    from megatron.training.log_handler import CustomHandler

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(CustomHandler())
    root.setLevel(logging.INFO)


PATCH = register(Patch(
    name=NAME,
    upstream="local (megatron-core 0.19.2 training/training.py's logging.basicConfig, "
             "pre-empted by absl's when emerging-optimizers is installed)",
    versions=">=0.19,<0.20",
    packages=("megatron.training",),
    summary="megatron's log handler and INFO level on the root logger, which absl's "
            "logging.basicConfig() took first (emerging-optimizers' import): megatron's INFO "
            "records were dropped",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
