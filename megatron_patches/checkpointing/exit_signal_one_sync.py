"""`--exit-signal-handler` asks every rank once per iteration with one all-reduce and one host
sync, not an all-gather and one `.item()` per rank.

Upstream: local (megatron-core 0.19.2 `megatron/training/dist_signal_handler.py`; the same code
in 0.15.x). Targets megatron-core 0.15-0.19.

megatron's training loop calls `any(get_signal_handler().signals_received())` after every
iteration when `--exit-signal-handler` is set (train.sh sets it, so that a Slurm SIGTERM saves
before the job ends). `signals_received` all-gathers one int32 per rank into `world_size`
separate one-element tensors on the GPU and copies each back with `.item()`: `world_size`
device-to-host syncs per rank per step, about 1,000 at 1,024 ranks, each waiting for the GPU.
The only caller needs whether any rank received the signal, which is one all-reduce (max) and
one sync. The patched method returns that as a one-element list, so `any(...)` reads the same.
"""

from __future__ import annotations

import functools

from megatron_patches.registry import Patch, PatchContext, register

NAME = "exit-signal-one-sync"


def _handler_class():
    from megatron.training.dist_signal_handler import DistributedSignalHandler

    return DistributedSignalHandler


def _apply() -> None:
    handler_cls = _handler_class()
    signals_received = handler_cls.signals_received
    if getattr(signals_received, "__wrapped_by__", None) == NAME:
        return

    @functools.wraps(signals_received)
    def any_rank_received(self):
        from moe_launcher.runtime import collectives

        # collectives.reduce_numbers: one all-reduce on the current CUDA device, one sync.
        return [bool(collectives.reduce_numbers([int(self._signal_received)], "max")[0])]

    any_rank_received.__wrapped_by__ = NAME
    handler_cls.signals_received = any_rank_received


def _not_needed_because(context: PatchContext) -> str | None:
    # Behaviour needs a process group (without one megatron returns the local flag); what the
    # method calls tells which of the two it is: the per-rank all-gather, or something else.
    from megatron_patches.registry import unwrapped

    names = unwrapped(_handler_class().signals_received).__code__.co_names
    if "all_gather_item" not in names:
        return "DistributedSignalHandler.signals_received does not all-gather per-rank flags"
    return None


PATCH = register(Patch(
    name=NAME,
    upstream="local (megatron/training/dist_signal_handler.py)",
    versions=">=0.15,<0.20",
    packages=("megatron.training",),
    summary="the exit-signal check is one all-reduce and one host sync per iteration",
    not_needed_because=_not_needed_because,
    apply=_apply,
))
