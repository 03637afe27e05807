"""How a patch wraps megatron's `training_log` where `train()` calls it
(megatron.training.training): once per patch, with each call's arguments bound by megatron's own
signature. Used by first-log-interval-reset, skipped-interval-loss-line and expert-load-metrics.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from megatron_patches import registry


def wrap_training_log(name: str,
                      around: Callable[[Callable, inspect.BoundArguments], Any]) -> None:
    """Makes every call of training_log `around(megatron_log, bound)`: `megatron_log` the
    training_log this wraps, `bound` the call's arguments (no defaults applied), which
    `megatron_log(*bound.args, **bound.kwargs)` passes on as given. Once per patch `name`."""
    from megatron.training import training

    if registry.wrapped_by(training.training_log, name):
        return
    megatron_log = training.training_log
    signature = inspect.signature(registry.unwrapped(megatron_log))

    @functools.wraps(megatron_log)
    def training_log(*args, **kwargs):
        return around(megatron_log, signature.bind(*args, **kwargs))

    training_log.__wrapped_by__ = name
    training.training_log = training_log
